"""`raykv bench transport --cpu-smoke`: the NCCL section's processes and report run with gloo
on the CPU (a check of the bench's plumbing, not a measurement): every method is timed, the
like-for-like ratios are there, and B's blocks equal A's after the run (the peer reads, from A's
shared memory, run last and into zeroed blocks: the check is theirs)."""

from raykv.bench.transport_nccl import nccl_format, nccl_main


def test_the_nccl_bench_runs_on_the_cpu_with_like_for_like_ratios() -> None:
    report = nccl_main(cpu_smoke=True, blocks=16)
    assert report is not None
    (row,) = report["rows"]
    assert row["equal"] and row["all_blocks"], row
    methods = ("raykv", "in_flight", "contiguous", "contiguous_waited", "per_block", "peer")
    for method in (*methods, "peer_in_flight"):
        assert row[method] > 0, (method, row)
    assert row["raykv_vs_contiguous_waited"] == row["raykv"] / row["contiguous_waited"]
    assert row["in_flight_vs_contiguous"] == row["in_flight"] / row["contiguous"]
    assert row["peer_vs_contiguous_waited"] == row["peer"] / row["contiguous_waited"]
    table = nccl_format(report)
    assert "contiguous one at a time" in table and "contiguous queued" in table
    assert "peer reads" in table

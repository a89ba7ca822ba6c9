"""`raykv bench transport --cpu-smoke`: the NCCL section's processes and report run with gloo
on the CPU (a check of the bench's plumbing, not a measurement): every method is timed, the
like-for-like ratios are there, and B's blocks equal A's after the run (the peer reads, from A's
shared memory, run last and into zeroed blocks: the check is theirs)."""

import pytest

from raykv.bench.transport_nccl import NcclConfig, nccl_format, nccl_main, nccl_report
from raykv.errors import ConfigError
from raykv.layout import sizing
from raykv.layout.presets import get_preset


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
    assert row["in_flight_gpu"] is None and "GPUs alone" not in table  # CUDA only


def test_the_gpus_alone_are_reported_against_the_contiguous_sends_timed_alike() -> None:
    cfg = NcclConfig(blocks=16)
    times = {"raykv": 4e-3, "in_flight": 3e-3, "contiguous": 2e-3, "contiguous_waited": 2.5e-3,
             "in_flight_gpu": 1.6e-3, "contiguous_gpu": 1.2e-3}  # fmt: skip
    reader = {f"split/{k}": v for k, v in times.items()}
    reader.update({"device": "gpu", "split/equal": True, "split/good": [16]})
    report = nccl_report(cfg, {("A", 0): {}, ("B", 0): reader})
    (row,) = report["rows"]
    payload = 16 * cfg.row_bytes
    assert row["in_flight_gpu"] == payload / 1.6e-3 / 1e9
    assert row["contiguous_gpu"] == payload / 1.2e-3 / 1e9
    assert row["in_flight_gpu_vs_contiguous_gpu"] == row["in_flight_gpu"] / row["contiguous_gpu"]
    assert "the GPUs alone" in nccl_format(report) and "= 0.750 x" in nccl_format(report)


@pytest.mark.parametrize(("preset", "tp"), [("llama-3-8b", 2), ("llama-3-70b", 4),
                                            ("deepseek-v3", 2), ("llama-3-8b", 1)])  # fmt: skip
def test_a_preset_batch_is_the_planners_bytes_per_block_and_rank(preset: str, tp: int) -> None:
    """``--preset``: a batch's rows are the bytes a rank's pool holds per block of that
    model (the planner's ``gpu_bytes_per_block`` at that TP size), ``tokens`` of them."""
    cfg = NcclConfig.for_preset(preset, 32768, tp)
    plan = sizing.plan(get_preset(preset).layers(), gpu_bytes=8 << 30, max_model_len=32768,
                       max_num_batched_tokens=8192, tp_size=tp)  # fmt: skip
    assert cfg.row_bytes == plan.gpu_bytes_per_block
    assert cfg.blocks * cfg.block_size == 32768
    assert cfg.layouts == (["mla"] if preset == "deepseek-v3" else ["split"])


def test_a_preset_the_bench_cannot_lay_out_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"jamba-v0\.1.*Mamba"):
        NcclConfig.for_preset("jamba-v0.1", 4096)
    with pytest.raises(ConfigError, match=r"--tokens 100 .* block size 16"):
        NcclConfig.for_preset("llama-3-8b", 100)
    with pytest.raises(ConfigError, match="give --preset"):
        nccl_main(cpu_smoke=True, tokens=4096)


def test_the_nccl_bench_runs_a_preset_batch_on_the_cpu() -> None:
    report = nccl_main(cpu_smoke=True, tp=2, preset="deepseek-v3", tokens=128)
    assert report is not None
    (row,) = report["rows"]
    assert row["layout"] == "mla" and row["equal"] and row["all_blocks"], row
    assert row["block_kib"] * 1024 == NcclConfig.for_preset("deepseek-v3", 128, 2).row_bytes
    assert row["wire_mib"] == row["mib_per_pair"]  # one latent copy crosses per group
    assert "deepseek-v3's KV layout (128 tokens)" in nccl_format(report)

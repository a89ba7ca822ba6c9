"""``raykv bench tiers``' parts, small: the tier forced to buffered I/O beside O_DIRECT, and a
prompt served from the disk tier against recomputing it (the torch forward pass: no vLLM
start in a unit test)."""

from __future__ import annotations

from raykv.bench import recompute, tiers


def test_the_buffered_tier_writes_and_reads_the_same_entries(tmp_path):
    plan = tiers.bench_plan()
    arena, valid, sums = tiers.entries(plan, 8 * plan.gpu_bytes_per_block)
    direct = tiers.disk_tier(tmp_path, plan, arena, valid, sums)
    buffered = tiers.disk_tier(tmp_path, plan, arena, valid, sums, direct=False)
    assert direct["direct"] and not buffered["direct"]  # /tmp here takes O_DIRECT
    assert "warm_read_s" in buffered and "warm_read_s" not in direct
    assert min(buffered["write_s"], buffered["read_s"], buffered["warm_read_s"]) > 0
    assert not list(tmp_path.iterdir())  # each run's tier removed


def test_a_prompt_from_disk_against_its_recompute(tmp_path):
    seconds, kv_bytes = recompute.disk_seconds(tmp_path, 256, 1)
    assert seconds > 0 and kv_bytes == 256 * 4096  # the tiny Llama: 4 KiB of KV a token
    report = recompute.run((64, 128), 1, str(tmp_path), engine="torch", echo=lambda _: None)
    assert [p["tokens"] for p in report["points"]] == [64, 128]
    assert all(p["disk_s"] > 0 and p["recompute_s"] > 0 for p in report["points"])
    assert report["engine"].startswith("torch")
    assert "128" in recompute.format_report(report)


def test_lengths_must_be_whole_blocks():
    from click.testing import CliRunner

    from raykv import cli

    res = CliRunner().invoke(cli.main, ["bench", "tiers", "--vs-recompute", "--lengths", "100"])
    assert res.exit_code == 2 and "multiples of the engine's block, 32" in res.output


def test_the_ratio_is_recompute_over_disk():
    assert recompute.format_point(recompute.Point(32, 4096 * 32, 0.5, 1.0)).split()[-1] == "2.00"

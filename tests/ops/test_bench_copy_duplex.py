"""`raykv bench copy --duplex` on CPU: the report's structure, and a store and a load run at once
(two threads on the reference) move exactly the right bytes."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner
from paged_copy_cases import oracle_rows

from raykv.bench.copy import (
    DUPLEX_METHODS,
    DUPLEX_RATES,
    CopyLayout,
    _duplex_jobs,
    _DuplexPool,
    _Lanes,
    format_duplex_table,
)
from raykv.cli import main


def test_bench_copy_duplex_reports_both_directions_alone_and_together(tmp_path):
    out = tmp_path / "duplex.json"
    result = CliRunner().invoke(
        main, ["bench", "copy", "--duplex", "--device", "cpu", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "NO CUDA" in result.output and "raykv/contig" in result.output
    report = json.loads(out.read_text())
    assert report["kind"] == "duplex" and report["target"] == 0.9
    assert {"date", "device", "torch", "cuda", "path"} <= set(report)
    results = report["results"]
    assert {(r["layout"], r["blocks"]) for r in results} == {
        (lay, n) for lay in ("tiny block16", "tiny block128/kernel64") for n in (4, 16)
    }
    keys = {k for k, _ in DUPLEX_RATES}
    for r in results:
        assert r["verified"], r
        assert set(r["gbps"]) == set(DUPLEX_METHODS) == set(r["ms"])
        for m in DUPLEX_METHODS:
            assert set(r["gbps"][m]) == keys | {"total_serial"}
            assert all(v > 0 for v in r["gbps"][m].values())
            assert r["ms"][m]["total_together"] >= max(
                r["ms"][m]["store_together"], r["ms"][m]["load_together"]
            )
            assert r["together_over_serial"][m] > 0
        assert set(r["raykv_over_contiguous"]) == keys
        ratio = r["gbps"]["raykv"]["total_together"] / r["gbps"]["contiguous"]["total_together"]
        assert abs(r["raykv_over_contiguous"]["total_together"] - ratio) < 1e-9
        assert r["meets_target"] == (ratio >= 0.9)
    assert format_duplex_table(report).count("raykv/contig") == len(results)


def test_bench_copy_duplex_json_only_on_stdout():
    options = ["--duplex", "--device", "cpu", "--counts", "3", "--reps", "1", "--json", "-"]
    result = CliRunner().invoke(main, ["bench", "copy", *options])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {r["blocks"] for r in report["results"]} == {3}


def test_duplex_store_and_load_at_once_move_exact_bytes():
    """The benchmark's own store and load jobs, run together on two threads, three times: the
    stored rows are the blocks' bytes (an independent oracle), the loaded blocks hold the rows,
    and the round trip back through a store gives the loaded rows again."""
    pool = _DuplexPool(CopyLayout("tiny", 2, 2, 8, 32, 16), 12, torch.device("cpu"))
    lanes = _Lanes(torch.device("cpu"), 2)
    try:
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            picked = torch.randperm(pool.num_blocks, generator=gen)[:24].to(torch.int64)
            store_ids, load_ids = picked[:12], picked[12:]
            want_stored = oracle_rows(pool.entries, store_ids.tolist())
            pool.host_in.copy_(torch.randint(0, 256, pool.host_in.shape, generator=gen))
            store, load = _duplex_jobs(pool, store_ids, load_ids)["raykv"]
            lanes.once([store, load])
            assert [bytes(r.numpy()) for r in pool.host_out] == want_stored
            assert oracle_rows(pool.entries, load_ids.tolist()) == [
                bytes(r.numpy()) for r in pool.host_in
            ]
            back = _duplex_jobs(pool, load_ids, store_ids)["raykv"][0]  # store the loaded blocks
            back()
            assert torch.equal(pool.host_out, pool.host_in)
    finally:
        lanes.close()

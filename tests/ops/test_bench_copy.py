"""`raykv bench copy` smoke test on CPU: tiny sizes, reference path, every method and field."""

from __future__ import annotations

import ctypes
import json

import torch
from click.testing import CliRunner

from raykv import ops
from raykv.bench.copy import METHODS, CopyLayout, _loop_pointers, _per_entry, _Pool
from raykv.cli import main


def test_bench_copy_quick_runs_and_reports_every_method(tmp_path):
    out = tmp_path / "copy.json"
    result = CliRunner().invoke(
        main, ["bench", "copy", "--quick", "--device", "cpu", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "raykv path: torch reference" in result.output
    assert "NO CUDA" in result.output
    report = json.loads(out.read_text())
    layouts = {r["layout"] for r in report["results"]}
    assert len(layouts) == 2
    assert {r["direction"] for r in report["results"]} == {"pool->rows", "rows->pool"}
    for r in report["results"]:
        assert r["verified"]
        assert set(r["gbps"]) == set(METHODS)
        assert all(v > 0 for v in r["gbps"].values())
        assert r["raykv_over_contiguous"] > 0 and r["raykv_over_per_block"] > 0
        assert r["raykv_over_per_layer"] > 0 and r["direct_over_contiguous"] > 0


def test_bench_copy_json_only_on_stdout():
    result = CliRunner().invoke(
        main, ["bench", "copy", "--device", "cpu", "--counts", "3", "--reps", "1", "--json", "-"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert {r["blocks"] for r in report["results"]} == {3}


def test_per_block_baseline_pointers_move_the_right_bytes():
    """The memcpy loop's (dst, src, size) spans, run with memmove on CPU, equal a gather."""
    pool = _Pool(CopyLayout("tiny", 2, 2, 8, 32, 16), 8, torch.device("cpu"))
    ids = torch.randperm(pool.num_blocks)[:8].to(torch.int64)
    host = pool.host[:8]
    dsts, srcs, sizes = (t.tolist() for t in _loop_pointers(pool, ids, host, True))
    for dst, src, size in zip(dsts, srcs, sizes, strict=True):
        ctypes.memmove(dst, src, size)
    want = torch.empty_like(host)
    ops.gather_blocks(pool.entries, ids, want)
    assert torch.equal(host, want)


def test_per_layer_baseline_regroups_the_same_spans_entry_by_entry():
    """The per-layer loop's spans (one call per layer and K/V) run with memmove equal a gather."""
    pool = _Pool(CopyLayout("tiny", 2, 2, 8, 32, 16), 8, torch.device("cpu"))
    ids = torch.randperm(pool.num_blocks)[:8].to(torch.int64)
    host = pool.host[:8]
    per_entry = _per_entry(_loop_pointers(pool, ids, host, True), len(pool.entries))
    assert len(per_entry) == len(pool.entries) == 4
    for dsts, srcs, sizes in per_entry:
        assert dsts.is_contiguous() and len(dsts) == len(srcs) == len(sizes) == 8
        for dst, src, size in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            ctypes.memmove(dst, src, size)
    want = torch.empty_like(host)
    ops.gather_blocks(pool.entries, ids, want)
    assert torch.equal(host, want)

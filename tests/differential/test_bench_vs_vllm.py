"""`raykv bench blocks --vs-vllm` runs end to end (two traces; speed is the bench's job)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs the optional extra 'vllm'")

from raykv.cli import main


def test_bench_blocks_vs_vllm_smoke():
    res = CliRunner().invoke(main, ["bench", "blocks", "--vs-vllm", "--traces", "3", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["op"]: r for r in json.loads(res.output[res.output.index("[") :])}
    assert {"admission", "decode", "free", "all"} <= set(rows)
    assert all(r["raykv_us"] > 0 and r["vllm_us"] > 0 for r in rows.values())

"""`raykv bench blocks` runs end to end (tiny sizes; speed is the bench's job, not CI's)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from raykv.cli import main


def test_bench_blocks_smoke():
    args = ["bench", "blocks", "--requests", "8", "--steps", "20", "--prompt-len", "64"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "full attention" in res.output and "us/req-step" in res.output
    res = CliRunner().invoke(main, [*args, "--json"])
    rows = json.loads(res.output)
    assert [r["layout"] for r in rows] == ["full", "hybrid"]
    assert all(r["hit_rate"] > 0 for r in rows)  # 8 requests share 4 system prompts

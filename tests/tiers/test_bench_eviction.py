"""`raykv bench eviction --quick`: runs without Ray and reports sane hit rates and writes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from raykv.bench.eviction import POLICIES, simulate
from raykv.cli import main
from raykv.errors import ConfigError


def test_bench_eviction_quick_reports_sane_rates(tmp_path) -> None:
    out = tmp_path / "eviction.json"
    result = CliRunner().invoke(main, ["bench", "eviction", "--quick", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "lru+tinylfu" in result.output
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {r["policy"] for r in rows} == set(POLICIES)
    alone = {(r["cpu_blocks"], r["lower_blocks"]): r for r in rows if r["policy"] == "none"}
    assert len(alone) == 4
    for r in rows:
        for k in ("cpu_hit", "lower_hit", "total_hit"):
            assert 0.0 <= r[k] <= 1.0
        assert r["total_hit"] == pytest.approx(r["cpu_hit"] + r["lower_hit"])
        base = alone[r["cpu_blocks"], r["lower_blocks"]]
        assert r["total_hit"] >= base["total_hit"]  # a lower tier only adds hits
        if r["policy"] == "none":
            assert r["writes"] == 0 and r["lower_hit"] == 0
        else:
            assert r["writes"] > 0 and r["lower_hit"] > 0
        if r["policy"] == "lru+tinylfu":  # the point of admission: fewer writes
            lru = next(x for x in rows if x["policy"] == "lru" and x["lower_blocks"] ==
                       r["lower_blocks"] and x["cpu_blocks"] == r["cpu_blocks"])  # fmt: skip
            assert r["writes"] < lru["writes"]


def test_simulate_counts_prefix_hits_per_tier() -> None:
    a, b, c = (bytes([i]) * 32 for i in range(3))
    # CPU tier of 1 block: a is evicted to the lower tier when b comes, b when c comes
    row = simulate([[a, b], [c], [a, b]], "lru", cpu_blocks=1, lower_blocks=4)
    assert row.writes == 3  # a, b, c each evicted once; a and b's copies stay below
    assert row.cpu_hit == 0 and row.lower_hit == pytest.approx(2 / 5)
    # the cached prefix ends at the first block no tier holds: c is not a hit after d
    d = b"d" * 32
    row = simulate([[c], [d, c]], "lru", cpu_blocks=4, lower_blocks=4)
    assert row.cpu_hit == 0 and row.total_hit == 0
    with pytest.raises(ConfigError, match="unknown lower-tier policy"):
        simulate([[a]], "mru", 1, 1)

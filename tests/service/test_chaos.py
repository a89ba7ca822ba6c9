"""The chaos soak in CI (issue 44): ``raykv bench chaos`` for three minutes (the whole test
takes ~4 min on a 2-core box: the cluster's start, the soak with its last fault, the settle
and the stop) through the installed command line, in a process of its own (it starts its own
cluster). Every served byte is checked against what was stored for its prefix; every error
must be a raykv error; nothing may be left held once every request is freed."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

MINUTES = "3"


def test_a_soak_under_faults_serves_no_wrong_kv_raises_only_raykv_errors_and_leaks_nothing():
    out = subprocess.run(
        [sys.executable, "-m", "raykv.cli", "bench", "chaos", "--minutes", MINUTES, "--json"],
        capture_output=True,
        text=True,
        timeout=450,
    )
    # Ray's driver forwards its workers' log lines to stdout too: the report is the JSON
    # object that starts at its first key
    start = out.stdout.find('{\n  "machine"')
    assert start >= 0, (out.returncode, out.stdout[-3000:], out.stderr[-3000:])
    r, _ = json.JSONDecoder().raw_decode(out.stdout[start:])
    log = out.stderr[-4000:]
    assert r["wrong_kv"] == 0, (r["wrong_samples"], log)
    assert r["raw_errors"] == 0, (r["raw_samples"], log)
    assert r["leaked"] == 0, (r["leaks"], log)
    assert r["hung_threads"] == [], log
    assert out.returncode == 0, log
    # it did soak: calls of every kind, bytes checked, faults made
    assert r["checked_blocks"] > 0 and r["served_blocks"] > 0, r["operations"]
    for op in ("admit", "load", "read", "store", "free", "load_into", "store_from"):
        assert r["operations"].get(op, 0) > 0, r["operations"]
    assert sum(f["count"] for f in r["faults"].values()) >= 3, (r["fault_log"], log)

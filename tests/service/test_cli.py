"""`raykv up / status / down` against a head they start, and `raykv demo` end to end.

Each runs the real CLI in a subprocess; the head `up` starts is stopped by `down` through
the process group `up` recorded (RAYKV_STATE points into the test's tmp dir)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
RAYKV = str(Path(sys.executable).parent / "raykv")


def run(*args: str, env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [RAYKV, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture
def env(tmp_path):
    e = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return e | {"RAYKV_STATE": str(tmp_path / "up.json"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def test_up_status_down(env, tmp_path) -> None:
    # a token left by an earlier embedded ray.init() must not lock `status` out of the head
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    env = env | {"HOME": str(tmp_path)}
    try:
        up = run(
            "up",
            "--preset",
            "llama-3-8b",
            "--pool-mem",
            "64MiB",
            "--cpu-mem",
            "32MiB",
            "--max-model-len",
            "256",
            "--num-cpus",
            "1",
            env=env,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((tmp_path / "up.json").read_text())
        assert state["address"].startswith("127.0.0.1:")
        assert f"raykv is up at {state['address']}" in up.stdout
        st = run("status", "--json", env=env)
        assert st.returncode == 0, st.stderr
        s = json.loads(st.stdout)
        assert s["address"] == state["address"]
        assert "llama-3-8b" in s["models"]
        assert sorted(m["kind"] for m in s["members"]) == ["pool", "tier"]
        table = run("status", env=env)
        assert "hit rate" in table.stdout and "raykv-pool-llama-3-8b" in table.stdout
    finally:
        down = run("down", env=env)
    assert down.returncode == 0, down.stderr
    assert "stopped the local Ray head" in down.stdout
    assert not (tmp_path / "up.json").exists()
    gone = run("status", env=env)
    assert gone.returncode != 0 and "not up" in gone.stderr


def test_a_state_file_left_by_a_dead_head_is_not_waited_on(env, tmp_path) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "up.json").write_text(json.dumps({"address": f"127.0.0.1:{port}", "pid": 1}))
    st = run("status", env=env, timeout=60)
    assert st.returncode != 0 and "not up" in st.stderr


def test_demo_matches_a_full_recompute(env) -> None:
    demo = run("demo", "--prompt-tokens", "512", env=env)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "logits MATCH" in demo.stdout
    assert "prefill time saved" in demo.stdout


def test_bench_service_quick(env) -> None:
    out = run("bench", "service", "--quick", "--json", env=env)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["lookup"]["hit"]["hit_tokens"] == 32768 and r["lookup"]["miss"]["hit_tokens"] == 0
    assert r["lookup"]["hit"]["p99_ms"] >= r["lookup"]["hit"]["p50_ms"] > 0
    assert r["object_store"]["gb_per_s"] > 0

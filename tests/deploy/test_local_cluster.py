"""cluster/local.sh: a head and worker raylets on 127.0.0.1, each with its own resource."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LOCAL_SH = REPO / "cluster" / "local.sh"

# Runs in a fresh interpreter so this test never shares a Ray driver with other tests.
PROBE = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")
nodes = [n for n in ray.nodes() if n["Alive"]]
print(json.dumps([{"ip": n["NodeManagerAddress"], "resources": n["Resources"]} for n in nodes]))
"""


def _run(*args: str, env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LOCAL_SH), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def _processes_under(path: str) -> list[str]:
    """Command lines of live processes that mention `path` (Ray puts its temp dir in argv)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if path in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.mark.ray
def test_local_cluster_start_status_stop():
    # Short path: Ray's unix sockets live under it and must stay below 108 bytes.
    cluster_dir = tempfile.mkdtemp(prefix="rkv-", dir="/tmp")
    env = {
        **os.environ,
        "RAYKV_CLUSTER_DIR": cluster_dir,
        "RAYKV_DASHBOARD": "0",
        "RAY": str(Path(sys.executable).parent / "ray"),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    try:
        started = _run("start", "1", env=env)
        assert started.returncode == 0, started.stdout + started.stderr
        address = _run("address", env=env).stdout.strip()
        assert address.startswith("127.0.0.1:")

        probe = subprocess.run(
            [sys.executable, "-c", PROBE, address],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert probe.returncode == 0, probe.stderr
        import json

        nodes = json.loads(probe.stdout.strip().splitlines()[-1])
        assert len(nodes) == 2
        assert {n["ip"] for n in nodes} == {"127.0.0.1"}
        custom = sorted(k for n in nodes for k in n["resources"] if k.startswith("raykv_"))
        assert custom == ["raykv_head", "raykv_node_1"]
        assert not any(n["resources"].get("GPU") for n in nodes if "raykv_head" in n["resources"])

        status = _run("status", env=env)
        assert status.returncode == 0
        assert status.stdout.count("running") == 2, status.stdout
        assert "/metrics" in status.stdout
    finally:
        stopped = _run("stop", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert _processes_under(cluster_dir) == []
    assert "no local cluster" in _run("status", env=env).stdout
    shutil.rmtree(cluster_dir, ignore_errors=True)


def test_local_sh_rejects_bad_worker_count(tmp_path):
    env = {**os.environ, "RAYKV_CLUSTER_DIR": str(tmp_path / "c")}
    result = _run("start", "two", env=env, timeout=30)
    assert result.returncode != 0
    assert "'two'" in result.stderr

"""cluster/local.sh: a head and worker raylets on 127.0.0.1, each with its own resource."""

import json
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

@ray.remote(num_cpus=0, num_gpus=2, resources={"raykv_node_1": 1})
def visible_gpus():
    import os
    return os.environ.get("CUDA_VISIBLE_DEVICES")

print(json.dumps({
    "nodes": [{"ip": n["NodeManagerAddress"], "resources": n["Resources"]} for n in nodes],
    "worker_gpus": ray.get(visible_gpus.remote(), timeout=60),
}))
"""

# Stands in for the driver's tool: local.sh counts GPUs with `nvidia-smi -L`. Ray takes a GPU
# count given to `ray start` at its word, so the GPU split is testable without GPUs.
FAKE_NVIDIA_SMI = """#!/bin/sh
[ "$1" = -L ] || exit 1
echo "GPU 0: Fake GPU (UUID: GPU-00000000-0000-0000-0000-000000000000)"
echo "GPU 1: Fake GPU (UUID: GPU-00000000-0000-0000-0000-000000000001)"
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
    fake_bin = Path(cluster_dir) / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (fake_bin / "nvidia-smi").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake_bin}:{os.environ['PATH']}",
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

        probe = subprocess.run(  # a plain Ray driver: token auth is on (local.sh's default)
            [sys.executable, "-c", PROBE, address],
            env=env | {"RAY_AUTH_MODE": "token"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert probe.returncode == 0, probe.stderr
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        nodes = {
            next(k for k in n["resources"] if k.startswith("raykv_")): n for n in seen["nodes"]
        }
        assert sorted(nodes) == ["raykv_head", "raykv_node_1"]
        assert {n["ip"] for n in nodes.values()} == {"127.0.0.1"}
        # The head gets no GPUs; the single worker gets both, as CUDA_VISIBLE_DEVICES=0,1.
        assert "GPU" not in nodes["raykv_head"]["resources"]
        assert nodes["raykv_node_1"]["resources"]["GPU"] == 2
        assert sorted(seen["worker_gpus"].split(",")) == ["0", "1"]

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


def test_local_sh_rejects_bad_worker_counts_before_starting_anything(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (fake_bin / "nvidia-smi").chmod(0o755)
    env = {
        **os.environ,
        "RAYKV_CLUSTER_DIR": str(tmp_path / "c"),
        "PATH": f"{fake_bin}:{os.environ['PATH']}",
    }
    not_a_number = _run("start", "two", env=env, timeout=30)
    assert not_a_number.returncode != 0
    assert "'two'" in not_a_number.stderr
    too_many = _run("start", "3", env=env, timeout=30)
    assert too_many.returncode != 0
    assert "2 GPUs cannot give each of 3 workers its own GPU" in too_many.stderr
    assert not (tmp_path / "c" / "address").exists()

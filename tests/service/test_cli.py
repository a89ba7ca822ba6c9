"""The installed `raykv` as a user runs it: a subprocess from a plain shell (PATH and HOME
only, no RAY_* variables), on a host whose routed address is not loopback.

Where `ip netns` is permitted, the commands run in a network namespace the test makes, whose
default route leaves through 192.0.2.2 (TEST-NET-1, never dialled): the host on which Ray swaps
127.0.0.1 for the routed address and a driver that does not stay on loopback waits forever.
Every listener still binds 127.0.0.1 inside that namespace."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
BIN = Path(sys.executable).parent
RAYKV = str(BIN / "raykv")
SMALL = ["--pool-mem", "64MiB", "--cpu-mem", "32MiB", "--max-model-len", "256", "--num-cpus", "1"]
BARE = ["--num-cpus", "1"]  # no model: the service and its tiers


def _netns(name: str) -> bool:
    peer = name + "p"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "netns", "add", peer],
        ["ip", "-n", name, "link", "set", "lo", "up"],
        ["ip", "link", "add", name + "a", "netns", name, "type", "veth", "peer"],
        ["ip", "-n", name, "addr", "add", "192.0.2.2/24", "dev", name + "a"],
        ["ip", "-n", peer, "addr", "add", "192.0.2.1/24", "dev", name + "b"],
        ["ip", "-n", name, "link", "set", name + "a", "up"],
        ["ip", "-n", peer, "link", "set", name + "b", "up"],
        ["ip", "-n", name, "route", "add", "default", "via", "192.0.2.1"],
    ]
    steps[3] += ["name", name + "b", "netns", peer]
    if shutil.which("ip") is None:
        return False
    for cmd in steps:
        if subprocess.run(cmd, capture_output=True, check=False).returncode != 0:
            _drop_netns(name)
            return False
    return True


def _drop_netns(name: str) -> None:
    for ns in (name, name + "p"):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


@pytest.fixture(scope="module")
def host() -> Iterator[list[str]]:
    """The command prefix that runs a program on the non-loopback host ([] where network
    namespaces are not permitted: then this machine's own network)."""
    name = f"rkv{os.getpid() % 100000}"
    if _netns(name):
        yield ["ip", "netns", "exec", name]
        _drop_netns(name)
    else:
        yield []


@pytest.fixture
def home() -> Iterator[Path]:
    # short: Ray's unix sockets live under RAY_TMPDIR where a test sets it (107-byte limit)
    path = Path(tempfile.mkdtemp(prefix="rkv", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def plain_env(home: Path, **extra: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(home), **extra}


def run(host: list[str], *args: str, env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*host, "env", "-i", *(f"{k}={v}" for k, v in env.items()), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def session_alive(sid: int) -> list[str]:
    """Processes of session ``sid`` that have not exited (zombies are exited)."""
    out = subprocess.run(["ps", "-eo", "sid=,stat=,comm="], capture_output=True, text=True)
    rows = [line.split(None, 2) for line in out.stdout.splitlines()]
    return [r[2] for r in rows if len(r) == 3 and r[0] == str(sid) and not r[1].startswith("Z")]


def test_up_status_down_from_a_plain_shell(host, home) -> None:
    env = plain_env(home)
    state_path = home / ".cache" / "raykv" / "up.json"
    try:
        t0 = time.monotonic()
        up = run(host, RAYKV, "up", "--preset", "llama-3-8b", *SMALL, env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads(state_path.read_text())
        address = state["address"]
        assert address.startswith("127.0.0.1:")
        assert f"raykv is up at {address}" in up.stdout
        token = home / ".ray" / "auth_token"
        assert f"the token is in {token}" in up.stdout and token.stat().st_mode & 0o077 == 0

        st = run(host, RAYKV, "status", "--json", env=env, timeout=60)
        assert st.returncode == 0, st.stderr
        s = json.loads(st.stdout)
        assert s["address"] == address and "llama-3-8b" in s["models"]
        assert sorted(m["kind"] for m in s["members"]) == ["pool", "tier"]
        table = run(host, RAYKV, "status", env=env, timeout=60)
        assert "hit rate" in table.stdout and "raykv-pool-llama-3-8b" in table.stdout

        # a model too large for CPU-device pools: the fix named is the pool size, not GPUs
        big = run(host, RAYKV, "up", "--preset", "llama-3-70b", "--pool-mem", "64MiB", env=env)
        assert big.returncode != 0
        assert "--pool-mem" in big.stderr and "GPU memory" not in big.stderr, big.stderr

        # Ray's token auth is on: a driver without the token is refused (and not hung)
        stranger = home / "stranger"
        stranger.mkdir()
        probe = f"import ray; ray.init(address={address!r}, _node_ip_address='127.0.0.1')"
        no_token = run(
            host,
            sys.executable,
            "-c",
            probe,
            env=plain_env(stranger, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"),
            timeout=120,
        )
        assert no_token.returncode != 0
        assert "InvalidAuthToken" in no_token.stderr, no_token.stderr[-2000:]
        print(f"up/status/70b/refused driver took {time.monotonic() - t0:.1f}s")
    finally:
        down = run(host, RAYKV, "down", env=env)
    assert down.returncode == 0, down.stderr
    assert "stopped the local Ray head" in down.stdout
    assert session_alive(state["pid"]) == [], "down returned while the head still runs"
    assert not state_path.exists()
    gone = run(host, RAYKV, "status", env=env, timeout=30)
    assert gone.returncode != 0 and "not up" in gone.stderr
    assert str(state_path) not in gone.stderr  # down deleted it: not named as a lead


def test_status_when_nothing_is_up_answers_at_once(host, home) -> None:
    t0 = time.monotonic()
    st = run(host, RAYKV, "status", env=plain_env(home), timeout=30)
    assert st.returncode != 0 and "not up" in st.stderr and "raykv up" in st.stderr
    assert time.monotonic() - t0 < 20


def test_a_state_file_left_by_a_dead_head_is_not_waited_on(host, home) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = home / ".cache" / "raykv" / "up.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"address": f"127.0.0.1:{port}", "pid": 1}))
    st = run(host, RAYKV, "status", env=plain_env(home), timeout=60)
    assert st.returncode != 0 and "not up" in st.stderr
    assert f"127.0.0.1:{port}, which does not answer" in st.stderr


def test_connect_ignores_rays_record_of_a_dead_cluster(host, home) -> None:
    """After a crash Ray's `ray_current_cluster` names a cluster that is gone: connect()
    starts the embedded Ray it promises instead of waiting on the dead one."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_tmp = home / "t"
    (ray_tmp / "ray").mkdir(parents=True)
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    script = "import raykv; kv = raykv.connect(); print('NODES', len(kv.stats()['nodes']))"
    t0 = time.monotonic()
    out = run(host, sys.executable, "-c", script, env=plain_env(home, RAY_TMPDIR=str(ray_tmp)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "NODES 1" in out.stdout
    assert f"127.0.0.1:{port}" not in out.stderr
    assert time.monotonic() - t0 < 120


def test_demo_matches_a_full_recompute(host, home) -> None:
    demo = run(host, RAYKV, "demo", "--prompt-tokens", "512", env=plain_env(home))
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "logits MATCH" in demo.stdout
    assert "prefill time saved" in demo.stdout
    if importlib.util.find_spec("ucxx") is not None:  # the cross-node load goes over UCX
        assert "the KV crossed nodes over UCX" in demo.stdout, demo.stdout


def test_bench_service_quick(home) -> None:
    """One quick run of every part (one cluster start): the lookups and hashing, the object
    store against raw Ray, the shared-memory rounds (median and best), and what it prints."""
    args = ["bench", "service", "--quick", "--rounds", "3", "--json"]
    out = run([], RAYKV, *args, env=plain_env(home))
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    lk = r["lookup"]
    assert lk["hit"]["hit_tokens"] == 32768 and lk["miss"]["hit_tokens"] == 0
    assert lk["hit"]["p99_ms"] >= lk["hit"]["p50_ms"] > 0
    assert lk["hashing_ms"] > 0 and lk["ping"]["p50_ms"] > 0
    assert lk["ratios"]["hit_p50_vs_ping"] > 0  # the engine's, from its replica
    assert lk["driver_hit"]["hit_tokens"] == 32768
    assert r["object_store"]["gb_per_s"] > 0
    sm = r["shared_memory"]  # issue 10: engine <-> tier through shared memory vs a plain copy
    assert sm["rounds"] == 3 and sm["bytes"] == sm["blocks"] * (8 * 2 * 16 * 8 * 128 * 2)
    assert sm["plain_copy_gb_per_s"] > 0
    for kind, copy in (("store", "copy_ms"), ("load", "load_copy_ms")):
        assert sm[f"best_{kind}_ms"] <= sm[f"{kind}_ms"]  # the best round, the median round
        assert sm[f"{kind}_ratio"] == pytest.approx(sm[copy] / sm[f"{kind}_ms"])
    from raykv.bench.service import format_report

    text = format_report(r)  # what `raykv bench service` prints: every ratio with its target
    assert "engine vs ping p50: hit p50" in text and "(target <= 0.5)" in text
    assert "(target <= 1)" in text and "a Ray driver's hit p50" in text
    assert "store (engine->tier)" in text and "load (tier->engine)" in text


@pytest.mark.parametrize(
    "args, parts",
    [
        (["--lookup-only"], ("lookup",)),
        (["--only", "shared-memory"], ("shared-memory",)),
        (["--only", "lookup", "--only", "object-store"], ("lookup", "object-store")),
        ([], ()),
    ],
)
def test_bench_service_runs_the_parts_asked_for(monkeypatch, args, parts) -> None:
    from click.testing import CliRunner

    from raykv import cli
    from raykv.bench import service

    asked = []
    monkeypatch.setattr(service, "main", lambda **kw: asked.append(kw))
    result = CliRunner().invoke(cli.main, ["bench", "service", "--quick", *args])
    assert result.exit_code == 0, result.output
    assert asked == [dict(quick=True, as_json=False, parts=parts, rounds=None)]


def test_a_killed_up_leaves_nothing_unrecorded(host, home) -> None:
    """`raykv up` killed while its head starts: the next `up` takes over (joins that head or
    replaces it) and `down` ends every process either one started."""
    env = plain_env(home)
    state_path = home / ".cache" / "raykv" / "up.json"
    first = subprocess.Popen(
        [*host, "env", "-i", *(f"{k}={v}" for k, v in env.items()), RAYKV, "up", *BARE],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while not state_path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert state_path.exists(), "up did not record its head"
    first.kill()
    first.wait()
    heads = {json.loads(state_path.read_text())["pid"]}
    try:
        again = run(host, RAYKV, "up", *BARE, env=env)
        assert again.returncode == 0, again.stdout + again.stderr
        heads.add(json.loads(state_path.read_text())["pid"])
    finally:
        down = run(host, RAYKV, "down", env=env)
    assert down.returncode == 0, down.stderr
    assert all(session_alive(pid) == [] for pid in heads), heads

"""``raykv up / status / down``: start or join the service, report on it, stop it.

With no address, ``up`` starts a local Ray head on 127.0.0.1 that outlives the command
(``ray start --head --block`` in its own session; its pid and address go to the state file,
``raykv.client.state_file()``), so ``status`` and ``down`` from other processes find it.
``down`` stops the service's actors and, if ``up`` started the head, that process group.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from raykv.client import _local_address, connect, state_file
from raykv.errors import ServiceError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_head(num_cpus: int | None = None, timeout_s: float = 60.0) -> dict[str, Any]:
    """Start a Ray head on 127.0.0.1 in its own session; returns the recorded state."""
    port = _free_port()
    ray_bin = Path(sys.executable).parent / "ray"
    cmd = [
        str(ray_bin),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--include-dashboard=false",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    log = path.with_suffix(".log")
    # The auth mode is explicit: with RAY_AUTH_MODE unset, `ray start` turns token auth on
    # whenever ~/.ray/auth_token exists (any earlier embedded ray.init() writes one), while a
    # driver joining by address does not, and `raykv status` would be refused.
    env = {
        "RAY_AUTH_MODE": "disabled",
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    deadline = time.monotonic() + timeout_s
    while not _port_open(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise ServiceError(
                f"could not start a Ray head on 127.0.0.1:{port} (exit {proc.poll()}); see {log}"
            )
        time.sleep(0.5)
    state = {"address": f"127.0.0.1:{port}", "pid": proc.pid, "log": str(log)}
    path.write_text(json.dumps(state))
    return state


def up(
    address: str | None,
    *,
    preset: str,
    cpu_bytes: int,
    gpu_mem_fraction: float,
    block_size: int,
    max_model_len: int | None,
    pool_bytes: int,
    num_cpus: int | None = None,
) -> dict[str, Any]:
    """Start or join the service and serve ``preset``; returns where it runs."""
    from raykv.layout.presets import get_preset

    p = get_preset(preset)
    started = None
    address = address or _local_address()
    if address is None:
        started = start_head(num_cpus)
        address = started["address"]
    client = connect(address)
    plan = client.add_model(
        preset,
        p.layers(),
        max_model_len=max_model_len or p.max_model_len,
        block_size=block_size,
        gpu_mem_fraction=gpu_mem_fraction,
        cpu_bytes=cpu_bytes,
        pool_bytes=pool_bytes,
    )
    stats = client.stats()
    return {
        "address": address,
        "started_head": started is not None,
        "model": preset,
        "num_gpu_blocks": plan.num_gpu_blocks,
        "cpu_num_blocks": plan.cpu_num_blocks,
        "nodes": len(stats["nodes"]),
        "members": len(stats["members"]),
    }


def _join(address: str | None) -> Any:
    import ray

    address = address or _local_address()
    if address is None:
        raise ServiceError(
            "raykv is not up on this host (no RAY_ADDRESS, and no Ray head started by raykv up "
            f"answers; {state_file()} records the last one); start it with raykv up"
        )
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
    return address


def status(address: str | None) -> dict[str, Any]:
    import ray

    from raykv.client import Client
    from raykv.service.spec import COORDINATOR, NAMESPACE

    addr = _join(address)
    try:
        ray.get_actor(COORDINATOR, namespace=NAMESPACE)
    except ValueError:
        raise ServiceError(
            f"Ray runs at {addr} but the raykv service does not (raykv up)"
        ) from None
    return {"address": addr, **Client(retry_s=10).stats()}


def down(address: str | None) -> dict[str, Any]:
    """Stop the service's actors, then the Ray head if ``raykv up`` started it."""
    import ray

    from raykv.service.spec import COORDINATOR, NAMESPACE

    addr = _join(address)
    killed = 0
    try:
        coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
        killed = ray.get(coord.shutdown_service.remote(), timeout=30)
        ray.kill(coord, no_restart=True)
        killed += 1
    except ValueError:
        pass
    ray.shutdown()
    stopped_head = False
    path = state_file()
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    if state.get("address") == addr and state.get("pid"):
        try:
            os.killpg(state["pid"], signal.SIGTERM)  # the session `up` created, by its id
            stopped_head = True
        except ProcessLookupError:
            pass
        path.unlink(missing_ok=True)
    return {"address": addr, "actors_stopped": killed, "stopped_head": stopped_head}


def status_table(s: dict[str, Any]) -> str:
    lines = [
        f"raykv at {s['address']}  up {s['uptime_s']}s  models: "
        + (
            ", ".join(
                f"{m} (block {v['block_size']}, {v['num_gpu_blocks']} GPU / "
                f"{v['cpu_num_blocks']} CPU blocks)"
                for m, v in s["models"].items()
            )
            or "none"
        )
    ]
    lines.append("")
    lines.append(f"{'node':<14}{'address':<16}{'alive':<7}{'gpus':>4}")
    for n in s["nodes"]:
        lines.append(f"{n['node_id'][:12]:<14}{n['address']:<16}{n['alive']!s:<7}{n['gpus']:>4}")
    lines.append("")
    w = max([len("member"), *(len(m["name"]) for m in s["members"])]) + 2
    lines.append(
        f"{'member':<{w}}{'kind':<6}{'node':<14}{'used':>8}{'total':>8}{'indexed':>9}{'hb age':>8}"
    )
    for m in s["members"]:
        lines.append(
            f"{m['name']:<{w}}{m['kind']:<6}{m['node_id'][:12]:<14}{m.get('blocks_used', 0):>8}"
            f"{m.get('blocks_total', 0):>8}{m['indexed_blocks']:>9}{m['heartbeat_age_s']:>7}s"
        )
    hits = ", ".join(f"{k} {v}" for k, v in sorted(s["hits"].items())) or "none"
    lines.append("")
    lines.append(
        f"lookups {s['lookups']}  hit rate {s['hit_rate']:.1%}  hit blocks: {hits}  "
        f"missed blocks {s['misses']}  indexed blocks {s['indexed_blocks']}"
    )
    return "\n".join(lines)

"""``raykv up / status / down``: start or join the service, report on it, stop it.

With no address, ``up`` starts a local Ray head on 127.0.0.1 that outlives the command
(``ray start --head --block`` in its own session; its pid and address go to the state file,
``raykv.service.control.ray_join.state_file()``), so ``status`` and ``down`` from other
processes find it.
``down`` stops the service's actors and, if ``up`` started the head, that process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from raykv.errors import ConfigError, RaykvError, ServiceError, ServiceGone
from raykv.service.control import calls
from raykv.service.control.admin import admin_key
from raykv.service.control.ray_join import (
    ensure_token,
    ensure_transport_secret,
    join,
    listening,
    local_address,
    read_state,
    state_file,
    transport_secret_path,
)

if TYPE_CHECKING:
    from raykv.tiers.quotas import TenantQuotas

STOP_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def start_head(
    num_cpus: int | None = None, timeout_s: float = 60.0, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Start a Ray head on 127.0.0.1 in its own session (``env``: more environment for it
    and so its actors, e.g. the disk tier's); returns the recorded state."""
    port = _free_port()
    # Ray's CLI as a module of this interpreter: its `ray` script may not be installed next
    # to it (`pip install --target`, an image without a venv)
    cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
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
    # Token auth stays on (Ray's default for a new cluster): the head and every raykv driver
    # use the same token file, created here if this host has none. Loopback stays loopback.
    token = ensure_token()
    secret = transport_secret_path(token)
    env = {
        "RAY_AUTH_MODE": "token",
        # raykv's transport secret (UCX endpoints authenticate with it): the head's actors
        # inherit it; a value the caller exported wins
        "RAYKV_TRANSPORT_SECRET": ensure_transport_secret(secret),
        **os.environ,
        **(env or {}),
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    }
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    # recorded at once: if this command is killed now, the next `up` or `down` finds the head
    state = {"address": f"127.0.0.1:{port}", "pid": proc.pid, "log": str(log), "token": str(token),
             "transport_secret": str(secret)}  # fmt: skip
    path.write_text(json.dumps(state))
    deadline = time.monotonic() + timeout_s
    while not _port_open(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_head(proc.pid, state["address"])
            path.unlink(missing_ok=True)
            raise ServiceError(
                f"could not start a Ray head on 127.0.0.1:{port} within {timeout_s:.0f}s "
                f"(exit {proc.poll()}); see {log}"
            )
        time.sleep(0.5)
    return state


def _stop_stale_head() -> None:
    """A head recorded by an `up` that was killed before it answered (or that died since):
    end what is left of its session, so a new head does not run beside it unrecorded."""
    state = read_state()
    if state.get("pid") and not listening(state.get("address", "")):
        stop_head(state["pid"], state.get("address", ""))
        state_file().unlink(missing_ok=True)


def up(
    address: str | None,
    *,
    preset: str | None,
    cpu_bytes: int,
    gpu_mem_fraction: float,
    block_size: int,
    max_model_len: int | None,
    pool_bytes: int,
    num_cpus: int | None = None,
    tp_size: int = 1,
    disk: tuple[str, int] | None = None,
    tenant_quotas: TenantQuotas | None = None,
    objects: tuple[str, str | None] | None = None,
    disk_tenant_quotas: TenantQuotas | None = None,
    object_tenant_quotas: TenantQuotas | None = None,
) -> dict[str, Any]:
    """Start or join the service and serve ``preset`` (``tp_size`` GPUs per pool group, one
    TP rank each; None: no model, e.g. for engines that add their own, as ``raykv serve``'s
    do); returns where it runs. ``disk``: (folder, bytes for all its models) of the node's
    disk tier, in the environment of the head started here (a running cluster's nodes keep
    theirs); so are ``tenant_quotas`` (``RAYKV_TENANT_QUOTAS``, labels only: invariant 13),
    ``disk_tenant_quotas`` (``RAYKV_DISK_TENANT_QUOTAS``: the disk tier's), ``objects``
    (``s3://`` URL, endpoint or None) of the object tier and ``object_tenant_quotas``
    (``RAYKV_OBJECT_TENANT_QUOTAS``: the object tier's)."""
    from raykv.layout.presets import get_preset
    from raykv.service.tier.actor import (
        DISK_BYTES_ENV,
        DISK_PATH_ENV,
        OBJECT_ENDPOINT_ENV,
        OBJECT_URL_ENV,
    )
    from raykv.tiers.quotas import DISK_QUOTAS_ENV, OBJECT_QUOTAS_ENV, QUOTAS_ENV

    p = get_preset(preset) if preset is not None else None
    started = None
    address = address or local_address()
    if address is not None and disk is not None:
        raise ConfigError(
            f"--disk-path and --disk-bytes configure the Ray head raykv up starts, and Ray "
            f"runs already at {address}; run raykv down first, or start each node with "
            f"{DISK_PATH_ENV} and {DISK_BYTES_ENV} in the environment of its `ray start`"
        )
    if address is not None and tenant_quotas is not None:
        raise ConfigError(
            f"--tenant-quota configures the Ray head raykv up starts, and Ray runs already at "
            f"{address}; run raykv down first, or start each node with {QUOTAS_ENV}="
            f"{tenant_quotas.to_env()} in the environment of its `ray start`"
        )
    if address is not None and disk_tenant_quotas is not None:
        raise ConfigError(
            f"--disk-tenant-quota configures the Ray head raykv up starts, and Ray runs already "
            f"at {address}; run raykv down first, or start each node with {DISK_QUOTAS_ENV}="
            f"{disk_tenant_quotas.to_env()} in the environment of its `ray start`"
        )
    if address is not None and object_tenant_quotas is not None:
        raise ConfigError(
            f"--object-tenant-quota configures the Ray head raykv up starts, and Ray runs "
            f"already at {address}; run raykv down first, or start each node with "
            f"{OBJECT_QUOTAS_ENV}={object_tenant_quotas.to_env()} in the environment of its "
            "`ray start`"
        )
    if address is not None and objects is not None:
        raise ConfigError(
            f"--object-url and --object-endpoint configure the Ray head raykv up starts, and "
            f"Ray runs already at {address}; run raykv down first, or start each node with "
            f"{OBJECT_URL_ENV} (and {OBJECT_ENDPOINT_ENV}) in the environment of its `ray start`"
        )
    if address is None:
        _stop_stale_head()
        env = {DISK_PATH_ENV: disk[0], DISK_BYTES_ENV: str(disk[1])} if disk else {}
        if tenant_quotas is not None:
            env[QUOTAS_ENV] = tenant_quotas.to_env()
        if disk_tenant_quotas is not None:
            env[DISK_QUOTAS_ENV] = disk_tenant_quotas.to_env()
        if objects is not None:
            env[OBJECT_URL_ENV] = objects[0]
            if objects[1]:
                env[OBJECT_ENDPOINT_ENV] = objects[1]
        if object_tenant_quotas is not None:
            env[OBJECT_QUOTAS_ENV] = object_tenant_quotas.to_env()
        started = start_head(num_cpus, env=env or None)
        address = started["address"]
    try:
        import ray

        from raykv.service.served import NAMESPACE, ServedModel

        if not ray.is_initialized():
            join(address, NAMESPACE, start_local=True)
        coord = calls.ensure_service()
        if p is None:
            return {"address": address, "started_head": started is not None,
                    "token": started["token"] if started else None}  # fmt: skip
        model = ServedModel(
            preset,
            dict(p.layers()),
            max_model_len or p.max_model_len,
            block_size=block_size,
            gpu_mem_fraction=gpu_mem_fraction,
            cpu_bytes=cpu_bytes,
            pool_bytes=pool_bytes,
            tp_size=tp_size,
        )
        plan = calls.call(coord, "add_model", model, timeout_s=calls.ADD_MODEL_TIMEOUT_S)
    except RaykvError as e:
        if started is None:
            raise
        raise type(e)(
            f"{e}\n(the Ray head raykv up started at {address} keeps running: run raykv up "
            "again with other settings, or raykv down)"
        ) from e
    stats = calls.call(coord, "stats")
    return {
        "address": address,
        "started_head": started is not None,
        "token": started["token"] if started else None,
        "model": preset,
        "num_gpu_blocks": plan.num_gpu_blocks,
        "cpu_num_blocks": plan.cpu_num_blocks,
        "nodes": len(stats["nodes"]),
        "members": len(stats["members"]),
    }


def _join(address: str | None) -> str:
    from raykv.service.served import NAMESPACE

    joined = join(address, NAMESPACE, start_local=False)
    return joined


def status(address: str | None) -> dict[str, Any]:
    """Join the Ray cluster at ``address`` and read the service's stats (``read_status``)."""
    return read_status(_join(address))


def read_status(address: str) -> dict[str, Any]:
    """The service's stats, read by this process, already joined to the cluster at
    ``address``: ServiceGone where the service does not run there, ServiceError where its
    coordinator does not answer."""
    try:
        coord = calls.coordinator()
    except ServiceGone:
        raise ServiceGone(
            f"Ray runs at {address} but the raykv service does not (raykv up)"
        ) from None
    return {"address": address, **calls.call(coord, "stats")}


def down(address: str | None) -> dict[str, Any]:
    """Stop the service's actors, then the Ray head if ``raykv up`` started it."""
    import ray

    from raykv.service.served import COORDINATOR, NAMESPACE

    addr = _join(address)
    killed = 0
    try:
        coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
        killed = ray.get(coord.shutdown_service.remote(admin_key()), timeout=30)
        ray.kill(coord, no_restart=True)
        killed += 1
    except ValueError:
        pass
    ray.shutdown()
    state = read_state()
    stopped_head = False
    if state.get("address") == addr and state.get("pid"):
        stopped_head = stop_head(state["pid"], addr)
        state_file().unlink(missing_ok=True)
    return {"address": addr, "actors_stopped": killed, "stopped_head": stopped_head}


def _session_pids(sid: int) -> list[int]:
    """Processes of the session ``raykv up`` started for the head (Ray's workers included:
    they get process groups of their own, but stay in the session)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry)) == sid:
                    pids.append(int(entry))
    return pids


def _is_head(sid: int, address: str) -> bool:
    """Whether process ``sid`` is the ``ray start --head`` that ``up`` started for ``address``
    (a recorded pid may since belong to anything else: never signal that)."""
    try:
        with open(f"/proc/{sid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    port = address.rpartition(":")[2]
    return "start" in argv and "--head" in argv and f"--port={port}" in argv


def stop_head(
    sid: int, address: str, grace_s: float = 3.0, timeout_s: float = STOP_TIMEOUT_S
) -> bool:
    """Stop every process of the head's session and wait until they are gone (or zombies
    waiting to be reaped): SIGTERM, SIGKILL after ``grace_s``, give up at ``timeout_s``.
    The whole cluster goes, so nothing needs Ray's slower one-by-one shutdown (~30 s).
    False if it was not running (or ``sid`` is not that head)."""
    if not _is_head(sid, address):
        return False
    deadline = time.monotonic() + timeout_s
    for sig, until in ((signal.SIGTERM, time.monotonic() + grace_s), (signal.SIGKILL, deadline)):
        for pid in _session_pids(sid):
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        while time.monotonic() < until and not _all_exited(sid):
            time.sleep(0.2)
        if _all_exited(sid):
            break
    return True


def _all_exited(sid: int) -> bool:
    def exited(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
        except OSError:
            return True

    return all(exited(pid) for pid in _session_pids(sid))


def router_lines(r: dict[str, Any]) -> list[str]:
    """A Ray Serve router's part of ``raykv status`` (``raykv.integrations.serve``)."""
    c, d = r["costs"], r["decisions"]
    loads = ", ".join(f"{k} {v:.3g}" for k, v in sorted(c["load_s_per_token"].items())) or "free"
    prefill = c["prefill_s_per_token"]
    prompt = d.get("prompt_tokens", 0)
    held = sum(d.get(f"hit_tokens_{p}", 0) for p in ("replica", "gpu", "cpu", "remote"))
    fell = sum(v for k, v in d.items() if k.startswith("fell_back_"))
    return [
        f"serve router {r['name']} (model {r['model']}, index "
        f"{'fresh' if r['index_fresh'] else 'STALE'})",
        f"  costs ({c['source']}): prefill {'1 unit' if prefill is None else f'{prefill:.3g}'}"
        f" s/token, loads s/token: {loads}",
        f"  routed {d.get('routed', 0)}: for cache {d.get('routed_for_cache', 0)}, for load "
        f"{d.get('routed_for_load', 0)}, no local prefix {d.get('routed_no_local_prefix', 0)}, "
        f"pulls {d.get('pulls', 0)}, default router {fell}",
        f"  prompt tokens held {held / prompt if prompt else 0:.1%}: replica's own cache "
        f"{d.get('hit_tokens_replica', 0)}, gpu "
        f"{d.get('hit_tokens_gpu', 0)}, cpu {d.get('hit_tokens_cpu', 0)}, remote "
        f"{d.get('hit_tokens_remote', 0)} of {prompt}",
        *(
            f"  replica {x['replica']} on {x['node_id'][:12]}: {x['queued_tokens']} tokens queued"
            for x in r["replicas"]
        ),
    ]


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
    if s.get("routes"):
        lines.append("")
        lines.append("transports (holder -> reader)")
        for r in s["routes"]:
            lines.append(f"  {r['from']} -> {r['to']}: {r['transport']}")
    for r in s.get("routers") or []:
        lines.extend(["", *router_lines(r)])
    hits = ", ".join(f"{k} {v}" for k, v in sorted(s["hits"].items())) or "none"
    lines.append("")
    lines.append(
        f"lookups {s['lookups']}  hit rate {s['hit_rate']:.1%}  hit blocks: {hits}  "
        f"missed blocks {s['misses']}  indexed blocks {s['indexed_blocks']}  "
        f"checksum errors {s.get('checksum_errors', 0)}  "
        f"refused transport peers {s.get('transport_auth_refused', 0)}"
    )
    lines.append(
        f"tier leases expired {s.get('leases_expired', 0)}  "
        f"released (holder gone) {s.get('leases_released', 0)}  "
        f"late finishes {s.get('late_finishes', 0)}"
    )
    tenants = s.get("tenants") or {}
    quotas = s.get("tenant_quotas") or {}
    disk_quotas = s.get("disk_tenant_quotas") or {}
    object_quotas = s.get("object_tenant_quotas") or {}
    # a disk tier holds tenants' entries: their disk bytes and quotas too; the same of the
    # object tier's (in the bucket)
    disk = bool(disk_quotas) or any("disk_bytes_held" in c for c in tenants.values())
    bucket = bool(object_quotas) or any("object_bytes_held" in c for c in tenants.values())
    if tenants.keys() - {"none"} or quotas or disk_quotas or object_quotas:  # tenants served
        from raykv.layout.report import format_bytes

        def limit(label: str, of: dict[str, int]) -> str:
            quota = of.get(label, of.get("default"))
            return "no quota" if quota is None or label == "other" else format_bytes(quota)

        lines.append(
            "engine lookups per tenant (hit / missed blocks, stored entries; CPU-tier bytes "
            "held on all nodes / quota per node and model, over quota: refused / own evicted"
            + ("; the same for the disk tier" if disk else "")
            + ("; the object tier's bytes in the bucket / quota per model" if bucket else "")
            + ")"
        )
        for label, c in tenants.items():
            lines.append(
                f"  {label:<10}{c.get('lookups', 0):>8} lookups  {c.get('hit_blocks', 0)} / "
                f"{c.get('miss_blocks', 0)} blocks  {c.get('stored_entries', 0)} stored  "
                f"{format_bytes(c.get('bytes_held', 0))} / {limit(label, quotas)}  "
                f"{c.get('quota_refused', 0)} / {c.get('quota_evicted', 0)}"
                + (
                    f"  disk {format_bytes(c.get('disk_bytes_held', 0))} / "
                    f"{limit(label, disk_quotas)}  {c.get('disk_quota_refused', 0)} / "
                    f"{c.get('disk_quota_evicted', 0)}"
                    if disk
                    else ""
                )
                + (
                    f"  object {format_bytes(c.get('object_bytes_held', 0))} / "
                    f"{limit(label, object_quotas)}  {c.get('object_quota_refused', 0)} / "
                    f"{c.get('object_quota_evicted', 0)}"
                    if bucket
                    else ""
                )
            )
    return "\n".join(lines)

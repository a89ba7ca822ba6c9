"""GPU pools load each other's blocks over NCCL, on one local Ray node with its GPUs.

2 GPUs: two TP-1 pools (engine A on pool 0, engine B on pool 1); the route is ``nccl``, the
bytes equal. 4 GPUs (issue 13): a Llama-3-8B-like TP-2 preset (bf16) places two TP-2 groups;
A's ranks write a 32k-token prefix (known bytes per rank), B loads it rank to rank and reads
every byte back; then the MLA preset (one copy per group, moved once); then A's pool killed
mid-load: B's load is a miss within the timeout and the service places the pool again.
"""

import os
import time

import pytest
import torch

from raykv.layout.presets import get_preset

pytestmark = [pytest.mark.gpu, pytest.mark.ray]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
TIMEOUT_S = "10"
CHUNK = 256  # blocks per store / read call


@pytest.fixture(scope="module")
def kv():
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, found {GPUS}")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAYKV_COLLECTIVE_TIMEOUT_S"] = TIMEOUT_S
    import ray

    import raykv

    ray.init(num_cpus=8, num_gpus=GPUS, _node_ip_address="127.0.0.1", include_dashboard=False)
    try:
        yield raykv.connect()
    finally:
        ray.shutdown()


def known(n: int, width: int, seed: int) -> torch.Tensor:
    """Cheap, distinct, reproducible rows (uint8 [n, width])."""
    base = (torch.arange(width, dtype=torch.int64) * 7919 % 251).to(torch.uint8)
    shift = ((torch.arange(n) * 37 + seed * 101) % 256).to(torch.uint8)
    out = base[None, :] + shift[:, None]  # uint8: wraps
    out[:, :8] = (
        torch.tensor([seed], dtype=torch.int64).add(torch.arange(n) << 8)[:, None].view(torch.uint8)
    )  # the row's index and the seed: every row distinct
    return out


def engine(kv, model: str, index: int):
    """A client bound to pool ``index`` of this node (several GPU pools on one node)."""
    import ray

    from raykv.service.served import pool_name

    node = ray.get_runtime_context().get_node_id()
    c = kv.on(node)
    c.model_name = model
    c._pool_name = (node, model, pool_name(model, node, index))
    return c


def stop_service(kv) -> None:
    import ray

    from raykv.service.control.admin import admin_key
    from raykv.service.served import COORDINATOR, NAMESPACE

    coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
    ray.get(coord.shutdown_service.remote(admin_key()))


def write(c, rid, ids, n, per_rank) -> list[int]:
    assert c.admit(rid, len(ids), ids)
    table = c.allocate(rid, len(ids), ids)[0]
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        assert c.store(rid, table[s:e], [r[s:e] for r in per_rank]) == e - s
    return table


def check_read(c, table, n, per_rank) -> None:
    for rank, want in enumerate(per_rank):
        for s in range(0, n, CHUNK):
            e = min(n, s + CHUNK)
            got = c.read(table[s:e], rank=rank)
            assert torch.equal(got, want[s:e]), f"rank {rank} blocks {s}..{e} differ"


def routes(kv) -> dict:
    return {(r["from"], r["to"]): r["transport"] for r in kv.stats()["routes"]}


def load_between_two_pools(kv, model: str, before_load=None, loads: int = 1, between=None) -> dict:
    """Engine A stores 256 known blocks on pool 0, engine B loads them into pool 1 (after
    ``before_load()``, if given) and reads every byte back, ``loads`` times (another prefix
    each, ``between()`` called before each after the first); returns the routes."""
    from raykv.layout import FullAttention

    layers = {f"l{i}": FullAttention("bfloat16", num_kv_heads=8, head_dim=128) for i in range(4)}
    plan = kv.add_model(model, layers, max_model_len=8192, pool_bytes=1 << 30, cpu_bytes=1 << 28)
    a, b = engine(kv, model, 0), engine(kv, model, 1)
    for k in range(loads):
        if k and between is not None:
            between()
        n, ids = 256, list(range(1 + k, 256 * 16 + 2 + k))
        data = known(n, plan.gpu_bytes_per_block, 1 + k)
        write(a, "w", ids, n, [data])
        a.free("w")
        if before_load is not None:
            before_load()
        assert b.admit("r", len(ids), ids)
        tb = b.allocate("r", len(ids), ids)[0]
        res = b.load("r", ids, into=tb[:n])
        assert (res.num_tokens, res.bytes) == (n * 16, n * plan.gpu_bytes_per_block)
        check_read(b, tb, n, [data])
        b.free("r")
    return routes(kv)


def windows_of(model: str, index: int) -> dict:
    """Pool ``index``'s holders and whether it reads each through NCCL windows."""
    import ray

    from raykv.service.served import NAMESPACE, pool_name

    node = ray.get_runtime_context().get_node_id()
    pool = ray.get_actor(pool_name(model, node, index), namespace=NAMESPACE)
    return ray.get(pool.__ray_call__.remote(
        lambda self: {m: pairs is not None for m, (_, pairs) in self.pairs._window_of.items()}
    ))  # fmt: skip


def test_two_gpu_pools_load_over_nccl(kv) -> None:
    seen = []  # B's windows after the first load: its pair formed one where GPUs map
    got = load_between_two_pools(
        kv, "n1", loads=2, between=lambda: seen.append(windows_of("n1", 1))
    )
    assert "nccl" in got.values(), got
    if torch.cuda.can_device_access_peer(0, 1):  # so the second load read through it
        assert [list(w.values()) for w in seen] == [[True]], seen
    stop_service(kv)


def _prefix_run(kv, preset: str, tokens: int, copies: int) -> dict:
    p = get_preset(preset)
    plan = kv.add_model(preset, p.layers(), max_model_len=tokens + 64, tp_size=2,
                        pool_bytes=12 << 30, cpu_bytes=1 << 28)  # fmt: skip
    a, b = engine(kv, preset, 0), engine(kv, preset, 1)
    bs = plan.groups[0].block_size
    n, ids = tokens // bs, list(range(1, tokens + 2))
    width = plan.gpu_bytes_per_block
    per_rank = [known(n, width, 10 + r) for r in range(copies)]
    per_rank = per_rank if copies == 2 else per_rank * 2  # MLA: the same latent on both ranks
    write(a, "w", ids, n, per_rank)
    a.free("w")
    assert b.admit("r", len(ids), ids)
    tb = b.allocate("r", len(ids), ids)[0]
    t0 = time.perf_counter()
    res = b.load("r", ids, into=tb[:n])
    took = time.perf_counter() - t0
    assert res.num_tokens == n * bs
    assert res.bytes == n * width * copies  # MLA: one copy crossed
    check_read(b, tb, n, per_rank)
    b.free("r")
    ids2 = list(range(3, 3 + len(ids)))  # another prefix, over the pairs formed above
    write(a, "w3", ids2, n, per_rank)
    a.free("w3")
    assert b.admit("r3", len(ids2), ids2)
    t3 = b.allocate("r3", len(ids2), ids2)[0]
    t0 = time.perf_counter()
    res3 = b.load("r3", ids2, into=t3[:n])
    warm = time.perf_counter() - t0
    assert res3.num_tokens == n * bs
    check_read(b, t3, n, per_rank)
    b.free("r3")
    assert "nccl" in routes(kv).values(), routes(kv)
    print(f"\n{preset} TP-2: {n} blocks x {width >> 10} KiB per rank, {copies} copies on the "
          f"wire; load (pairs formed) {took:.3f}s = {res.bytes / took / 1e9:.1f} GB/s; load "
          f"over formed pairs {warm:.3f}s = {res.bytes / warm / 1e9:.1f} GB/s")  # fmt: skip
    return {"a": a, "b": b, "ids": ids, "n": n, "bs": bs, "per_rank": per_rank}


@pytest.mark.skipif(GPUS < 4, reason=f"needs 4 GPUs, found {GPUS}")
def test_issue13_two_tp2_groups_exchange_a_32k_prefix_over_nccl(kv) -> None:
    _prefix_run(kv, "llama-3-8b", 32768, copies=2)
    stop_service(kv)
    run = _prefix_run(kv, "deepseek-v3", 32768, copies=1)
    # A's pool dies as it sends: B's load is a miss within the timeout, A is placed again
    import ray

    from raykv.service.served import NAMESPACE, pool_name

    node = ray.get_runtime_context().get_node_id()
    name = pool_name("deepseek-v3", node, 0)
    src = ray.get_actor(name, namespace=NAMESPACE)
    old = ray.get(src.snapshot.remote())["actor_id"]

    def die_on_send(self):
        self.fetch.transports["nccl"].collective.tamper = lambda buf: os._exit(1)

    ray.get(src.__ray_call__.remote(die_on_send))
    a, b, n = run["a"], run["b"], run["n"]
    ids = list(range(7, 7 + len(run["ids"])))  # a prefix B does not hold yet
    write(a, "w2", ids, n, run["per_rank"])
    a.free("w2")
    assert b.admit("k", len(ids), ids)
    tk = b.allocate("k", len(ids), ids)[0]
    t0 = time.monotonic()
    res = b.load("k", ids, into=tk[:n])
    took = time.monotonic() - t0
    assert res.num_tokens == 0 and took < 3 * float(TIMEOUT_S) + 10, (res, took)
    b.free("k")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            fresh = ray.get_actor(name, namespace=NAMESPACE)
            if ray.get(fresh.snapshot.remote(), timeout=5)["actor_id"] != old:
                break
        except (ValueError, ray.exceptions.RayError):
            pass
        time.sleep(1)
    else:
        pytest.fail("the killed pool was not placed again within 90 s")
    print(f"\nholder killed mid-load: a miss after {took:.1f}s; pool placed again")
    stop_service(kv)

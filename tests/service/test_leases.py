"""The node tier's leases and reservations end: an engine that exits is released at once, one
that never finishes at the deadline (``RAYKV_LEASE_TIMEOUT_S``); a late load of reclaimed,
reused entries is a miss and a late store apply publishes nothing."""

import os
import time

import pytest
import ray
import torch
from kvdata import ROW, rows, tokens

from raykv import ops
from raykv.bench.chaos import environment
from raykv.layout import FullAttention
from raykv.service.served import NAMESPACE, tier_name
from raykv.service.tier.actor import LEASE_TIMEOUT_ENV
from raykv.tiers import holds

RAY_WORKERS = 0
TIMEOUT_S = 6
BS = 16
LAYERS = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)}


@pytest.fixture(scope="module")
def svc(request):
    """The module's cluster, its tier started with a short lease timeout."""
    with environment({LEASE_TIMEOUT_ENV: str(TIMEOUT_S)}):  # the raylet, so the tier, inherit it
        yield request.getfixturevalue("ray_cluster")


def tier_stats(svc) -> dict:
    tier = ray.get_actor(tier_name(svc.head), namespace=NAMESPACE)
    return ray.get(tier.snapshot.remote())["stats"]


def wait_for(svc, cond, seconds: float = 15) -> dict:
    deadline = time.monotonic() + seconds
    while not cond(s := tier_stats(svc)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return s


def setup(svc, model: str, seed: int):
    """An attached engine with the tier full of one prompt's entries."""
    kv = svc.kv
    plan = kv.add_model(model, LAYERS, max_model_len=512, pool_bytes=40 * ROW, cpu_bytes=8 * ROW)
    a = kv.on(svc.head)
    ea = a.attach(num_blocks=64)
    n = plan.cpu_num_blocks
    ids, src = tokens(n * BS, seed), rows(n, seed)
    ops.scatter_blocks(src, ea.kv.entries(plan.groups[0].group_id), torch.arange(1, n + 1))
    assert ea.store_from(ids, list(range(1, n + 1))) == n
    ea.flush()
    return a, ea, plan, ids, src


@ray.remote(num_cpus=0)
class Engine:
    """An engine process that leases the tier's copies for a load, then dies."""

    def lease(self, model: str, ids: list[int], n: int) -> int:
        from raykv.engine import NodeKV

        node = NodeKV.open(node_id=ray.get_runtime_context().get_node_id())
        node.use(model)
        self.attached = node.attach(num_blocks=64)
        self.lease_ = self.attached.lease(ids, [n], [0])  # kept: never loaded or released
        return os.getpid()


def test_an_engine_that_dies_holding_leases_is_released_at_once(svc) -> None:
    _, ea, plan, ids, _ = setup(svc, "lease-dies", 1)
    tier = ray.get_actor(tier_name(svc.head), namespace=NAMESPACE)
    assert ray.get(tier.__ray_call__.remote(lambda self: self.timeout_s)) == TIMEOUT_S  # env
    n = plan.cpu_num_blocks
    engine = Engine.remote()
    ray.get(engine.lease.remote("lease-dies", ids, n))
    assert tier_stats(svc)["leases_held"] == 1
    others = tokens(n * BS, 2)
    assert ea.store_from(others, list(range(1, n + 1))) == 0  # every entry pinned
    before = tier_stats(svc)
    ray.kill(engine)
    # well before the deadline: its connection to the node agent closed with it
    s = wait_for(svc, lambda s: s["leases_released"] > before["leases_released"], TIMEOUT_S / 2)
    assert s["leases_released"] == before["leases_released"] + 1 and s["leases_held"] == 0
    assert s["leases_expired"] == before["leases_expired"]
    assert ea.store_from(others, list(range(1, n + 1))) == n  # evictable now
    ea.close()


def test_a_lease_never_finished_expires_and_its_late_load_is_a_miss(svc) -> None:
    """The vLLM case: a request aborted after its lookup leased, ``wait_for_save`` skipped;
    the process lives on. At the deadline the entries are evictable; a load of the old lease
    after they were reused is a miss (never the new KV), its release changes nothing."""
    _, ea, plan, ids, src = setup(svc, "lease-late-load", 3)
    n = plan.cpu_num_blocks
    lease = ea.lease(ids, [n], [0])
    assert lease.blocks(0) == n
    before = tier_stats(svc)
    s = wait_for(svc, lambda s: s["leases_expired"] > before["leases_expired"], 3 * TIMEOUT_S)
    assert s["leases_expired"] == before["leases_expired"] + 1 and s["leases_held"] == 0
    others, other_src = tokens(n * BS, 4), rows(n, 4)
    gid = plan.groups[0].group_id
    ops.scatter_blocks(other_src, ea.kv.entries(gid), torch.arange(1, n + 1))
    assert ea.store_from(others, list(range(1, n + 1))) == n  # the old entries' blocks
    ea.flush()
    mine = list(range(20, 20 + n))
    ops.scatter_blocks(torch.zeros((n, ROW), dtype=torch.uint8), ea.kv.entries(gid),
                       torch.tensor(mine))  # fmt: skip
    assert ea.load_leased(lease, mine) == 0  # a miss: nothing counts as loaded
    ea.flush()  # sends the late release
    s = tier_stats(svc)
    assert s["late_finishes"] == before["late_finishes"] + 1
    per_model = s["per_model"]["lease-late-load"]
    assert per_model["checksum_errors"] == 0 and per_model["blocks_used"] == n  # nothing dropped
    assert ea.load_into(others, mine) == n * BS  # the new entries are intact
    out = torch.empty((n, ROW), dtype=torch.uint8)
    ops.gather_blocks(ea.kv.entries(gid), torch.tensor(mine), out)
    assert torch.equal(out, other_src) and not torch.equal(out, src)
    ea.close()


def test_a_late_store_apply_after_expiry_is_never_published(svc) -> None:
    """A writer reserves, stalls past the deadline, and applies its store after another
    writer stored other KV in the same blocks: nothing of it is stored or published."""
    a, ea, plan, _, _ = setup(svc, "lease-late-store", 5)
    tier = ray.get_actor(tier_name(svc.head), namespace=NAMESPACE)
    n = plan.cpu_num_blocks
    stale_ids = tokens(n * BS, 6)
    keys = tuple(ea.keys(stale_ids)[0])
    me = holds.this_process("stalled writer")
    _, res = ray.get(tier.reserve.remote("lease-late-store", keys, tuple((k,) for k in keys),
                                         1, me))  # fmt: skip
    assert res is not None and len(res.keys) == n
    before = tier_stats(svc)
    s = wait_for(svc, lambda s: s["leases_expired"] > before["leases_expired"], 3 * TIMEOUT_S)
    assert s["leases_held"] == 0
    others = tokens(n * BS, 7)
    assert ea.store_from(others, list(range(1, n + 1))) == n  # reuses the reclaimed blocks
    ea.flush()
    sums = [(0,)] * n
    late = [("finish_store", res, True, [(True,)] * n, sums, 0)]
    assert ray.get(tier.apply.remote("lease-late-store", late)) == 0
    s = tier_stats(svc)
    assert s["late_finishes"] == before["late_finishes"] + 1
    assert a.lookup([*stale_ids, 0]).hit_tokens == 0  # never published
    assert a.lookup([*others, 0]).hit_tokens == n * BS
    assert ray.get(tier.release_holder.remote(me)) == 0
    ea.close()


def test_status_shows_the_lease_counters(svc) -> None:
    from raykv.service.control.launcher import status_table

    s = svc.kv.stats()
    for k in ("leases_expired", "leases_released", "late_finishes"):
        assert k in s
    deadline = time.monotonic() + 10  # members report with their heartbeats
    while s["leases_expired"] == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        s = svc.kv.stats()
    s["address"] = "here"
    assert f"tier leases expired {s['leases_expired']}" in status_table(s)


def test_a_holder_is_gone_only_when_surely_exited() -> None:
    import dataclasses
    import subprocess
    import sys

    me = holds.this_process("test")
    assert not holds.gone(me) and holds.this_process("test") == me
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    h = dataclasses.replace(me, pid=child.pid, start=holds._start_time(child.pid))
    assert not holds.gone(h)
    child.communicate(b"")
    assert holds.gone(h)  # exited (and reaped)
    assert holds.gone(dataclasses.replace(me, start=me.start + 1))  # the pid was reused
    assert not holds.gone(dataclasses.replace(h, pidns=me.pidns + 1))  # another container
    assert not holds.gone(dataclasses.replace(h, boot="another host"))
    assert not holds.gone("a name") and not holds.gone(None)


def test_an_engine_that_detaches_releases_its_leases_at_once(svc) -> None:
    """``AttachedKV.close``: the node agent releases what the engine's connection still
    holds (a lease no load took), well before its deadline."""
    _, ea, plan, ids, _ = setup(svc, "lease-detach", 8)
    ea.lease(ids, [plan.cpu_num_blocks], [0])
    held = tier_stats(svc)["leases_held"]
    assert held >= 1
    assert ea.close() == 1
    assert tier_stats(svc)["leases_held"] == held - 1

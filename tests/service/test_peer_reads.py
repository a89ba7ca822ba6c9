"""Peer reads through the service on the CPU (``RAYKV_PEER_READS=1``; pools of one node read
each other's shared-memory blocks in place, the path GPU pools of one host take over NVLink):
two pools of one model on one node, the second started beside the placed one. The route is
``peer``, every byte read back equals what was stored, the holder's hold is released after
the load, a block the holder states wrongly is a counted miss (never wrong KV), and a hold
nobody releases expires."""

import os
import time

import pytest
import ray
import torch
from kvdata import ROW, rows, tokens

from raykv.layout import FullAttention
from raykv.service.spec import NAMESPACE, pool_name

pytestmark = pytest.mark.ray
RAY_WORKERS = 0
BS = 16
LAYERS = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)}


@pytest.fixture(scope="module", autouse=True)
def peer_reads_on():
    os.environ["RAYKV_PEER_READS"] = "1"  # the actors inherit it
    yield
    del os.environ["RAYKV_PEER_READS"]


@pytest.fixture(scope="module")
def two_pools(ray_cluster):
    """(client of the placed pool, client of a second pool on the same node, model)."""
    from raykv.service.gpu_pool import GpuPool
    from raykv.service.placement import DETACHED
    from raykv.service.spec import COORDINATOR

    kv, node = ray_cluster.kv, ray_cluster.head
    plan = kv.add_model("pr", LAYERS, max_model_len=512, pool_bytes=40 * ROW, cpu_bytes=40 * ROW)
    coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
    model = ray.get(coord.__ray_call__.remote(lambda self: self.models["pr"]))
    name = pool_name("pr", node, 1)
    second = ray.remote(GpuPool).options(name=name, **DETACHED).remote(name, model, plan, node)
    ray.get(second.start.remote())

    def bound(index: int):
        c = kv.on(node)
        c.model_name = "pr"
        c._pool_name = (node, "pr", pool_name("pr", node, index))
        return c

    return bound(0), bound(1), second


def publish(client, rid, ids, data, n):
    assert client.admit(rid, len(ids), ids)
    table = client.allocate(rid, len(ids), ids)[0]
    assert client.store(rid, table[:n], data) == n
    client.free(rid)


def holder_state(ray_cluster):
    a = ray.get_actor(pool_name("pr", ray_cluster.head, 0), namespace=NAMESPACE)
    return a, ray.get(a.__ray_call__.remote(lambda s: (len(s._holds), s.bm.pool.num_used_blocks)))


def test_two_pools_of_one_node_read_in_place_and_release_the_hold(ray_cluster, two_pools):
    a, b, _ = two_pools
    ids, data = tokens(8 * BS + 1, 1), rows(8, 2)
    publish(a, "w", ids, data, 8)
    assert b.admit("r", len(ids), ids)
    table = b.allocate("r", len(ids), ids)[0]
    res = b.load("r", ids, into=table[:8])
    assert (res.num_tokens, res.bytes) == (8 * BS, 8 * ROW)
    assert torch.equal(b.read(table[:8]), data)
    b.free("r")
    routes = {(r["from"], r["to"]): r["transport"] for r in ray_cluster.kv.stats()["routes"]}
    pa, pb = (pool_name("pr", ray_cluster.head, i) for i in (0, 1))
    assert routes[(pa, pb)] == "peer", routes
    _, (holds, used) = holder_state(ray_cluster)
    assert (holds, used) == (0, 0)  # released: nothing held, nothing in use


def test_a_block_stated_wrongly_is_a_counted_miss(ray_cluster, two_pools):
    a, b, _ = two_pools
    ids, data = tokens(6 * BS + 1, 3), rows(6, 4)
    publish(a, "w2", ids, data, 6)
    holder, _ = holder_state(ray_cluster)
    valid = ray.get(holder.__ray_call__.remote(lambda s: len(s.valid)))

    def misstate(self):  # the holder's sums for its 4th block of the batch are off by one
        real = self.local.peer_sums

        def wrong(gi, blocks):
            sums = real(gi, blocks)
            if len(sums) > 3:
                sums[3] += 1
            return sums

        self.local.peer_sums = wrong

    ray.get(holder.__ray_call__.remote(misstate))
    assert b.admit("r2", len(ids), ids)
    table = b.allocate("r2", len(ids), ids)[0]
    res = b.load("r2", ids, into=table[:6])
    assert res.num_tokens == 3 * BS  # the leading three, then a miss
    assert torch.equal(b.read(table[:3]), data[:3])
    b.free("r2")
    # the reader told the holder: the misstated block is unpublished there (a miss from now)
    assert ray.get(holder.__ray_call__.remote(lambda s: len(s.valid))) == valid - 1


def test_a_hold_nobody_releases_expires(ray_cluster, two_pools):
    a, _, _ = two_pools
    ids, data = tokens(4 * BS + 1, 5), rows(4, 6)
    publish(a, "w3", ids, data, 4)
    holder, (_, used_before) = holder_state(ray_cluster)

    keys = ray.get(holder.__ray_call__.remote(lambda s: list(s.valid)[:1]))
    got = ray.get(holder.peer_export.remote("pr", keys))  # exported, never released
    assert got is not None and len(got["blocks"]) >= 1
    _, (holds, used) = holder_state(ray_cluster)
    assert holds == 1 and used > used_before
    ray.get(holder.__ray_call__.remote(
        lambda s: s._holds.update({t: (b, time.monotonic() - 1) for t, (b, _) in s._holds.items()})
    ))  # fmt: skip
    ray.get(holder.__ray_call__.remote(lambda s: s._expire_holds()))
    _, (holds, used) = holder_state(ray_cluster)
    assert (holds, used) == (0, used_before)

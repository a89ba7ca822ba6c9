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
import reader_faults
import torch
from kvdata import ROW, rows, tokens

from raykv.layout import FullAttention
from raykv.service.served import NAMESPACE, pool_name

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
    from raykv.service.control.placement import DETACHED
    from raykv.service.pool.gpu_pool import GpuPool
    from raykv.service.served import COORDINATOR

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
    return a, ray.get(
        a.__ray_call__.remote(lambda s: (len(s.pairs._holds), s.bm.pool.num_used_blocks))
    )


def summed(holder, ids, n: int) -> tuple[list[int], bool]:
    """The holder's blocks for the first ``n`` full blocks of ``ids``, and whether their wire
    sums (taken in the background when they became valid) are in, waited for up to 10 s."""

    def look(self, ids, n):
        from raykv.service.groups import group_keys

        keys = group_keys(self.plan, self.bm.hasher.hash_blocks(ids))[0][:n]
        blocks = [self.requests.valid[k] for k in keys]
        return blocks, all(b in self.requests.wire_sums for b in blocks)

    deadline = time.monotonic() + 10
    while True:
        blocks, done = ray.get(holder.__ray_call__.remote(look, ids, n))
        if done or time.monotonic() > deadline:
            return blocks, done
        time.sleep(0.02)


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
    blocks, done = summed(holder, ids, 6)
    assert done
    valid = ray.get(holder.__ray_call__.remote(lambda s: len(s.requests.valid)))

    def misstate(self, block):  # the holder states the 4th block's sum off by one
        self.requests.wire_sums[block] = tuple(x + 1 for x in self.requests.wire_sums[block])

    ray.get(holder.__ray_call__.remote(misstate, blocks[3]))
    assert b.admit("r2", len(ids), ids)
    table = b.allocate("r2", len(ids), ids)[0]
    res = b.load("r2", ids, into=table[:6])
    assert res.num_tokens == 3 * BS  # the leading three, then a miss
    assert torch.equal(b.read(table[:3]), data[:3])
    b.free("r2")
    # the reader told the holder: the misstated block is unpublished there (a miss from now)
    assert ray.get(holder.__ray_call__.remote(lambda s: len(s.requests.valid))) == valid - 1


def test_blocks_are_summed_when_they_become_valid_so_a_first_read_asks_no_rank(
    ray_cluster, two_pools
):
    a, b, _ = two_pools
    ids, data = tokens(5 * BS + 1, 7), rows(5, 8)
    publish(a, "w4", ids, data, 5)
    holder, _ = holder_state(ray_cluster)
    _, done = summed(holder, ids, 5)
    assert done  # taken in the background after the store, before any reader asked

    def no_sums(self):  # a rank asked for sums now would fail the read
        def refuse(gi, blocks):
            raise AssertionError("sums asked for at export")

        self._real_sums, self.local.links.peer_sums = self.local.links.peer_sums, refuse

    ray.get(holder.__ray_call__.remote(no_sums))
    try:
        assert b.admit("r4", len(ids), ids)
        table = b.allocate("r4", len(ids), ids)[0]
        res = b.load("r4", ids, into=table[:5])
        assert res.num_tokens == 5 * BS
        assert torch.equal(b.read(table[:5]), data)
        b.free("r4")
    finally:
        ray.get(
            holder.__ray_call__.remote(lambda s: setattr(s.local.links, "peer_sums", s._real_sums))
        )
    _, (holds, used) = holder_state(ray_cluster)
    assert (holds, used) == (0, 0)  # the background sums' holds were let go too


def test_a_failed_peer_read_is_retried_over_the_pools_collective_not_the_object_store(
    ray_cluster, two_pools
):
    a, b, second = two_pools
    ids, data = tokens(4 * BS + 1, 9), rows(4, 10)
    publish(a, "w5", ids, data, 4)

    failed = ray.get(second.__ray_call__.remote(reader_faults.peer_failures))
    ray.get(second.__ray_call__.remote(reader_faults.peer_reads_fail_and_the_store_is_down))
    try:
        assert b.admit("r5", len(ids), ids)
        table = b.allocate("r5", len(ids), ids)[0]
        res = b.load("r5", ids, into=table[:4])
        assert res.num_tokens == 4 * BS  # every block, over gloo: the store could move none
        assert torch.equal(b.read(table[:4]), data)
        b.free("r5")
    finally:
        ray.get(second.__ray_call__.remote(reader_faults.restore))
    assert ray.get(second.__ray_call__.remote(reader_faults.peer_failures)) == failed + 1


def test_a_hold_nobody_releases_expires(ray_cluster, two_pools):
    a, _, _ = two_pools
    ids, data = tokens(4 * BS + 1, 5), rows(4, 6)
    publish(a, "w3", ids, data, 4)
    holder, (_, used_before) = holder_state(ray_cluster)

    keys = ray.get(holder.__ray_call__.remote(lambda s: list(s.requests.valid)[:1]))
    got = ray.get(holder.peer_export.remote("pr", keys))  # exported, never released
    assert got is not None and len(got["blocks"]) >= 1
    _, (holds, used) = holder_state(ray_cluster)
    assert holds == 1 and used > used_before
    ray.get(holder.__ray_call__.remote(
        lambda s: s.pairs._holds.update(
            {t: (b, time.monotonic() - 1) for t, (b, _) in s.pairs._holds.items()}
        )
    ))  # fmt: skip
    ray.get(holder.__ray_call__.remote(lambda s: s.pairs._expire_holds()))
    _, (holds, used) = holder_state(ray_cluster)
    assert (holds, used) == (0, used_before)

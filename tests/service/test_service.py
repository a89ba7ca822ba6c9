"""The service on a 3-node local Ray cluster: cross-node hits, offload under pressure, bad
input, a coordinator restart and a node leaving. Destructive tests run last."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from kvdata import BLOCK, ROW, rows, tokens
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raykv.client import Client
from raykv.errors import InvalidInput, ServiceError, UnknownRequest
from raykv.layout import FullAttention
from raykv.service.served import COORDINATOR, NAMESPACE, pool_name, tier_name

pytestmark = pytest.mark.ray


LAYERS = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)}
MAX_LEN = 512


@pytest.fixture(scope="module")
def svc(ray_cluster):
    plan = ray_cluster.kv.add_model(
        "t", LAYERS, max_model_len=MAX_LEN, pool_bytes=48 * ROW, cpu_bytes=64 * ROW
    )
    return SimpleNamespace(**vars(ray_cluster), plan=plan)


def put(client, rid, ids, seed):
    """An engine step: admit, allocate, write every full block; returns (table, data)."""
    assert client.admit(rid, len(ids), ids)
    table = client.allocate(rid, len(ids), ids)[0]
    full = len(ids) // BLOCK
    data = rows(full, seed)
    assert client.store(rid, table[:full], data) == full
    return table, data


def test_plan_and_membership(svc) -> None:
    s = svc.kv.stats()
    assert len(s["nodes"]) == 3
    kinds = sorted(m["kind"] for m in s["members"])
    assert kinds == ["pool"] * 3 + ["tier"] * 3
    assert svc.plan.gpu_bytes_per_block == ROW
    assert s["models"]["t"]["num_gpu_blocks"] == svc.plan.num_gpu_blocks


def test_cross_node_hit_is_served_byte_exact(svc) -> None:
    a, b = svc.kv.on(svc.ids[0]), svc.kv.on(svc.ids[1])
    ids = tokens(200, 1)
    _, data = put(a, "x1", ids, seed=1)
    a.free("x1")  # blocks stay cached and valid
    hit = b.lookup(ids)
    assert hit.hit_tokens == 192
    assert [(h.tier, h.local, h.node_id) for h in hit.where] == [("gpu", False, svc.ids[0])]
    assert b.admit("y1", len(ids), ids)
    table = b.allocate("y1", len(ids), ids)[0]
    res = b.load("y1", ids, into=table[:12])
    assert (res.num_tokens, res.loaded_blocks, res.bytes) == (192, 12, 12 * ROW)
    assert torch.equal(b.read(table[:12]), data)
    b.free("y1")
    again = b.lookup(ids)  # B's pool now holds its own copy
    assert again.hit_tokens == 192 and again.where[0].local


def test_handles_pickle_to_other_nodes_and_async_form(svc) -> None:
    ids = tokens(200, 1)

    @ray.remote(num_cpus=0)
    def lookup_there(client, ids):
        return client.lookup(ids).hit_tokens, client._node_id()

    pin = NodeAffinitySchedulingStrategy(svc.ids[1], soft=False)
    hit, node = ray.get(lookup_there.options(scheduling_strategy=pin).remote(svc.kv, ids))
    assert (hit, node) == (192, svc.ids[1])
    assert asyncio.run(svc.kv.aio.lookup(ids)).hit_tokens == 192


def test_pressure_offloads_to_the_cpu_tier_and_loads_back(svc) -> None:
    a = svc.kv.on(svc.ids[0])
    p1 = tokens(321, 2)
    _, data = put(a, "p1", p1, seed=2)
    a.free("p1")
    # a second prompt needs more blocks than are free: cached blocks get evicted
    p2 = tokens(480, 3)
    assert a.admit("p2", len(p2), p2)
    assert a.allocate("p2", len(p2), p2) is not None
    hit = a.lookup(p1)
    assert hit.hit_tokens == 320
    assert any(h.tier == "cpu" and h.local for h in hit.where), hit.where
    a.free("p2")
    assert a.admit("p1b", len(p1), p1)
    table = a.allocate("p1b", len(p1), p1)[0]
    res = a.load("p1b", p1, into=table[: 320 // BLOCK])
    assert res.num_tokens == 320
    assert torch.equal(a.read(table[:20]), data)
    a.free("p1b")
    tier = next(
        m for m in svc.kv.stats()["members"] if m["kind"] == "tier" and m["node_id"] == svc.ids[0]
    )
    assert tier["indexed_blocks"] > 0


def test_bad_input_is_refused_and_changes_nothing(svc, state) -> None:
    a = svc.kv.on(svc.ids[0])
    ids = tokens(64, 4)
    assert a.admit("bad", len(ids), ids)
    table = a.allocate("bad", len(ids), ids)[0]
    before_rows = a.read(table)
    before = state(svc.kv)
    with pytest.raises(InvalidInput, match="uint8"):
        a.store("bad", table, torch.zeros((4, ROW // 4), dtype=torch.float32))
    with pytest.raises(InvalidInput, match=r"shape \[4, 4096\]"):
        a.store("bad", table, rows(5, 0))
    with pytest.raises(InvalidInput, match="not in request"):
        a.store("bad", [table[0], 47], rows(2, 0))
    with pytest.raises(InvalidInput, match="unknown model 'nope'"):
        Client(model="nope").lookup(ids)
    with pytest.raises(InvalidInput, match="max_model_len=512"):
        a.lookup(list(range(600)))
    with pytest.raises(InvalidInput, match="max_model_len=512"):
        a.admit("big", 600, list(range(600)))
    with pytest.raises(InvalidInput, match="integers"):
        a.lookup(["x"])
    with pytest.raises(InvalidInput, match="integers"):
        a.lookup([1.5] * 20)  # refused, not truncated to other tokens
    with pytest.raises(InvalidInput, match=r"integer dtype, got torch\.float32"):
        a.admit("f", 20, torch.ones(20))
    with pytest.raises(InvalidInput, match="differ at position 3"):
        a.allocate("bad", 4, [*ids[:3], ids[3] + 1])  # not the tokens it was admitted with
    with pytest.raises(UnknownRequest):
        a.free("never-admitted")
    assert torch.equal(a.read(table), before_rows)
    assert state(svc.kv) == before
    a.free("bad")


def test_stats_count_hits_per_tier_misses_evictions_and_bytes_moved(svc) -> None:
    assert svc.kv.lookup(tokens(100, 77)).hit_tokens == 0  # 6 blocks nobody holds
    s = svc.kv.stats()
    assert {"local_gpu", "remote_gpu", "local_cpu"} <= set(s["hits"]), s["hits"]
    assert s["misses"] >= 6 and 0 < s["hit_rate"] < 1
    pool = ray.get(
        ray.get_actor(pool_name("t", svc.ids[0], 0), namespace=NAMESPACE).snapshot.remote()
    )
    tier = ray.get(ray.get_actor(tier_name(svc.ids[0]), namespace=NAMESPACE).snapshot.remote())
    ps, ts = pool["stats"], tier["stats"]
    assert ps["evictions"] > 0 and ps["offloads"] > 0 and ps["hits_gpu"] >= 12
    assert ps["bytes_moved"] >= 12 * ROW and ts["hits_cpu"] > 0 and ts["bytes_moved"] > 0
    assert 0 < ps["blocks_valid"] <= ps["blocks_total"] and ts["blocks_used"] > 0


def test_a_dead_pool_is_placed_again_and_its_blocks_become_misses(svc) -> None:
    h, c = svc.kv.on(svc.head), svc.kv.on(svc.ids[1])
    ids = tokens(120, 6)
    put(h, "d1", ids, seed=6)
    h.free("d1")
    assert c.lookup(ids).hit_tokens == 112
    ray.kill(ray.get_actor(pool_name("t", svc.head, 0), namespace=NAMESPACE), no_restart=True)
    # Before the coordinator notices, a load from the dead pool is a miss, not an error.
    assert c.admit("d2", len(ids), ids)
    table = c.allocate("d2", len(ids), ids)[0]
    assert c.load("d2", ids, into=table[:7]).num_tokens == 0
    c.free("d2")
    # The coordinator starts a fresh pool under the same name, on the same node.
    name = pool_name("t", svc.head, 0)

    def fresh() -> bool:
        members = svc.kv.stats()["members"]
        return any(m["name"] == name and m.get("blocks_valid") == 0 for m in members)

    deadline = time.monotonic() + 60
    while not fresh() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert fresh() and c.lookup(ids).hit_tokens == 0
    pool = ray.get_actor(name, namespace=NAMESPACE)
    assert ray.get(pool.rank_info.remote())[0]["node_id"] == svc.head
    with pytest.raises(ServiceError, match="gone"):
        h.admit("d3", len(ids), ids)  # the handle still points at the dead actor: one error
    assert h.admit("d3", len(ids), ids)  # then it finds the fresh one
    table = h.allocate("d3", len(ids), ids)[0]
    assert h.store("d3", table[:7], rows(7, seed=7)) == 7
    h.free("d3")
    assert c.lookup(ids).hit_tokens == 112


def test_a_joining_node_gets_a_pool_and_a_tier(svc) -> None:
    node = svc.cluster.add_node(
        num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 << 20
    )
    deadline = time.monotonic() + 60
    kinds: list = []
    while time.monotonic() < deadline:
        kinds = sorted(m["kind"] for m in svc.kv.stats()["members"] if m["node_id"] == node.node_id)
        if kinds == ["pool", "tier"]:
            break
        time.sleep(0.5)
    assert kinds == ["pool", "tier"]
    ids = tokens(200, 1)  # the prompt node 0 holds since the first test
    d = svc.kv.on(node.node_id)
    assert d.lookup(ids).hit_tokens == 192


def test_client_retries_through_a_coordinator_restart_and_no_state_is_lost(svc) -> None:
    ids = tokens(200, 1)
    before = svc.kv.stats()
    coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
    ray.kill(coord, no_restart=False)  # Ray restarts it (max_restarts=-1)
    # ray.kill is asynchronous: the old actor may still answer a call or two. Every call
    # below retries through the restart; stop once the restarted coordinator answers.
    deadline = time.monotonic() + 60
    while not (after := svc.kv.stats())["restarted"]:
        assert time.monotonic() < deadline, "the coordinator was not restarted"
        time.sleep(0.1)
    hit = svc.kv.lookup(ids)
    assert hit.hit_tokens == 192
    assert after["indexed_blocks"] == before["indexed_blocks"]
    assert sorted(m["name"] for m in after["members"]) == sorted(
        m["name"] for m in before["members"]
    )


def test_a_node_leaving_turns_its_blocks_into_misses(svc) -> None:
    c, b = svc.kv.on(svc.ids[1]), svc.kv.on(svc.head)
    ids = tokens(160, 5)
    put(c, "z1", ids, seed=5)
    c.free("z1")
    assert b.lookup(ids).hit_tokens == 144
    svc.cluster.remove_node(svc.workers[1])
    # Before the coordinator notices, a load from the dead node is a miss, not an error.
    assert b.admit("z2", len(ids), ids)
    table = b.allocate("z2", len(ids), ids)[0]
    res = b.load("z2", ids, into=table[:9])
    assert res.num_tokens == 0 and res.loaded_blocks == 0
    b.free("z2")
    deadline = time.monotonic() + 30
    while b.lookup(ids).hit_tokens and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b.lookup(ids).hit_tokens == 0
    # Copies held elsewhere still serve: node 0's prompt from the first test.
    assert b.lookup(tokens(200, 1)).hit_tokens == 192

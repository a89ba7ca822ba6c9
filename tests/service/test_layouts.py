"""The service with plans beyond one full-attention group, on a 2-node local Ray cluster:
a scaled-down gemma-3 (sliding window + full attention, 3 groups) whose CPU-tier entries
hold 2 GPU blocks, and a TP-2 model (2 pool actors per node in one placement group)."""

import time
from types import SimpleNamespace

import kvdata
import pytest
import ray
import torch
from kvdata import rows, tokens

from raykv.blocks import BlockHasher
from raykv.client import Client
from raykv.errors import BlockSizeError, ConfigError, InvalidInput, ServiceError
from raykv.layout import FullAttention, Mamba
from raykv.layout.hf_config import layers_from_hf_config
from raykv.layout.presets import get_preset
from raykv.service.control.admin import admin_key
from raykv.service.groups import group_keys
from raykv.service.served import NAMESPACE, group_name, rank_name, tier_name

pytestmark = pytest.mark.ray
RAY_WORKERS = 1
BS, MAX_LEN, CPU_BYTES = 16, 256, 96 * 8192
GEMMA = layers_from_hf_config(
    dict(get_preset("gemma-3-27b").config)
    | dict(
        num_hidden_layers=6,
        sliding_window=32,
        sliding_window_pattern=3,  # SW, SW, full, SW, SW, full
        num_key_value_heads=1,
        num_attention_heads=2,
        head_dim=16,
        hidden_size=32,
        torch_dtype="float32",
    )
)
ROW = 2 * 2 * BS * 16 * 4  # 2 shared tensors x K,V x 16 tokens x 1 head x 16 x 4 bytes
assert ROW == kvdata.ROW  # kvdata.rows' default width
TP_LAYERS = {f"l{i}": FullAttention("float32", num_kv_heads=2, head_dim=16) for i in range(2)}
TP_ROW = ROW  # per rank: 2 layers x K,V x 16 tokens x 1 of 2 heads x 16 x 4 bytes


@pytest.fixture(scope="module")
def svc(ray_cluster):
    kv = ray_cluster.kv
    # a 256-token first step takes every block: 16 slots x 3 groups (caps are admission's)
    gemma = kv.add_model(
        "gemma", GEMMA, max_model_len=MAX_LEN, pool_bytes=49 * ROW, cpu_bytes=CPU_BYTES,
        offload_block_size=2 * BS,
    )  # fmt: skip
    tp = kv.add_model(
        "tp2", TP_LAYERS, max_model_len=MAX_LEN, tp_size=2, pool_bytes=17 * TP_ROW,
        cpu_bytes=CPU_BYTES,
    )  # fmt: skip
    return SimpleNamespace(**vars(ray_cluster), gemma=gemma, tp=tp, a=ray_cluster.ids[0])


def on(model: str, node: str) -> Client:
    return Client(model=model, node_id=node)


def evict_all(client: Client) -> None:
    """One step that takes every block of the pool: every cached block is evicted."""
    ids = tokens(MAX_LEN, 999)
    assert client.admit("evict", MAX_LEN, ids)
    assert client.allocate("evict", MAX_LEN, ids) is not None
    client.free("evict")


def tier_of(node: str):
    return ray.get_actor(tier_name(node), namespace=NAMESPACE)


def test_plans_and_cpu_tier_capacity(svc) -> None:
    gemma, tp = svc.gemma, svc.tp
    assert [g.spec.kind for g in gemma.groups] == ["sliding_window", "sliding_window", "full"]
    assert gemma.block_size_factor == 2 and gemma.cpu_bytes_per_block == 2 * ROW
    assert tp.tp_size == 2 and tp.gpu_bytes_per_block == TP_ROW
    assert tp.cpu_bytes_per_block == 2 * TP_ROW  # both ranks' distinct copies (invariant 5)
    for node in (svc.head, svc.a):
        per = ray.get(tier_of(node).snapshot.remote())["stats"]["per_model"]
        for name, p in (("gemma", gemma), ("tp2", tp)):
            assert per[name]["blocks_total"] == CPU_BYTES // p.cpu_bytes_per_block
            assert per[name]["bytes"] == per[name]["blocks_total"] * p.cpu_bytes_per_block
        assert per["tp2"]["copies"] == 2 and per["gemma"]["block_size_factor"] == 2


def test_hybrid_cross_node_hit_skips_null_blocks(svc) -> None:
    a, b = on("gemma", svc.a), on("gemma", svc.head)
    p = tokens(216, 1)  # 13 full blocks + 8 tokens
    assert a.admit("p", 217, p)
    assert [len(t) for t in a.allocate("p", 216, p)] == [14, 14, 14]
    a.allocate("p", 1, [*p, 7])  # decode: SW slots 0..10 leave the window (null block)
    tables = a.block_table("p")
    assert tables[0][:11] == [0] * 11 and 0 not in tables[0][11:] and 0 not in tables[2]
    full = [t[:13] for t in tables]  # null ids included: store skips them
    data = [rows(sum(x != 0 for x in t), seed=10 + g) for g, t in enumerate(full)]
    assert a.store("p", full, data, offload=True) == 2 + 2 + 13
    a.free("p")

    hit = b.lookup(p)  # full blocks 0..12 and the window of a 208-token prefix: SW 11, 12
    assert hit.hit_tokens == 208
    assert [(h.tier, h.local, h.node_id, h.num_tokens) for h in hit.where] == [
        ("gpu", False, svc.a, 208)
    ]
    assert b.admit("q", 216, p)
    tb = b.allocate("q", 216, p)
    res = b.load("q", p, into=[t[:13] for t in tb])
    assert res.num_tokens == 208
    assert res.loaded_blocks == 2 + 2 + 13  # SW slots 0..10 were null on A: nothing to load
    got = b.read([tb[0][11:13], tb[1][11:13], tb[2][:13]])
    assert all(torch.equal(x, d) for x, d in zip(got, data, strict=True))
    b.free("q")

    # A's CPU tier: SW entry (10, 11) straddles the window edge and carries block 11 only;
    # full entries cover blocks 0..11 (block 12's entry would need block 13: not stored)
    keys = group_keys(svc.gemma, BlockHasher(svc.gemma.hash_block_size).hash_blocks(p))
    tier = tier_of(svc.a)
    n, got, _ = ray.get(tier.export_blocks.remote("gemma", [keys[0][11]]))
    assert n == 1 and torch.equal(torch.from_numpy(got[0]), data[0][:1])
    assert ray.get(tier.export_blocks.remote("gemma", [keys[0][10]]))[0] == 0
    n, got, _ = ray.get(tier.export_blocks.remote("gemma", keys[2][:13]))
    assert n == 12 and torch.equal(torch.from_numpy(got[0]), data[2][:12])


def test_factor_two_offload_stores_only_whole_entries(svc) -> None:
    a, b = on("gemma", svc.a), on("gemma", svc.head)
    r = tokens(216, 2)
    assert a.admit("r", 216, r)
    tables = a.allocate("r", 216, r)
    data = [rows(13, seed=20 + g) for g in range(3)]
    assert a.store("r", [t[:13] for t in tables], data) == 39
    a.free("r")
    evict_all(a)  # A's GPU copies go; whole 2-block entries are offloaded first

    hit = b.lookup(r)  # block 12's entry would be partial: a miss, never a wrong hit
    assert hit.hit_tokens == 192
    assert [(h.tier, h.local, h.node_id) for h in hit.where] == [("cpu", False, svc.a)]
    assert b.admit("s", 216, r)
    tb = b.allocate("s", 216, r)
    res = b.load("s", r, into=[t[:13] for t in tb])
    assert (res.num_tokens, res.loaded_blocks, res.bytes) == (192, 36, 36 * ROW)
    got = b.read([t[:12] for t in tb])
    assert all(torch.equal(x, d[:12]) for x, d in zip(got, data, strict=True))
    b.free("s")


def test_tp2_group_on_one_node_moves_every_rank(svc) -> None:
    kv = svc.kv
    pools = [m for m in kv.stats()["members"] if m.get("model") == "tp2"]
    assert sorted(m["node_id"] for m in pools) == sorted([svc.head, svc.a])
    groups = {g["name"]: g for g in ray.util.placement_group_table().values()}
    for m in pools:
        ranks = ray.get(ray.get_actor(m["name"], namespace=NAMESPACE).rank_info.remote())
        assert [x["rank"] for x in ranks] == [0, 1]
        assert {x["node_id"] for x in ranks} == {m["node_id"]}
        assert all(x["bytes"] == svc.tp.gpu_tensor_bytes for x in ranks)  # per-rank slice
        pg = groups[group_name(m["name"])]
        assert pg["strategy"] == "STRICT_PACK" and len(pg["bundles"]) == 2

    a, b = on("tp2", svc.a), on("tp2", svc.head)
    for seed, via in ((3, "gpu"), (4, "cpu")):
        x = tokens(100, seed)  # 6 full blocks
        assert a.admit("x", 100, x)
        ta = a.allocate("x", 100, x)[0]
        per_rank = [rows(6, seed=10 * seed + r, width=TP_ROW) for r in range(2)]
        assert a.store("x", ta[:6], per_rank, offload=True) == 6
        a.free("x")
        if via == "cpu":
            evict_all(a)
        hit = b.lookup(x)
        assert hit.hit_tokens == 96
        assert [(h.tier, h.local, h.node_id) for h in hit.where] == [(via, False, svc.a)]
        assert b.admit("y", 100, x)
        tb = b.allocate("y", 100, x)[0]
        res = b.load("y", x, into=tb[:6])
        assert (res.num_tokens, res.bytes) == (96, 6 * 2 * TP_ROW)  # both distinct copies
        for rank in range(2):
            assert torch.equal(b.read(tb[:6], rank=rank), per_rank[rank])
        b.free("y")


def test_a_dead_tp_rank_gets_its_group_placed_again(svc) -> None:
    a, x = on("tp2", svc.a), tokens(40, 7)
    assert a.admit("k", 40, x)
    ta = a.allocate("k", 40, x)[0]
    assert a.store("k", ta[:2], [rows(2, 1, TP_ROW), rows(2, 2, TP_ROW)]) == 2
    a.free("k")
    assert on("tp2", svc.head).lookup(x).hit_tokens == 32
    members = svc.kv.stats()["members"]
    pool = next(m["name"] for m in members if m.get("model") == "tp2" and m["node_id"] == svc.a)
    ray.kill(ray.get_actor(rank_name(pool, 1), namespace=NAMESPACE), no_restart=True)
    with pytest.raises(ServiceError, match="gone"):
        a.read(ta[:2], rank=1)

    # the group leaves the index and comes back whole on its node, holding nothing
    def fresh() -> bool:
        return any(
            m["name"] == pool and m.get("blocks_valid") == 0 for m in svc.kv.stats()["members"]
        )

    deadline = time.monotonic() + 120  # the placement retries; a loaded 2-core box is slow
    while not fresh() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert fresh() and on("tp2", svc.head).lookup(x).hit_tokens == 0
    ranks = ray.get(ray.get_actor(pool, namespace=NAMESPACE).rank_info.remote())
    assert [(r["rank"], r["node_id"]) for r in ranks] == [(0, svc.a), (1, svc.a)]
    c = on("tp2", svc.a)
    assert c.admit("k2", 40, x)
    tc = c.allocate("k2", 40, x)[0]
    assert c.store("k2", tc[:2], [rows(2, 3, TP_ROW), rows(2, 4, TP_ROW)]) == 2
    assert torch.equal(c.read(tc[:2], rank=1), rows(2, 4, TP_ROW))
    c.free("k2")


def test_bad_input_and_unservable_models_change_nothing(svc, state) -> None:
    kv, g, t = svc.kv, on("gemma", svc.a), on("tp2", svc.a)
    ids = tokens(64, 5)
    assert g.admit("bad", 64, ids) and t.admit("bad", 64, ids)
    tables, tt = g.allocate("bad", 64, ids), t.allocate("bad", 64, ids)[0]
    before, before_rows = state(kv), g.read(tables)
    four = rows(4, 0)
    with pytest.raises(InvalidInput, match="per group"):
        g.store("bad", tables[2], four)
    with pytest.raises(InvalidInput, match="3 KV group"):
        g.store("bad", tables[:2], [four, four])
    with pytest.raises(InvalidInput, match=r"group 1, must have shape \[4, 4096\]"):
        g.store("bad", tables, [four, four[:3], four])
    with pytest.raises(InvalidInput, match=r"not in request 'bad'.s block table \(group 2\)"):
        g.store("bad", [tables[0], tables[1], tables[0]], [four] * 3)
    with pytest.raises(InvalidInput, match="tp_size=2"):
        t.store("bad", tt, rows(4, 0, TP_ROW))
    with pytest.raises(InvalidInput, match="rank 2 is outside tp_size=2"):
        t.read(tt, rank=2)
    mamba = {"a": FullAttention("float32", 1, 16), "m": Mamba("float32", ((128, 4),))}
    with pytest.raises(ConfigError, match="not a function of the token prefix"):
        kv.add_model("mixed", mamba, max_model_len=64, pool_bytes=64 * ROW)
    with pytest.raises(BlockSizeError, match="offload block size 24"):
        kv.add_model("odd", TP_LAYERS, max_model_len=64, pool_bytes=64 * ROW, offload_block_size=24)
    with pytest.raises(ConfigError, match="already served"):
        kv.add_model("gemma", GEMMA, max_model_len=128, pool_bytes=49 * ROW)
    assert state(kv) == before
    assert all(torch.equal(x, y) for x, y in zip(g.read(tables), before_rows, strict=True))
    g.free("bad")
    t.free("bad")


def test_down_removes_tp_ranks_and_placement_groups(svc) -> None:
    from raykv.service.served import COORDINATOR

    coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
    assert ray.get(coord.shutdown_service.remote(admin_key())) == 2 + 2 * 2 + 2  # tiers, tp2, gemma

    def left() -> list:
        actors = ray.util.list_named_actors(all_namespaces=True)
        return [a["name"] for a in actors if a["name"].startswith("raykv-rank-")] + [
            g["name"]
            for g in ray.util.placement_group_table().values()
            if g["name"].startswith("raykv-tp-") and g["state"] != "REMOVED"
        ]

    deadline = time.monotonic() + 20
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == []
    # serving it again places fresh TP groups (nothing left over blocks them)
    svc.kv.add_model(
        "tp2", TP_LAYERS, max_model_len=MAX_LEN, tp_size=2, pool_bytes=17 * TP_ROW,
        cpu_bytes=CPU_BYTES,
    )  # fmt: skip
    b = on("tp2", svc.head)
    x = tokens(40, 6)
    assert b.admit("z", 40, x) and b.lookup(x).hit_tokens == 0
    tb = b.allocate("z", 40, x)[0]
    assert b.store("z", tb[:2], [rows(2, 1, TP_ROW), rows(2, 2, TP_ROW)]) == 2
    assert torch.equal(b.read(tb[:2], rank=1), rows(2, 2, TP_ROW))


def test_a_model_without_pools_has_tiers_and_an_index_but_takes_no_pool(svc) -> None:
    """What an engine that keeps its own KV serves (vLLM's connector): on a GPU cluster a
    pool would take the engine's GPU. Its engines attach, store and load through the node's
    tier; allocating blocks of it says why there are none."""
    plan = svc.kv.add_model(
        "bare", TP_LAYERS, max_model_len=MAX_LEN, cpu_bytes=CPU_BYTES, pools=False
    )
    assert not [m for m in svc.kv.stats()["members"] if m.get("model") == "bare"]
    for node in (svc.head, svc.a):
        per = ray.get(tier_of(node).snapshot.remote())["stats"]["per_model"]
        assert per["bare"]["blocks_total"] == CPU_BYTES // plan.cpu_bytes_per_block
    client = Client(model="bare")
    with pytest.raises(ServiceError, match="without pools"):
        client.allocate("r", 32, tokens(32, 5))
    eng = client.attach(num_blocks=9)
    prompt = tokens(4 * BS + 1, 77)
    eng.store_from(prompt, [1, 2, 3, 4])
    assert eng.load_into(prompt, [5, 6, 7, 8]) == 4 * BS
    deadline = time.monotonic() + 10  # the tier publishes to the index in the background
    while client.lookup(prompt).hit_tokens < 4 * BS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert client.lookup(prompt).hit_tokens == 4 * BS
    with pytest.raises(ConfigError, match="pools must be True or False"):
        svc.kv.add_model("bare", TP_LAYERS, max_model_len=MAX_LEN, pools="no")

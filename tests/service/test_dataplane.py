"""The one data path on a 2-node cluster: checksums kept on every copy, corruption is a
miss (counted), an engine attached through shared memory stores and loads its own KV, and
an engine recomputing after a miss gets the same logits as a full recompute."""

import time

import ray
import torch

from raykv.layout import FullAttention
from raykv.service.served import NAMESPACE, pool_name, tier_name
from raykv.tiers import shm

RAY_WORKERS = 1
BS = 16
LAYERS = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)}
ROW = 2 * 2 * BS * 1 * 16 * 4


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, ROW), generator=g, dtype=torch.uint8)


def stats_of(name: str) -> dict:
    return ray.get(ray.get_actor(name, namespace=NAMESPACE).snapshot.remote())["stats"]


def corrupt_on_head(ray_cluster, client, model: str, block: int, stored: torch.Tensor) -> None:
    """Flip bytes of ``block`` in the head node's pool (its KV mapped here: ``pool_kv``) and
    of the head's CPU-tier entry holding ``stored`` (the rows stored from it), after both
    were published: the checksums taken at store time no longer match either copy."""
    for t in client.pool_kv().raw:
        t[block] ^= 0xFF
    tier = ray.get_actor(tier_name(ray_cluster.head), namespace=NAMESPACE)
    arena = shm.attach(ray.get(tier.arena.remote(model)))
    mask = (arena[0] == stored).all(dim=1)
    assert int(mask.sum()) == 1
    arena[0][mask.nonzero()[0, 0], :7] ^= 0x5A


def setup(ray_cluster, model: str):
    kv = ray_cluster.kv
    plan = kv.add_model(model, LAYERS, max_model_len=512, pool_bytes=40 * ROW, cpu_bytes=40 * ROW)
    return kv.on(ray_cluster.head), kv.on(ray_cluster.ids[0]), plan


def where(kv) -> dict:
    """The cluster's checksum errors, total and by where they were found."""
    s = kv.stats()
    return {"all": s["checksum_errors"], **s["checksum_errors_where"]}


def settled(kv, want: dict, before: dict) -> dict:
    """``where(kv)`` minus ``before`` once it reaches ``want`` (members report with their
    heartbeats), then two heartbeats more: nothing counts it again."""
    deadline = time.monotonic() + 20

    def delta() -> dict:
        now = where(kv)
        return {k: now[k] - before[k] for k in now}

    while delta() != want and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(2.5)
    return delta()


def test_corrupt_tier_entry_and_gpu_block_are_misses_never_wrong_kv(ray_cluster) -> None:
    a, b, _ = setup(ray_cluster, "dp-corrupt")
    counted = where(ray_cluster.kv)
    holders = [pool_name("dp-corrupt", ray_cluster.head, 0), tier_name(ray_cluster.head)]
    held = [stats_of(n).get("checksum_errors", 0) for n in holders]
    ids = tokens(6 * BS + 3, 1)
    data = rows(6, 2)
    assert a.admit("r", len(ids), ids)
    table = a.allocate("r", len(ids), ids)[0]
    assert a.store("r", table[:6], data, offload=True) == 6
    a.free("r")

    corrupt_on_head(ray_cluster, a, "dp-corrupt", table[2], data[2])

    # B loads: A's GPU copy and A's tier copy of block 2 fail their checksums: a miss at 2
    assert b.admit("q", len(ids), ids)
    tq = b.allocate("q", len(ids), ids)[0]
    res = b.load("q", ids, into=tq[:6])
    assert res.num_tokens == 2 * BS, res
    got = b.read(tq[:2])
    assert torch.equal(got, data[:2])
    sb = stats_of(pool_name("dp-corrupt", ray_cluster.ids[0], 0))
    # A's pool copy and A's tier copy, each counted once, by the reader that found it (issue
    # 44: the holders counted them again as they dropped them)
    assert sb.get("checksum_errors") == 2 and sb.get("checksum_errors_remote") == 2, sb
    assert [stats_of(n).get("checksum_errors", 0) for n in holders] == held
    # issue 44, item 4: the blocks the load could not verify (bytes that failed the check
    # may have landed there) are zeroed and out of the pool's prefix cache: another request
    # of this pool with the same prompt shares the verified blocks only
    assert not b.read(tq[2:6]).any()
    assert b.admit("q2", len(ids), ids)
    t2 = b.allocate("q2", len(ids), ids)[0]
    assert t2[:2] == tq[:2] and not set(t2[2:6]) & set(tq[2:6]), (t2, tq)
    b.free("q2")
    # the engine recomputes block 2.. and stores it: its bytes win, nothing wrong is served
    assert b.store("q", tq[2:6], data[2:6]) == 4
    assert torch.equal(b.read(tq[:6]), data)
    assert b.admit("q3", len(ids), ids)  # written whole: prefix hits again
    assert b.allocate("q3", len(ids), ids)[0][:6] == tq[:6]
    b.free("q3")
    b.free("q")
    assert b.lookup(ids).hit_tokens == 6 * BS
    want = {"all": 2, "gpu": 0, "cpu": 0, "remote": 2}
    assert settled(ray_cluster.kv, want, counted) == want


def test_a_corrupt_tier_entry_loaded_through_a_pool_counts_once(ray_cluster) -> None:
    """Issue 44, item 3: the pool of the tier's node loads a corrupt entry through the
    shared arena: a miss from there, counted once, by the tier that dropped it ("cpu");
    the pool that found it does not count it again."""
    kv = ray_cluster.kv
    kv.add_model("dp-once", LAYERS, max_model_len=8 * BS, pool_bytes=9 * ROW, cpu_bytes=16 * ROW)
    a = kv.on(ray_cluster.head)
    ids, data = tokens(6 * BS + 3, 31), rows(6, 32)
    assert a.admit("r", len(ids), ids)
    table = a.allocate("r", len(ids), ids)[0]
    assert a.store("r", table[:6], data, offload=True) == 6
    a.free("r")
    other = tokens(8 * BS, 33)  # takes all 8 blocks: the GPU copies of ids are evicted
    assert a.admit("o", len(other), other) and a.allocate("o", len(other), other)
    a.free("o")
    tier = ray.get_actor(tier_name(ray_cluster.head), namespace=NAMESPACE)
    arena = shm.attach(ray.get(tier.arena.remote("dp-once")))
    mask = (arena[0] == data[2]).all(dim=1)
    arena[0][mask.nonzero()[0, 0], :5] ^= 0x33
    names = [pool_name("dp-once", ray_cluster.head, 0), tier_name(ray_cluster.head)]
    before, counted = [stats_of(n).get("checksum_errors", 0) for n in names], where(kv)

    assert a.admit("q", len(ids), ids)
    tq = a.allocate("q", len(ids), ids)[0]
    res = a.load("q", ids, into=tq[:6])
    assert res.num_tokens == 2 * BS and res.loaded_blocks == 2, res  # from the local tier
    assert torch.equal(a.read(tq[:2]), data[:2])
    after = [stats_of(n).get("checksum_errors", 0) for n in names]
    assert [x - y for x, y in zip(after, before, strict=True)] == [0, 1]  # the tier's, once
    assert stats_of(names[1]).get("checksum_errors_cpu", 0) >= 1
    want = {"all": 1, "gpu": 0, "cpu": 1, "remote": 0}
    assert settled(kv, want, counted) == want
    a.free("q")
    del arena


def test_after_corruption_the_engines_logits_match_a_full_recompute(ray_cluster) -> None:
    """Issue 10's fault test with a real model: engine A (head node) prefills and stores a
    prompt's KV in its pool and CPU tier; block 2 is then corrupted in both copies. Engine
    B (the other node) loads what verifies (blocks 0-1: a miss at 2, counted in the stats
    ``raykv status`` prints), computes the rest and gets the logits of a full recompute."""
    from raykv.demo import DemoEngine
    from raykv.models import TinyDecoder
    from raykv.service.control.launcher import status_table

    kv = ray_cluster.kv
    layers = TinyDecoder().kv_layers()
    plan = kv.add_model("dp-logits", layers, max_model_len=512, pool_bytes=40 << 15,
                        cpu_bytes=40 << 15)  # fmt: skip
    bs = plan.groups[0].block_size
    a, b = kv.on(ray_cluster.head), kv.on(ray_cluster.ids[0])
    ea, eb = DemoEngine(a), DemoEngine(b)
    vocab = ea.model.config.vocab_size
    ids = [t % vocab for t in tokens(6 * bs + 5, 21)]
    question = [t % vocab for t in tokens(7, 22)]
    assert a.admit("p", len(ids), ids)
    table = a.allocate("p", len(ids), ids)[0]
    ea.model(ids, 0, ea.cache, table)
    kv_rows = ea._rows(table[:6])
    assert a.store("p", table[:6], kv_rows, offload=True) == 6
    a.free("p")
    before = kv.stats()["checksum_errors"]

    corrupt_on_head(ray_cluster, a, "dp-logits", table[2], kv_rows[2])

    got = eb.continue_from_cache("q", ids + question)
    assert got["loaded_tokens"] == 2 * bs, got  # a miss at block 2, never its bad bytes
    ref = eb.full_recompute(ids + question)
    assert torch.allclose(got["logits"], ref["logits"], atol=1e-5)
    deadline = time.monotonic() + 20  # members report their stats with each heartbeat
    while kv.stats()["checksum_errors"] < before + 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    s = kv.stats()
    assert s["checksum_errors"] >= before + 2, s["checksum_errors"]
    assert f"checksum errors {s['checksum_errors']}" in status_table({"address": "-", **s})


def test_an_attached_engine_stores_and_loads_through_shared_memory(ray_cluster) -> None:
    a, b, plan = setup(ray_cluster, "dp-attach")
    ids = tokens(8 * BS, 5)
    ea, eb = a.attach(), b.attach()
    gid = plan.groups[0].group_id
    src = rows(8, 6)
    from raykv import ops

    blocks = list(range(1, 9))
    ops.scatter_blocks(src, ea.kv.entries(gid), torch.tensor(blocks))
    assert ea.store_from(ids, blocks) == 8
    ea.flush()  # the tier applied the store; its events reach the index right after
    deadline = time.monotonic() + 10
    while a.lookup(ids).hit_tokens < 7 * BS and time.monotonic() < deadline:
        time.sleep(0.1)
    # published: any node's lookup hits (a lookup leaves the prompt's last token to compute)
    assert b.lookup(ids).hit_tokens == 7 * BS
    mine = [9, 3, 4, 5, 6, 7, 8, 10]
    assert ea.load_into(ids, mine) == 8 * BS
    out = torch.empty((8, ROW), dtype=torch.uint8)
    ops.gather_blocks(ea.kv.entries(gid), torch.tensor(mine), out)
    assert torch.equal(out, src)
    # the other node's pool loads the same entries across nodes, verified
    assert b.admit("x", len(ids), ids)
    tx = b.allocate("x", len(ids), ids)[0]
    assert b.load("x", ids, into=tx[:8]).num_tokens == 8 * BS
    assert torch.equal(b.read(tx[:8]), src)
    b.free("x")
    # a corrupt arena entry: the attached engine's load stops there (a counted miss)
    tier = ray.get_actor(tier_name(ray_cluster.head), namespace=NAMESPACE)
    arena = shm.attach(ray.get(tier.arena.remote("dp-attach")))
    mask = (arena[0] == src[3]).all(dim=1)
    arena[0][mask.nonzero()[0, 0], 0] ^= 1
    assert ea.load_into(ids, mine) == 3 * BS
    ea.flush()
    assert stats_of(tier_name(ray_cluster.head)).get("checksum_errors", 0) >= 1
    del arena, eb


def test_an_engines_store_and_load_go_in_pieces_and_stop_where_one_fails(ray_cluster) -> None:
    """Issue 45: a store or load of more than ``piece_bytes`` moves in pieces, the next
    piece's reservation / lease taken while this one copies. The bytes come back exact; a
    corrupt entry in a middle piece ends the load there (a counted miss); where the tier
    has no room for a piece, the pieces before it are stored (a prefix), the reservations
    asked for the rest are given back, and nothing stays held."""
    from raykv import ops
    from raykv.engine import NodeKV
    from raykv.engine.attached import AttachedKV

    _, _, plan = setup(ray_cluster, "dp-pieces")
    node = NodeKV.open(node_id=ray_cluster.head)
    node.use("dp-pieces")
    cap = plan.cpu_num_blocks
    eng = AttachedKV("dp-pieces", plan, node.agent, num_blocks=cap + 16, piece_bytes=2 * ROW)
    gid = plan.groups[0].group_id
    ids, src = tokens(9 * BS, 11), rows(9, 12)
    ops.scatter_blocks(src, eng.kv.entries(gid), torch.tensor(range(1, 10)))
    assert eng.store_from(ids, list(range(1, 10))) == 9  # 5 pieces: 1, 2, 2, 2, 2
    eng.flush()
    mine = [30, 29, 28, 27, 26, 25, 24, 23, 22]
    assert eng.load_into(ids, mine, skip=1) == 9 * BS
    out = torch.empty((8, ROW), dtype=torch.uint8)
    ops.gather_blocks(eng.kv.entries(gid), torch.tensor(mine[1:]), out)
    assert torch.equal(out, src[1:])

    tier = ray.get_actor(tier_name(ray_cluster.head), namespace=NAMESPACE)
    arena = shm.attach(ray.get(tier.arena.remote("dp-pieces")))
    errors = stats_of(tier_name(ray_cluster.head)).get("checksum_errors", 0)
    arena[0][(arena[0] == src[5]).all(dim=1).nonzero()[0, 0], 3] ^= 4  # block 5: 4th piece
    assert eng.load_into(ids, mine) == 5 * BS
    eng.flush()
    assert stats_of(tier_name(ray_cluster.head)).get("checksum_errors", 0) == errors + 1
    del arena

    # 5 entries pinned by a lease: a store of ``cap`` blocks finds room for ``cap - 5``
    lease = eng.lease(ids, [9], [0])
    assert lease.blocks(0) == 5  # the leading blocks held (5 was dropped as corrupt)
    others = tokens(cap * BS, 13)
    room = 1 + (cap - 5 - 1) // 2 * 2  # whole pieces: 1 block, then 2 each
    assert eng.store_from(others, list(range(1, cap + 1))) == room
    eng.flush()
    stored = eng.lease(others, [cap], [0])
    assert stored.blocks(0) == room  # the leading pieces
    assert eng.load_leased(stored, list(range(1, cap + 1))) == room * BS
    assert eng.load_leased(lease, list(range(1, 10))) == 5 * BS  # then releases it
    assert eng.close() == 0  # no reservation or lease left behind
    node.close()


def test_an_engines_lookup_reads_its_nodes_replica_and_a_lease_pins_its_entries(
    ray_cluster,
) -> None:
    """An engine (``NodeKV``, no Ray) looks up from its node's index replica: blocks its
    node's tier stored are a hit it can load at once (``tier_tokens``); another node's
    engine sees the same hit as held elsewhere once the coordinator's feed arrived, and
    its load pulls them first. A lease taken for a load pins its entries until released."""
    from raykv import ops
    from raykv.engine import NodeKV

    _, _, plan = setup(ray_cluster, "dp-lease")
    na = NodeKV.open(node_id=ray_cluster.head)
    nb = NodeKV.open(node_id=ray_cluster.ids[0])
    assert na.use("dp-lease").num_gpu_blocks == plan.num_gpu_blocks and nb.use("dp-lease")
    ea = na.attach(num_blocks=64)  # room for every entry of the tier (below) and more
    gid = plan.groups[0].group_id
    ids, src = tokens(8 * BS, 7), rows(8, 8)
    probe = [*ids, 0]  # one token more: the lookup sees the prompt's last full block
    assert na.lookup(probe).hit_tokens == 0
    ops.scatter_blocks(src, ea.kv.entries(gid), torch.tensor(range(1, 9)))
    assert ea.store_from(ids, list(range(1, 9))) == 8
    ea.flush()
    found = na.lookup(probe, held_tokens=2 * BS)
    assert (found.hit_tokens, found.tier_tokens) == (8 * BS, 8 * BS) and found.local
    mine = [20, 21, 9, 3, 4, 5, 6, 10]
    assert ea.load_into(ids, mine, skip=2) == 8 * BS
    out = torch.empty((6, ROW), dtype=torch.uint8)
    ops.gather_blocks(ea.kv.entries(gid), torch.tensor(mine[2:]), out)
    assert torch.equal(out, src[2:])

    # a held lease pins its entries: a store that must evict them all finds no room
    lease = ea.lease(ids, [8], [0])
    assert lease.blocks(0) == 8
    n = plan.cpu_num_blocks  # every entry of the tier
    others = tokens(n * BS, 9)
    assert ea.store_from(others, list(range(1, n + 1))) == 0
    assert ea.load_leased(lease, list(range(1, 9))) == 8 * BS  # then releases it
    ea.flush()
    assert ea.store_from(others, list(range(1, n + 1))) == n

    # the other node's replica learns of the blocks from the coordinator: held elsewhere
    assert ea.store_from(ids, list(range(1, 9))) == 8
    ea.flush()
    deadline = time.monotonic() + 10
    while nb.lookup(probe).hit_tokens < 8 * BS and time.monotonic() < deadline:
        time.sleep(0.05)
    found = nb.lookup(probe)
    assert (found.hit_tokens, found.tier_tokens, found.local) == (8 * BS, 0, False)
    eb = nb.attach(num_blocks=64)
    assert eb.pull(ids, 8) == [8]  # now its own tier holds them too
    assert nb.lookup(probe).local
    assert eb.load_into(ids, list(range(1, 9))) == 8 * BS
    ops.gather_blocks(eb.kv.entries(gid), torch.tensor(range(1, 9)), out := torch.empty_like(src))
    assert torch.equal(out, src)
    # raykv status counts the engines' lookups too (their tiers report them with a heartbeat)
    before = ray_cluster.kv.stats()["lookups"]
    for _ in range(3):
        nb.lookup(probe)
        time.sleep(0.06)  # engines count their lookups at the agent in batches 50 ms apart
    deadline = time.monotonic() + 10
    while ray_cluster.kv.stats()["lookups"] < before + 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    s = ray_cluster.kv.stats()
    assert s["lookups"] >= before + 3 and s["hits"].get("replica", 0) >= 3 * 8, s["hits"]
    for x in (ea, eb):
        x.close()
    na.close()
    nb.close()


def test_an_engine_reads_its_requests_kv_in_place_in_the_pool(ray_cluster) -> None:
    """``Client.pool_kv`` maps the node's pool's KV into the engine's process (shared memory
    here, CUDA IPC on a GPU): the blocks a store wrote and the blocks a cross-node load
    filled hold those bytes in place, per layer view and per group entry alike."""
    from raykv import ops

    a, b, plan = setup(ray_cluster, "dp-inplace")
    ids = tokens(5 * BS, 3)
    data = rows(5, 4)
    assert a.admit("r", len(ids), ids)
    table = a.allocate("r", len(ids), ids)[0]
    assert a.store("r", table, data) == 5
    mine, theirs = a.pool_kv(), b.pool_kv()
    gid = plan.groups[0].group_id
    out = torch.empty_like(data)
    ops.gather_blocks(mine.entries(gid), torch.tensor(table), out)
    assert torch.equal(out, data)
    layer = mine.layers["l0"]  # the engine's view: [K/V, blocks, block size, heads, dim]
    k_bytes = layer[0, table[1]].contiguous().view(torch.uint8).flatten()
    assert torch.equal(k_bytes, data[1][: k_bytes.numel()])  # l0's K leads each row

    assert b.admit("q", len(ids), ids)
    tq = b.allocate("q", len(ids), ids)[0]
    assert b.load("q", ids, into=tq).num_tokens == 5 * BS
    ops.gather_blocks(theirs.entries(gid), torch.tensor(tq), out)
    assert torch.equal(out, data)  # B's pool, read in place in this process

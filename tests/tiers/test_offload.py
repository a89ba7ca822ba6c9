"""OffloadEngine on CPU: store then load restores the bytes; fences, failures, checksums,
TP copies and two threads at once."""

from __future__ import annotations

import random
import threading
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.ops import reference as ops_reference
from raykv.tiers import (
    BlockState,
    CpuTier,
    GpuKV,
    LoadJob,
    OffloadEngine,
    StoreFence,
    StoreJob,
    group_factor,
    job_copy,
)
from raykv.tiers import offload as offload_mod
from raykv.tiers.checksum import row_checksums

from .helpers import MODELS, fill_random, make_plan, random_tables, row

ON_DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])


def rig(model="full", *, checksums=False, cpu_blocks=32, device="cpu", **kw):
    p = make_plan(model, cpu_blocks=cpu_blocks, **kw)
    kv = GpuKV.allocate(p, device)
    fill_random(kv)
    tier = CpuTier(p)
    return p, kv, tier, OffloadEngine(kv, tier, checksums=checksums)


def run(engine, submit, job):
    jid = submit(job)
    assert jid is not None
    (res,) = engine.wait_all()  # poll() on CPU; on CUDA after the side stream's copies
    assert res.job_id == jid
    return res


def loaded_pairs(store, load):
    """(group, source GPU id, destination GPU id) for every block both jobs carry."""
    src = {
        (store.keys[k], s): (store.key_groups[k], b)
        for (k, s), b in zip(store.slots, store.block_ids, strict=True)
    }
    return [
        (*src[(load.keys[k], s)], b) for (k, s), b in zip(load.slots, load.block_ids, strict=True)
    ]


@settings(max_examples=80, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    factor=st.sampled_from([1, 2, 4]),
    kernel=st.sampled_from([None, 2]),
    chunks=st.integers(1, 4),
    checksums=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_store_then_load_restores_bytes(model, factor, kernel, chunks, checksums, seed):
    p, kv, tier, eng = rig(
        model, factor=factor, kernel=kernel, checksums=checksums, num_gpu_blocks=160
    )
    rng = random.Random(seed)
    ids = rng.sample(range(1, p.num_gpu_blocks), p.num_gpu_blocks - 1)
    # sliding-window-like null prefixes, possibly straddling an offload block
    nulls = [rng.randint(0, chunks * group_factor(p, g)) if g.group_id else 0 for g in p.groups]
    tables, hashes = random_tables(p, rng, ids, chunks, nulls)
    store = StoreJob.build(p, "req", tables, hashes)
    res = run(eng, eng.submit_store, store)
    assert res.ok and res.job == store
    assert sum(store.group_sizes) == len(store.block_ids)
    for key in store.keys:
        assert tier.state(key) is BlockState.READABLE
    # load into fresh blocks, same null positions
    dst = [[0 if b == 0 else ids.pop() for b in t] for t in tables]
    snapshot = {
        b: row(kv, g.group_id, b) for g, t in zip(p.groups, dst, strict=True) for b in t if b
    }
    load = LoadJob.build(p, "req2", dst, hashes)
    res = run(eng, eng.submit_load, load)
    assert res.ok and res.missed == () and res.job == load
    pairs = loaded_pairs(store, load)
    assert len(pairs) == len(load.block_ids)
    for g, s, d in pairs:
        assert row(kv, g, d) == row(kv, g, s)
    carried = {d for _, _, d in pairs}
    for b, before in snapshot.items():  # nothing else was written
        if b not in carried:
            g = next(g.group_id for g, t in zip(p.groups, dst, strict=True) if b in t)
            assert row(kv, g, b) == before
    assert eng.in_flight() == () and eng.fence.fenced_blocks() == frozenset()
    tier.check_consistency()


def test_store_fences_gpu_blocks_until_done():
    p, _kv, tier, eng = rig("full")
    store = StoreJob.build(p, "r", [[3, 4, 5]], [[b"a", b"b", b"c"]])
    jid = eng.submit_store(store)
    assert eng.fence.fenced_blocks() == {3, 4, 5} and not eng.fence.can_reuse(4)
    assert eng.in_flight("r") == (jid,)
    assert tier.state(b"a") is BlockState.WRITING  # not readable before completion
    (res,) = eng.poll()
    assert res.ok and eng.fence.fenced_blocks() == frozenset() and eng.fence.can_reuse(4)
    assert eng.in_flight("r") == ()
    # storing the same prefix again carries nothing new
    again = run(eng, eng.submit_store, store)
    assert again.ok and again.job.block_ids == () and sum(again.job.group_sizes) == 0


def test_fence_holds_blocks_in_the_block_manager():
    from raykv.blocks.hashing import BlockHasher
    from raykv.blocks.manager import BlockManager
    from raykv.tiers import group_block_hashes

    p = make_plan("full", num_gpu_blocks=24)
    mgr = BlockManager(p)
    tokens = list(range(12))
    assert mgr.admit("r", 12, tokens)
    mgr.allocate("r", 12, tokens)
    table = mgr.block_table("r")
    hashes = group_block_hashes(p, BlockHasher(p.hash_block_size).hash_blocks(tokens))
    kv, tier = GpuKV.allocate(p), CpuTier(p)
    fence = StoreFence(hold=mgr.hold_blocks, release=mgr.release_blocks)
    eng = OffloadEngine(kv, tier, fence=fence)
    eng.submit_store(StoreJob.build(p, "r", table, hashes))
    free_before = mgr.num_free_blocks
    mgr.free("r")  # the request ends while its store is in flight
    assert mgr.num_free_blocks == free_before  # fenced blocks are not free (invariant 9)
    eng.poll()
    assert mgr.num_free_blocks == free_before + len(table[0])


def test_failed_store_hands_fenced_blocks_back_to_the_block_manager_only_when_reported(
    monkeypatch,
):
    """Invariant 9 on the failure path: the blocks stay out of the free queue until the failed
    store is reported, then come back exactly once; a new request never gets them meanwhile."""
    from raykv.blocks.manager import BlockManager
    from raykv.tiers import group_block_hashes

    p = make_plan("full", num_gpu_blocks=24)
    mgr = BlockManager(p)
    tokens = list(range(12))
    assert mgr.admit("r", 12, tokens)
    mgr.allocate("r", 12, tokens)
    (stored,) = mgr.block_table("r")
    hashes = group_block_hashes(p, mgr.block_hashes("r"))
    kv, tier = GpuKV.allocate(p), CpuTier(p)
    eng = OffloadEngine(kv, tier, fence=StoreFence(mgr.hold_blocks, mgr.release_blocks))

    def boom(*args, **kwargs):
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr(offload_mod.ops, "gather_blocks", boom)
    assert eng.submit_store(StoreJob.build(p, "r", [stored], hashes)) is not None
    mgr.free("r")
    others = []
    while mgr.num_free_blocks:  # new requests drain every free block
        rid, n = f"o{len(others)}", min(mgr.num_free_blocks * p.block_size, p.max_model_len)
        assert mgr.admit(rid, n) and mgr.allocate(rid, n) is not None
        others.append(rid)
    taken = {b for rid in others for b in mgr.block_table(rid)[0]}
    assert not taken & set(stored)  # fenced: never handed out while the store is in flight
    (res,) = eng.poll()
    assert not res.ok and eng.fence.fenced_blocks() == frozenset()
    assert mgr.num_free_blocks == len(stored)  # handed back once the failure is reported
    assert all(tier.state(k) is None for k in res.job.keys)
    for rid in others:
        mgr.free(rid)
    assert mgr.num_free_blocks == p.num_gpu_blocks - 1


def test_failed_store_releases_fence_and_leaves_nothing_readable(monkeypatch):
    p, _kv, tier, eng = rig("uneven_hybrid", factor=2)
    tables = [[1, 2, 3, 4], [0, 5, 6, 7]]
    hashes = [[b"a%d" % i for i in range(4)], [b"s%d" % i for i in range(4)]]
    store = StoreJob.build(p, "r", tables, hashes)

    def boom(*args, **kwargs):
        raise RuntimeError("copy engine fault")

    monkeypatch.setattr(offload_mod.ops, "gather_blocks", boom)
    jid = eng.submit_store(store)
    assert eng.fence.is_fenced(1)  # fenced until the failure is reported
    (res,) = eng.poll()
    assert res.job_id == jid and not res.ok and "copy engine fault" in res.error
    assert eng.fence.fenced_blocks() == frozenset() and eng.in_flight("r") == ()
    for key in store.keys:
        assert tier.state(key) is None and tier.lookup([key]) == 0
    assert tier.num_free == tier.num_blocks and tier.stats.failed_stores == len(store.keys)
    tier.check_consistency()
    monkeypatch.undo()  # the request can simply store again
    assert run(eng, eng.submit_store, store).ok
    assert tier.lookup(store.keys) == len(store.keys)


def test_store_without_room_changes_nothing():
    p, _kv, tier, eng = rig("full", cpu_blocks=2)
    store = StoreJob.build(p, "r", [[1, 2, 3]], [[b"a", b"b", b"c"]])
    assert eng.submit_store(store) is None
    assert eng.fence.fenced_blocks() == frozenset() and tier.num_free == 2
    assert eng.in_flight() == ()


def test_checksum_mismatch_is_a_miss_and_an_error():
    p, kv, tier, eng = rig("full", factor=2, checksums=True)
    hashes = [[b"h%d" % i for i in range(6)]]
    store = StoreJob.build(p, "r", [[1, 2, 3, 4, 5, 6]], hashes)
    assert run(eng, eng.submit_store, store).ok
    lease = tier.prepare_load([b"h3"])  # find where the second CPU block lives
    bad_row = lease.blocks[0] * tier.factor + 1
    tier.finish_load(lease)
    tier.rows(0)[bad_row, 7] ^= 0xFF  # a bit flip in the arena
    dst = [10, 11, 12, 13, 14, 15]
    res = run(eng, eng.submit_load, LoadJob.build(p, "r2", [dst], hashes))
    assert res.ok and res.missed == (b"h3", b"h5")  # the bad block and the rest of the prefix
    # never wrong KV: blocks 12-15 were written (each row summed as it was), not reported loaded
    assert res.job.block_ids == (10, 11)
    assert row(kv, 0, 10) == row(kv, 0, 1) and row(kv, 0, 11) == row(kv, 0, 2)
    assert tier.stats.checksum_errors == 1
    assert tier.lookup([b"h1", b"h3"]) == 1  # the corrupt block is gone
    tier.check_consistency()


@ON_DEVICES
@settings(max_examples=60, deadline=None)
@given(
    factor=st.sampled_from([1, 2, 3]),
    piece_rows=st.integers(1, 5),
    run_rows=st.sampled_from([1, 8]),
    holes=st.booleans(),
    data=st.data(),
)
def test_a_corrupt_entry_is_a_counted_miss_with_the_rest_of_its_prefix(
    device, factor, piece_rows, run_rows, holes, data
):
    """The copy sums each row as it writes it (on the host the native fused copy, its rows
    split over the host threads ``piece_rows`` at a time; on CUDA the kernel), run by run of
    consecutive arena rows or through a staging buffer (``RUN_ROWS``): a corrupt entry
    anywhere, even one straddling two runs or two threads' pieces, is a counted miss with
    the rest of the prefix, never reported loaded, whatever bytes landed in its blocks (and
    the later ones'). Every entry before it arrives whole."""
    p, kv, tier, eng = rig("full", factor=factor, checksums=True, cpu_blocks=16, device=device)
    n = 8 * factor
    hashes = [[b"h%d" % i for i in range(n)]]
    if holes:  # CPU blocks 1, 3 and 5 stay taken: the entries' rows come in runs
        fill = [[b"f%d" % i for i in range(6 * factor)]]
        ids = list(range(40, 40 + 6 * factor))
        assert run(eng, eng.submit_store, StoreJob.build(p, "f", [ids], fill)).ok
        for key in fill[0][factor - 1 :: 2 * factor]:
            tier.drop(key)
    assert run(eng, eng.submit_store, StoreJob.build(p, "r", [list(range(1, n + 1))], hashes)).ok
    keys = hashes[0][factor - 1 :: factor]
    bad_key = data.draw(st.integers(0, len(keys) - 1))
    bad_sub = data.draw(st.integers(0, factor - 1))
    lease = tier.prepare_load([keys[bad_key]])
    tier.rows(0)[lease.blocks[0] * tier.factor + bad_sub, 3] ^= 0x10
    tier.finish_load(lease)
    dst = list(range(30, 30 + n))
    width = tier.rows(0).shape[1]
    with (
        mock.patch.object(ops_reference, "PARALLEL_PIECE_BYTES", piece_rows * width),
        mock.patch.object(job_copy, "RUN_ROWS", run_rows),  # 1: runs of one row are runs
    ):
        res = run(eng, eng.submit_load, LoadJob.build(p, "r2", [dst], hashes))
    assert res.ok and res.missed == tuple(keys[bad_key:])
    good = bad_key * factor
    assert res.job.block_ids == tuple(dst[:good])
    for i, b in enumerate(dst[:good]):
        assert row(kv, 0, b) == row(kv, 0, 1 + i)
    assert tier.stats.checksum_errors == 1 and tier.lookup(keys) == bad_key
    tier.check_consistency()


@ON_DEVICES
@settings(max_examples=60, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    factor=st.sampled_from([1, 2]),
    taken=st.sets(st.integers(0, 23), max_size=16),
    run_rows=st.sampled_from([1, 8]),
    seed=st.integers(0, 2**16),
)
def test_store_and_load_through_scattered_arena_rows_restore_bytes_and_checksums(
    device, model, factor, taken, run_rows, seed
):
    """Arena entries left taken between the free ones scatter a store's rows: each run of
    consecutive rows is copied directly (or, with many runs, through a staging buffer), each
    row summed as it is copied (natively on the host, by the kernel on CUDA); the load
    restores every byte, and the checksums taken are those of the rows as they landed (the
    load verifies them all)."""
    p, kv, tier, eng = rig(model, factor=factor, checksums=True, cpu_blocks=24, device=device)
    fill = [[b"f%d" % i for i in range(24)]]
    for key in fill[0]:  # every CPU block taken, then the ones not in ``taken`` freed
        res = tier.prepare_store([key])
        tier.finish_store(res, True, ((True,) * tier.factor,))
    for i, key in enumerate(fill[0]):
        if i not in taken:
            tier.drop(key)
    rng = random.Random(seed)
    free = tier.num_free
    chunks = max(1, min(free, 4) // max(1, len(p.groups)))
    ids = rng.sample(range(1, p.num_gpu_blocks), p.num_gpu_blocks - 1)
    tables, hashes = random_tables(p, rng, ids, chunks, [0] * len(p.groups))
    width = max(kv.row_bytes(g.group_id) for g in p.groups)
    with (
        mock.patch.object(ops_reference, "PARALLEL_PIECE_BYTES", width),  # a row a host thread
        mock.patch.object(job_copy, "RUN_ROWS", run_rows),
    ):
        store = StoreJob.build(p, "req", tables, hashes)
        if eng.submit_store(store) is None:
            return  # more entries than free blocks: nothing changed
        (res,) = eng.wait_all()
        assert res.ok
        for k, key in enumerate(store.keys):  # the checksums taken are the landed rows'
            lease = tier.prepare_load([key])
            width_k = kv.row_bytes(store.key_groups[k])
            for (kk, sub), _ in zip(store.slots, store.block_ids, strict=True):
                if kk == k:
                    r = tier.row(lease.blocks[0], sub)
                    landed = row_checksums(tier.rows(0)[r : r + 1, :width_k])[0]
                    assert lease.checksums[0][0][sub] == landed
            tier.finish_load(lease)
        dst = [[ids.pop() if b else 0 for b in t] for t in tables]
        load = LoadJob.build(p, "req2", dst, hashes)
        res = run(eng, eng.submit_load, load)
    assert res.ok and res.missed == () and tier.stats.checksum_errors == 0
    for g, s, d in loaded_pairs(store, load):
        assert row(kv, g, d) == row(kv, g, s)
    tier.check_consistency()


def test_load_of_a_block_that_was_null_at_store_time_is_a_miss():
    p, kv, _tier, eng = rig("sliding", factor=2, window=4)
    hashes = [[b"h%d" % i for i in range(4)]]
    assert run(eng, eng.submit_store, StoreJob.build(p, "r", [[0, 2, 3, 4]], hashes)).ok
    res = run(eng, eng.submit_load, LoadJob.build(p, "r2", [[7, 8, 9, 10]], hashes))
    assert res.missed == (b"h1", b"h3") and res.job.block_ids == ()
    res = run(eng, eng.submit_load, LoadJob.build(p, "r3", [[0, 8, 9, 10]], hashes))
    assert res.missed == () and res.job.block_ids == (8, 9, 10)
    assert [row(kv, 0, b) for b in (8, 9, 10)] == [row(kv, 0, b) for b in (2, 3, 4)]


def test_load_of_an_evicted_key_changes_nothing():
    p, _kv, tier, eng = rig("full")
    assert eng.submit_load(LoadJob.build(p, "r", [[5]], [[b"nope"]])) is None
    assert eng.poll() == [] and tier.num_free == tier.num_blocks


@pytest.mark.parametrize(("model", "tp", "copies"), [("full", 2, 2), ("full", 4, 2), ("mla", 2, 1)])
def test_tp_ranks_store_their_own_copy(model, tp, copies):
    """Each distinct TP copy is written once (by its first rank) and read by every rank
    holding it: 2 KV heads on 4 ranks are 2 copies, MLA's latent is 1 (invariant 5)."""
    p = make_plan(model, tp_size=tp, factor=2)
    tier = CpuTier(p)
    assert tier.copies == copies
    ranks = []
    for r in range(tp):
        kv = GpuKV.allocate(p)
        fill_random(kv, seed=r * copies // tp)  # replicas hold the same bytes
        ranks.append((kv, OffloadEngine(kv, tier, rank=r)))
    assert [eng.writes for _, eng in ranks] == [r % (tp // copies) == 0 for r in range(tp)]
    hashes = [[b"h%d" % i for i in range(4)]]
    store = StoreJob.build(p, "r", [[1, 2, 3, 4]], hashes)
    reservation = tier.prepare_store(store.keys, writers=tier.copies)
    for _, eng in ranks:
        eng.submit_store(store, reservation)
    last_writer = max(i for i, (_, eng) in enumerate(ranks) if eng.writes)
    for i, (_, eng) in enumerate(ranks):
        assert all(res.ok for res in eng.poll())
        if i < last_writer:
            assert tier.state(b"h1") is BlockState.WRITING  # a copy is not written yet
    assert tier.state(b"h1") is BlockState.READABLE
    for kv, eng in ranks:
        res = run(eng, eng.submit_load, LoadJob.build(p, "r2", [[9, 10, 11, 12]], hashes))
        assert res.ok and res.missed == ()
        assert [row(kv, 0, b) for b in (9, 10, 11, 12)] == [row(kv, 0, b) for b in (1, 2, 3, 4)]


def test_two_threads_interleaving_stores_and_loads():
    """Two threads share one engine and a small tier: evictions happen, yet every load
    restores the bytes its thread stored, and the arena metadata stays consistent."""
    p, kv, tier, eng = rig("full", factor=2, cpu_blocks=6, num_gpu_blocks=64, checksums=True)
    results, lock = {}, threading.Lock()
    errors = []

    def wait(jid):
        while True:
            for r in eng.poll():
                with lock:
                    results[r.job_id] = r
            with lock:
                if jid in results:
                    return results.pop(jid)

    def worker(t: int):
        try:
            rng = random.Random(t)
            src = list(range(1 + 30 * t, 9 + 30 * t))  # 8 source blocks, 4 CPU blocks
            dst = list(range(9 + 30 * t, 17 + 30 * t))
            for it in range(60):
                n = rng.choice([2, 4, 8])
                # three key generations per thread: 12 CPU blocks of keys cycle through a
                # 6-block tier, so every thread's own stores must evict
                g = rng.randrange(3)
                hashes = [[b"t%d-g%d-%d" % (t, g, i) for i in range(n)]]
                if rng.random() < 0.5:
                    jid = eng.submit_store(StoreJob.build(p, f"s{t}", [src[:n]], hashes))
                    if jid is not None:
                        assert wait(jid).ok
                else:
                    jid = eng.submit_load(LoadJob.build(p, f"l{t}", [dst[:n]], hashes))
                    if jid is None:
                        continue
                    res = wait(jid)
                    for s, d in zip(src, res.job.block_ids, strict=False):
                        assert row(kv, 0, s) == row(kv, 0, d), (t, it)
                    assert tier.stats.checksum_errors == 0
                    with torch.no_grad():
                        for e in kv.entries(0):
                            e[dst] = 0  # forget the loaded copy
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert tier.stats.evicted > 0 and tier.stats.loaded > 0
    assert eng.in_flight() == () and eng.fence.fenced_blocks() == frozenset()
    tier.check_consistency()

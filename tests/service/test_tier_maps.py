"""The node tier's entry maps (``raykv.service.tier.actor._ModelTier``): which entries hold
which block keys. Entries that are their own only member (every entry of a plan without a
block-size factor) are kept as one shared marker (``OWN``) and moved in batches
(``note_all`` / ``forget_all``), leases answer per block (entry index, sub-slot) as arrays;
all of it must answer exactly as the per-key maps did (the reference below), whatever the
mix of such entries, chunked entries, null members and keys held twice. In-process, no Ray."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import ray
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.layout import FullAttention
from raykv.service.groups import key_group
from raykv.service.member import Membership
from raykv.service.served import ServedModel
from raykv.service.tier.actor import OWN, CpuTierActor, _ModelTier
from raykv.tiers import shm

BS, ROW = 16, 2 * 16 * 1 * 16 * 4
LAYERS = {"l0": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16)}


def served(factor: int, blocks: int = 16) -> ServedModel:
    return ServedModel(f"m{factor}", LAYERS, max_model_len=14 * BS, pool_bytes=16 * ROW,
                       cpu_bytes=blocks * factor * ROW, offload_block_size=factor * BS)  # fmt: skip


class Reference:
    """The maps as they were kept key by key (a dict of holders per block key)."""

    def __init__(self) -> None:
        self.entries: dict = {}
        self.where: dict = {}

    def forget(self, entry: bytes) -> list[bytes]:
        gone = []
        for s, m in enumerate(self.entries.pop(entry, ())):
            held = self.where.get(m) if m is not None else None
            if held is not None and held.pop(entry, None) == s and not held:
                del self.where[m]
                gone.append(m)
        return gone

    def note(self, entry: bytes, members: tuple) -> list[bytes]:
        self.entries[entry] = members
        new = []
        for s, m in enumerate(members):
            if m is None:
                continue
            held = self.where.setdefault(m, {})
            if not held:
                new.append(m)
            held[entry] = s
        return new

    def choose(self, keys: list[bytes]) -> list[tuple[bytes, int]]:
        gid = key_group(keys[0]) if keys else None
        chosen = []
        for key in keys:
            held = self.where.get(key)
            if not held or key_group(key) != gid:
                break
            chosen.append(next(iter(held.items())))
        return chosen


# a small alphabet of block keys, so that entries share members and keys repeat: two groups,
# and two short keys whose group id equals a 4-byte prefix's (key_group reads them alike)
KEYS = [g.to_bytes(4, "little") + bytes([i]) * 32 for g in (0, 1) for i in range(6)]
KEYS += [b"\x00", b"\x01\x00"]
key = st.sampled_from(KEYS)
entry = st.tuples(
    key,
    st.one_of(
        st.just("own"),
        st.lists(st.one_of(st.none(), key), min_size=1, max_size=3).map(tuple),
    ),
)
# "store" / "evict": the batches a store and its evictions make (own entries, entries held)
ops = st.lists(
    st.tuples(
        st.sampled_from(["note", "forget", "choose", "store", "evict"]),
        st.lists(entry, max_size=8),
    ),
    max_size=25,
)


@pytest.fixture(scope="module")
def mt():
    tier = _ModelTier(served(1).plan(16 * ROW), 60.0)
    yield tier
    tier.tier.release()
    shm.release(tier.replica_shm)


@settings(max_examples=300, deadline=None)
@given(ops=ops)
def test_the_maps_answer_as_the_per_key_maps_did(mt, ops) -> None:
    mt.entries.clear()
    mt.where.clear()
    ref = Reference()
    for op, batch in ops:
        entries = [e for e, _ in batch]
        if op == "store":
            op, batch = "note", [(e, "own") for e in dict.fromkeys(entries) if e not in ref.where]
            entries = [e for e, _ in batch]
        elif op == "evict":
            op, entries = "forget", [e for e in dict.fromkeys(entries) if e in ref.entries]
        if op == "note":
            members = [OWN if m == "own" else m for _, m in batch]
            want = [k for e, m in batch for k in ref.note(e, (e,) if m == "own" else m)]
            assert mt.note_all(entries, members) == want
        elif op == "forget":
            want = [k for e in entries for k in ref.forget(e)]
            assert mt.forget_all(entries) == want
        else:
            assert mt.choose(entries) == ref.choose(entries)
        assert set(mt.where) == set(ref.where)  # what a snapshot and an apply's check see
        for k in KEYS:
            assert mt.holders(k) == ref.where.get(k, {})


def test_one_entry_at_a_time_and_in_batches_agree(mt) -> None:
    mt.entries.clear()
    mt.where.clear()
    keys = KEYS[:6]
    assert mt.note_all(keys, [OWN] * 6) == keys
    assert all(mt.where[k] is OWN for k in keys)  # the batch keeps the marker, no dict each
    assert mt.note(keys[0], (keys[0], keys[1])) == []  # a chunk holding two of them
    assert mt.holders(keys[1]) == {keys[1]: 0, keys[0]: 1}
    assert mt.choose(keys) == [(k, 0) for k in keys]
    assert mt.forget_all(keys[1:]) == keys[2:]  # block 1 is still the chunk's
    assert mt.forget(keys[0]) == [keys[0], keys[1]]
    assert not mt.where and not mt.entries
    # a key at two sub-slots of one entry: forgetting it leaves an empty holder, not held
    assert mt.note(keys[1], (keys[0], keys[0])) == [keys[0]]
    assert mt.forget(keys[1]) == []
    assert mt.where == {keys[0]: {}} and mt.choose(keys) == [] and mt.holders(keys[0]) == {}


@pytest.mark.parametrize("factor", [1, 2])
def test_a_lease_names_each_block_s_entry_and_sub_slot_as_the_per_block_lease(
    factor, monkeypatch
) -> None:
    """``lease_groups`` (arrays, an engine's load) and ``lease`` (a list of pairs) agree, for
    entries of one block sent without members (None) and for chunks of two."""

    async def published(*args):
        return True

    monkeypatch.setattr(Membership, "call", lambda self, *a: published())
    monkeypatch.setattr(ray, "get_actor", lambda *a, **k: None)
    model = served(factor)
    t = CpuTierActor("this-node", {model.name: model.plan(16 * ROW)})
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    try:
        keys = [bytes(4) + i.to_bytes(32, "little") for i in range(1, 13)]
        entries = tuple(keys[factor - 1 :: factor])
        members = None if factor == 1 else tuple(tuple(keys[i : i + 2]) for i in range(0, 12, 2))
        _, res = run(t.reserve(model.name, entries, members, 1, "me"))
        run(t.apply(model.name, [("finish_store", res, True, None, None, 0)], False))
        mt = t.tiers[model.name]
        assert not mt.pending and set(mt.where) == set(keys)
        if factor == 1:
            assert all(mt.where[k] is OWN for k in keys)
        _, groups = run(t.lease_groups(model.name, [keys[:9], keys[3:]], "me"))
        for (lease, chosen), ks in zip(groups, (keys[:9], keys[3:]), strict=True):
            _, lease2, pairs = run(t.lease(model.name, ks, "me"))
            assert lease.keys == lease2.keys
            assert isinstance(chosen, np.ndarray) and chosen.dtype == np.int64
            assert [tuple(p) for p in chosen.tolist()] == pairs
            assert [(lease.keys[e], s) for e, s in pairs] == mt.choose(ks)
        _, (miss,) = run(t.lease_groups(model.name, [[bytes(36)]], "me"))
        assert miss[0] is None and miss[1].shape == (0, 2)
        run(asyncio.sleep(0))  # the publications the applies started
        assert not t._publishing
    finally:
        loop.close()
        for mt in t.tiers.values():
            mt.tier.release()
            shm.release(mt.replica_shm)

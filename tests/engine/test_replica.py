"""The node's prefix index replica (``raykv.service.node.replica``) and the coordinator's change
feed that keeps it current (``raykv.service.control.index.IndexFeed``).

Invariant: what an engine reads for a key is the writer's truth, or 0 (a miss) where the
replica had no room for it; never a hit the truth does not hold. Rebuilds (dead slots
cleared) change nothing a reader sees."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.blocks import hashing
from raykv.blocks.events import PrefixIndex
from raykv.service.control.index import IndexFeed, group_key
from raykv.service.node import replica as replica_module
from raykv.service.node.replica import (
    ELSEWHERE,
    LOCAL_POOL,
    LOCAL_TIER,
    ReplicaReader,
    ReplicaSpec,
    ReplicaWriter,
    group_key_lanes,
    key_lanes,
)


def replica(tmp_path, slots: int) -> tuple[ReplicaWriter, ReplicaReader]:
    spec = ReplicaSpec(str(tmp_path / f"replica-{slots}"), slots)
    with open(spec.path, "wb") as f:
        f.truncate(spec.nbytes)
    buf = np.memmap(spec.path, np.uint8, mode="r+", shape=(spec.nbytes,))
    return ReplicaWriter(buf, spec), ReplicaReader(spec)


def block_hash(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


@pytest.fixture(scope="module")
def native() -> None:
    """raykv's extension loaded: ``hash_flags`` then probes in one native pass."""
    if "Python path" in hashing.build_native():
        pytest.skip(f"raykv's extension is not built here: {hashing.native_status()}")


def both_probes(reader: ReplicaReader, hashes: list[bytes], group: int, step: int) -> np.ndarray:
    """A lookup's probe (``hash_flags``, native) of every ``step``-th hash, checked against
    the reference (``flags`` of the same keys' lanes); the flags."""
    got = reader.hash_flags(b"".join(hashes), group, step)
    want = reader.flags(key_lanes(hashes[step - 1 :: step], group))
    assert got.tolist() == want.tolist()
    return got


ops = st.lists(
    st.tuples(
        st.sampled_from(["tier+", "tier-", "holders", "clear"]),
        st.lists(st.tuples(st.integers(0, 2), st.integers(0, 200)), max_size=40),
        st.sampled_from([0, LOCAL_POOL, ELSEWHERE, LOCAL_POOL | ELSEWHERE]),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, slots=st.sampled_from([1024, 4096]))
def test_a_reader_sees_the_truth_or_a_miss_never_a_false_hit(tmp_path_factory, native, ops, slots):
    writer, reader = replica(tmp_path_factory.mktemp("r"), slots)
    truth: dict[tuple[int, int], int] = {}  # (group, block) -> flags
    for kind, keys, bits in ops:
        gks = [group_key(g, block_hash(b)) for g, b in keys]
        if kind == "tier+":
            writer.set_local(gks, True)
            for k in keys:
                truth[k] = truth.get(k, 0) | LOCAL_TIER
        elif kind == "tier-":
            writer.set_local(gks, False)
            for k in keys:
                truth[k] = truth.get(k, 0) & ~LOCAL_TIER
        elif kind == "holders":
            writer.set_holders([(gk, bits) for gk in gks])
            for k in keys:
                truth[k] = (truth.get(k, 0) & LOCAL_TIER) | bits
        else:
            writer.clear_holders()
            truth = {k: f & LOCAL_TIER for k, f in truth.items()}
    probe = sorted(set(truth) | {(0, 1000), (1, 1001)})
    for g in range(3):
        mine = [b for gg, b in probe if gg == g]
        got = both_probes(reader, [block_hash(b) for b in mine], g, 1)
        for b, f in zip(mine, got.tolist(), strict=True):
            want = truth.get((g, b), 0)
            assert f in (want, 0), (g, b, f, want)
            if not writer.dropped:
                assert f == want, (g, b, f, want)


def test_a_full_replica_rebuilds_then_drops_keys_as_misses(tmp_path) -> None:
    writer, reader = replica(tmp_path, 1024)
    keys = [group_key(0, block_hash(i)) for i in range(700)]
    writer.set_local(keys[:500], True)  # a replica holds up to half its slots
    writer.set_local(keys[:400], False)  # 400 dead slots: the next batch rebuilds
    writer.set_local(keys[400:], True)
    assert writer.dropped == 0 and int(reader.t.header[2]) == 2  # one rebuild, even again
    got = reader.flags(key_lanes([block_hash(i) for i in range(700)], 0))
    assert (got[:400] == 0).all() and (got[400:] == LOCAL_TIER).all()
    writer.set_local([group_key(0, block_hash(i)) for i in range(1000, 1500)], True)
    assert writer.dropped > 0  # no room: those keys are misses, never wrong
    assert (reader.flags(key_lanes([block_hash(i) for i in range(400, 700)], 0)) != 0).all()


def test_a_key_dropped_for_want_of_room_keeps_its_truth_for_its_next_write(tmp_path) -> None:
    writer, reader = replica(tmp_path, 1024)
    keys = [group_key(0, block_hash(i)) for i in range(513)]
    writer.set_local(keys[:512], True)  # the table at half: the next new key has no room
    writer.set_local(keys[512:], True)
    assert writer.dropped == 1
    lanes = key_lanes([block_hash(512)], 0)
    assert reader.flags(lanes).tolist() == [0]  # a miss, never wrong
    writer.set_local(keys[:300], False)  # dead slots: room once rebuilt
    writer.set_holders([(keys[512], LOCAL_POOL), (keys[512], ELSEWHERE)])  # the last counts
    assert reader.flags(lanes).tolist() == [LOCAL_TIER | ELSEWHERE]  # its tier bit kept aside
    writer.clear_holders()
    assert reader.flags(lanes).tolist() == [LOCAL_TIER]
    got = reader.flags(key_lanes([block_hash(i) for i in range(512)], 0))
    assert (got[:300] == 0).all() and (got[300:] == LOCAL_TIER).all()


@settings(max_examples=40, deadline=None)
@given(
    homes=st.lists(st.integers(0, 40), min_size=1, max_size=300),
    drop=st.lists(st.integers(0, 299), max_size=100),
)
def test_keys_crowding_a_few_homes_are_each_found_where_a_reader_probes(tmp_path_factory, homes,
                                                                       drop):  # fmt: skip
    """Batch placement (keys probing in rounds, several after one free slot) leaves every
    key on its probe path, unique, and none past the probe limit: what the reader finds."""
    writer, reader = replica(tmp_path_factory.mktemp("r"), 1024)
    # keys whose home slots collide on purpose: a home lane of their own, distinct keys
    lanes = np.array([((i + 1) << 8, h) for i, h in enumerate(homes)], np.uint64)
    writer._update(lanes, lambda old: old | np.uint64(LOCAL_TIER))
    first = reader.flags(lanes)
    assert set(first.tolist()) <= {0, LOCAL_TIER}
    placed = len(lanes) - writer.dropped  # the rest had no slot within the probe limit
    assert (first != 0).sum() == placed == len(np.flatnonzero(writer.t.slots))
    assert int(writer.t.header[3]) == placed
    gone = np.zeros(len(lanes), bool)
    gone[[d for d in drop if d < len(lanes)]] = True
    writer._update(lanes[gone], lambda old: old & ~np.uint64(LOCAL_TIER))
    assert (reader.flags(lanes) == np.where(gone, 0, first)).all()  # dead slots read 0


@settings(max_examples=40, deadline=None)
@given(
    homes=st.lists(st.integers(0, 40), min_size=1, max_size=300),
    drop=st.lists(st.integers(0, 299), max_size=100),
    group=st.integers(0, 3),
    step=st.integers(1, 4),
)
def test_a_lookups_native_probe_answers_as_the_reference(tmp_path_factory, native, homes, drop,
                                                         group, step):  # fmt: skip
    """The lookup's one native pass (fold, home slot, linear probe to the print or an unused
    slot) reads what ``flags`` reads, key for key: keys crowding a few homes (long probe
    runs, keys past the probe limit), dead slots, other groups' keys, every ``step``-th
    hash. Hashes are made to fold onto the chosen homes."""
    writer, reader = replica(tmp_path_factory.mktemp("r"), 1024)
    g = np.uint64(group + 1)
    with np.errstate(over="ignore"):
        fold_fp, fold_home = g * np.uint64(0x9E3779B97F4A7C15), g * np.uint64(0xC2B2AE3D27D4EB4F)
    fps = np.array([(i + 1) << 8 for i in range(len(homes))], np.uint64)
    raw = np.zeros((len(homes), 4), np.uint64)
    raw[:, 0] = fps ^ fold_fp
    raw[:, 1] = np.array(homes, np.uint64) ^ fold_home
    hashes = [r.tobytes() for r in raw]
    lanes = key_lanes(hashes, group)
    assert (lanes[:, 0] == fps).all() and (lanes[:, 1] == np.array(homes, np.uint64)).all()
    writer._update(lanes[::2], lambda old: old | np.uint64(LOCAL_TIER))
    writer._update(key_lanes(hashes[1::2], group + 1), lambda old: old | np.uint64(ELSEWHERE))
    gone = np.zeros(len(lanes), bool)
    gone[[d for d in drop if d < len(lanes)]] = True
    writer._update(lanes[gone], lambda old: old & ~np.uint64(LOCAL_TIER))
    got = both_probes(reader, hashes, group, step)
    assert set(got.tolist()) <= {0, LOCAL_TIER}  # another group's keys are never this one's


def test_a_native_probe_during_a_rebuild_is_a_miss(tmp_path, native, monkeypatch) -> None:
    writer, reader = replica(tmp_path, 1024)
    hashes = [block_hash(i) for i in range(10)]
    writer.set_local([group_key(0, h) for h in hashes[:7]], True)
    assert both_probes(reader, hashes, 0, 1).tolist() == [LOCAL_TIER] * 7 + [0] * 3
    with monkeypatch.context() as m:  # no extension: the reference answers the lookup's form
        m.setattr(replica_module, "native_module", lambda: None)
        assert reader.hash_flags(b"".join(hashes), 0, 3).tolist() == [LOCAL_TIER] * 2 + [0]
    writer.t.header[2] += 1  # a writer mid-rebuild: odd generation
    assert (reader.hash_flags(b"".join(hashes), 0) == 0).all()
    writer.t.header[2] += 1
    assert reader.hash_flags(b"".join(hashes), 0, 2).tolist() == [LOCAL_TIER] * 3 + [0] * 2


def test_a_group_key_and_a_hash_of_that_group_are_the_same_replica_key() -> None:
    h = [block_hash(i) for i in range(5)]
    for g in (0, 3):
        assert group_key_lanes([group_key(g, x) for x in h]) == [
            tuple(k) for k in key_lanes(h, g).tolist()
        ]


def test_the_feed_names_every_changed_key_and_a_reader_behind_resyncs() -> None:
    index = PrefixIndex(journal=True)
    feed = IndexFeed(index)
    epoch, since, resync, keys = feed.changes("", 0)
    assert resync and keys == []  # a new reader starts with everything (nothing yet)
    index.add(0, b"a", 1, "pool-1", "m")
    index.add(0, b"b", 2, "pool-1", "m")
    epoch, since2, resync, keys = feed.changes(epoch, since)
    assert not resync and keys == [("m", 0, b"a"), ("m", 0, b"b")]
    index.drop_member("pool-1")
    index.add(1, b"c", 3, "tier-x", "m")
    _, since3, _, keys = feed.changes(epoch, since2)
    assert set(keys) == {("m", 0, b"a"), ("m", 0, b"b"), ("m", 1, b"c")}
    _, _, _, keys = feed.changes(epoch, since3)
    assert keys == []
    # another coordinator (a restart: a new epoch) or a reader past the log: everything
    _, _, resync, keys = feed.changes("another", since3)
    assert resync and keys == [("m", 1, b"c")]
    feed.KEEP = 1
    index.add(1, b"d", 4, "tier-x", "m")
    index.add(1, b"e", 5, "tier-x", "m")
    _, _, resync, keys = feed.changes(epoch, since3)
    assert resync and {k[2] for k in keys} == {b"c", b"d", b"e"}

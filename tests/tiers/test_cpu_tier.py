"""CpuTier: sizing, states, all-or-nothing eviction that spares in-flight blocks, LRU / ARC."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from raykv.errors import ConfigError
from raykv.tiers import ARCPolicy, BlockState, CpuTier, LRUPolicy
from raykv.tiers.cpu_tier import KeyRows

from .helpers import make_plan


def tier(n: int, policy: str = "lru") -> CpuTier:
    return CpuTier(make_plan("full", cpu_blocks=n), policy)


def store(t: CpuTier, *keys: bytes) -> None:
    r = t.prepare_store(keys)
    assert r is not None
    t.finish_store(r, ok=True)


def test_arena_is_sized_by_invariant_5():
    p = make_plan("full", factor=4, tp_size=2, cpu_blocks=10)
    t = CpuTier(p)
    assert t.copies == p.distinct_copies == 2
    assert t.factor == 4
    assert t.total_bytes == p.cpu_num_blocks * p.cpu_bytes_per_block
    assert t.rows(1).shape == (10 * 4, p.gpu_bytes_per_block)
    assert t.arena.is_pinned() == torch.cuda.is_available()  # plain host memory without CUDA
    mla = make_plan("mla", tp_size=2, factor=2, cpu_blocks=3)
    assert CpuTier(mla).copies == 1  # MLA's latent is the same on every rank
    bad = dataclasses.replace(p, cpu_bytes_per_block=p.cpu_bytes_per_block + 1)
    with pytest.raises(ConfigError, match="gpu_bytes_per_block"):
        CpuTier(bad)


def test_store_states_and_lookup():
    t = tier(4)
    r = t.prepare_store([b"a", b"b"])
    assert r.keys == (b"a", b"b") and t.state(b"a") is BlockState.WRITING
    assert t.lookup([b"a"]) == 0  # being written: not readable yet
    assert t.prepare_store([b"a", b"c"]).present == (b"a",)  # no second writer of one key
    t.finish_store(r, ok=True)
    assert t.lookup([b"a", b"b", b"x", b"c"]) == 2  # a prefix hit
    lease = t.prepare_load([b"a"])
    assert t.state(b"a") is BlockState.READING
    second = t.prepare_load([b"a"])
    t.finish_load(lease)
    assert t.state(b"a") is BlockState.READING  # second reader still there
    t.finish_load(lease)  # a lease is finished once: the second reader's stays
    assert t.state(b"a") is BlockState.READING and t.stats.late_finishes == 1
    t.finish_load(second)
    assert t.state(b"a") is BlockState.READABLE
    assert t.prepare_load([b"a", b"zzz"]) is None  # all or nothing
    assert t.state(b"a") is BlockState.READABLE
    t.check_consistency()


def test_leases_read_valid_flags_and_checksums_per_key_and_survive_a_pickle():
    """A lease's ``valid`` / ``checksums`` are arrays (``KeyRows`` / ``KeySums``) that read
    as the tuple per key and dict per key they stand for, whatever widths the keys have."""
    t = CpuTier(make_plan("full", tp_size=2, factor=2, cpu_blocks=4))
    r = t.prepare_store([b"a", b"b"], writers=2)
    t.finish_store(r, True, [(True, True), (True,)], [(1, 2), (3,)], copy=0)
    rows = KeyRows(np.array([[True, True], [True, False]]), np.array([2, 1]))
    t.finish_store(r, True, rows, None, copy=1)  # the second writer stored no checksums
    lease = t.prepare_load([b"b", b"a"])
    assert lease.valid == ((True,), (True, True)) and lease.valid[-1] == (True, True)
    assert lease.checksums == ({0: (3,)}, {0: (1, 2)}) and lease.checksums[1][0][1] == 2
    assert list(lease.valid[:1]) == [(True,)] and len(lease.checksums) == 2
    again = pickle.loads(pickle.dumps(lease))
    assert again == lease and again.checksums[0] == {0: (3,)}
    t.finish_load(again)
    assert t.state(b"a") is BlockState.READABLE
    t.check_consistency()


def test_failed_store_leaves_nothing_readable():
    t = tier(4)
    r = t.prepare_store([b"a", b"b"], writers=2)
    t.finish_store(r, ok=True)  # first TP writer done
    assert t.state(b"a") is BlockState.WRITING
    t.finish_store(r, ok=False)  # second failed: the whole block is void
    assert t.state(b"a") is None and t.num_free == 4
    assert t.stats.failed_stores == 2
    t.check_consistency()


def test_eviction_is_all_or_nothing_and_spares_inflight_blocks():
    t = tier(4)
    store(t, b"a", b"b", b"c", b"d")
    lease = t.prepare_load([b"a", b"b"])  # being read
    writing = t.prepare_store([b"e"])  # evicts c (LRU among evictable), e is being written
    assert writing.evicted == (b"c",)
    before = sorted(t.stored_keys())
    assert t.prepare_store([b"f", b"g"]) is None  # only d is evictable: nothing happens
    assert sorted(t.stored_keys()) == before and t.stats.rejected_stores == 1
    r = t.prepare_store([b"d", b"h"])  # d is one of the store's own keys: never its victim
    assert r is None
    t.finish_load(lease)
    r = t.prepare_store([b"f", b"g"])
    assert set(r.evicted) == {b"a", b"b"}  # LRU order: a, b before d
    assert t.state(b"e") is BlockState.WRITING
    t.check_consistency()


def test_lru_evicts_least_recently_used():
    t = tier(3)
    store(t, b"a", b"b", b"c")
    t.lookup([b"a"])
    assert t.prepare_store([b"d"]).evicted == (b"b",)


def test_arc_resists_a_scan_that_lru_does_not():
    survivors = {}
    for name in ("lru", "arc"):
        t = tier(4, name)
        store(t, b"a", b"b")
        assert t.lookup([b"a", b"b"]) == 2  # used twice: frequent
        for i in range(10):  # a one-pass scan
            r = t.prepare_store([b"scan%d" % i])
            t.finish_store(r, ok=True)
        survivors[name] = {b"a", b"b"} & set(t.stored_keys())
    assert survivors == {"lru": set(), "arc": {b"a", b"b"}}


def test_arc_adapts_its_target_on_ghost_hits():
    arc = ARCPolicy(2)
    for k in ("x", "y"):
        arc.insert(k)
    victims = arc.victims(1, lambda k: True)
    assert victims == ["x"]
    arc.evict("x")  # x now in the B1 ghost list
    assert "x" in arc.b1 and arc.p == 0
    arc.insert("x")  # a miss on a recently evicted T1 key: T1 deserved more room
    assert arc.p > 0 and "x" in arc.t2
    assert arc.victims(5, lambda k: True) is None
    assert len(arc) == 2


def test_policy_victims_skip_what_may_not_go():
    for policy in (LRUPolicy(), ARCPolicy(4)):
        for k in "abcd":
            policy.insert(k)
        assert policy.victims(2, lambda k: k in "bd") == ["b", "d"]
        assert policy.victims(3, lambda k: k in "bd") is None


class TierMachine(RuleBasedStateMachine):
    """Random stores / loads / failures / drops: eviction never touches a block being
    written or read, a refused store changes nothing, metadata stays consistent."""

    def __init__(self):
        super().__init__()
        self.tier = None
        self.writing = []  # reservations in flight
        self.leases = []
        self.n = 0

    @rule(policy=st.sampled_from(["lru", "arc"]), size=st.integers(1, 6))
    @precondition(lambda self: self.tier is None)
    def create(self, policy, size):
        self.tier = tier(size, policy)

    def _keys_of(self, state):
        return {k for k in self.tier.stored_keys() if self.tier.state(k) is state}

    @rule(keys=st.lists(st.integers(0, 12), min_size=1, max_size=4))
    @precondition(lambda self: self.tier is not None)
    def prepare_store(self, keys):
        keys = [b"k%d" % k for k in keys]
        busy = self._keys_of(BlockState.WRITING) | self._keys_of(BlockState.READING)
        before = {k: self.tier.state(k) for k in self.tier.stored_keys()}
        r = self.tier.prepare_store(keys)
        if r is None:
            assert {k: self.tier.state(k) for k in self.tier.stored_keys()} == before
            return
        assert not (set(r.evicted) & (busy | set(keys)))
        assert busy <= set(self.tier.stored_keys())
        self.writing.append(r)

    @rule(data=st.data(), ok=st.booleans())
    @precondition(lambda self: self.writing)
    def finish_store(self, data, ok):
        r = self.writing.pop(data.draw(st.integers(0, len(self.writing) - 1)))
        self.tier.finish_store(r, ok)
        for k in r.keys:
            assert self.tier.state(k) is (BlockState.READABLE if ok else None)

    @rule(keys=st.lists(st.integers(0, 12), min_size=1, max_size=3))
    @precondition(lambda self: self.tier is not None)
    def prepare_load(self, keys):
        lease = self.tier.prepare_load([b"k%d" % k for k in keys])
        if lease is not None:
            self.leases.append(lease)

    @rule(data=st.data())
    @precondition(lambda self: self.leases)
    def finish_load(self, data):
        self.tier.finish_load(self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1))))

    @rule(key=st.integers(0, 12))
    @precondition(lambda self: self.tier is not None)
    def drop(self, key):
        self.tier.drop(b"k%d" % key, corrupt=True)
        assert self.tier.state(b"k%d" % key) in (None, BlockState.WRITING)

    @invariant()
    def consistent(self):
        if self.tier is not None:
            self.tier.check_consistency()
            for lease in self.leases:  # a leased block is never reused under the reader
                for key, i in zip(lease.keys, lease.blocks, strict=True):
                    b = self.tier._blocks[i]
                    assert b.state is BlockState.READING
                    assert b.key == key or b.dropped


TierMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
test_tier_state_machine = TierMachine.TestCase

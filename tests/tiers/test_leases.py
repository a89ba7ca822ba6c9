"""CPU-tier leases and reservations end: at their deadline or with their holder. Reclaimed
entries can be evicted; a late finish changes nothing; a late reader or writer of reclaimed,
reused entries is told so (generations): a miss, never wrong KV, never a double release."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from raykv import ops
from raykv.errors import ConfigError
from raykv.tiers import CpuTier, GpuKV, LoadJob, OffloadEngine, StoreJob, shm
from raykv.tiers.cpu_tier import BlockState, CpuTierView
from raykv.tiers.holds import Holds, check_timeout
from raykv.tiers.jobs import group_block_hashes

from .helpers import filled_kv, make_plan

T = 10.0  # the lease timeout of these tests' tiers


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tier(n: int, clock: Clock, shared: bool = False) -> CpuTier:
    return CpuTier(make_plan("full", cpu_blocks=n), lease_timeout_s=T, clock=clock, shared=shared)


def store(t: CpuTier, *keys: bytes, holder: str = "w") -> None:
    r = t.prepare_store(keys, holder=holder)
    t.finish_store(r, ok=True)


def snapshot(t: CpuTier) -> tuple:
    """Everything a late finish must leave alone (all but the late-finish counter)."""
    stats = dataclasses.replace(t.stats, late_finishes=0)
    blocks = tuple(
        (b.key, b.state, b.readers, b.writers, b.failed, b.dropped, b.valid) for b in t._blocks
    )
    return (blocks, sorted(t._free), dict(t._by_key), t.gens.tolist(), list(t.policy), stats,
            sorted((h.id, h.kind, h.holder, tuple(h.blocks)) for h in t._holds))  # fmt: skip


# --- regressions -----------------------------------------------------------------------


def test_a_worker_that_leases_then_dies_pins_nothing_after_the_deadline() -> None:
    clock = Clock()
    t = tier(4, clock)
    store(t, b"a", b"b", b"c", b"d")
    assert t.prepare_load([b"a", b"b", b"c", b"d"], holder="worker") is not None
    # the worker dies without finish_load: until the deadline its entries stay pinned
    clock.now = T - 0.5
    assert t.prepare_store([b"e"]) is None and t.stats.rejected_stores == 1
    clock.now = T + 0.5  # past it: the next store reclaims the lease, then evicts
    r = t.prepare_store([b"e"])
    assert r is not None and r.evicted == (b"a",)
    assert t.stats.expired_leases == 1 and t.num_holds == 1  # the store's own reservation
    t.check_consistency()


def test_release_holder_frees_its_leases_and_reservations_at_once() -> None:
    clock = Clock()
    t = tier(4, clock)
    store(t, b"a", b"b")
    t.prepare_load([b"a"], holder="engine")
    res = t.prepare_store([b"x", b"y"], holder="engine")
    t.prepare_load([b"b"], holder="other")
    assert sorted(t.holders()) == ["engine", "other"]
    assert t.release_holder("engine") == 2
    assert t.state(b"a") is BlockState.READABLE and t.state(b"x") is None
    assert t.num_free == 2 and t.stats.released_holds == 2
    assert t.state(b"b") is BlockState.READING  # another holder's lease stays
    before = snapshot(t)
    t.finish_store(res, ok=True)  # the engine was not dead after all: too late
    assert snapshot(t) == before and t.stats.late_finishes == 1
    t.check_consistency()


def _jobs(plan, n: int, seed: int) -> tuple[StoreJob, list[int]]:
    table = [list(range(1, n + 1))]
    keys = group_block_hashes(plan, [bytes([seed, i]) * 16 for i in range(n)])
    return StoreJob.build(plan, "r", table, keys), table[0]


def _load(job: StoreJob, lease, into: list[int]) -> LoadJob:
    return LoadJob("r", lease.keys, job.key_groups, job.key_widths, tuple(into),
                   job.group_sizes, job.slots)  # fmt: skip


def test_a_late_finish_load_after_expiry_is_a_miss_and_changes_nothing() -> None:
    """A reader stalls past its lease's deadline; meanwhile the entries are evicted and the
    blocks rewritten with other KV. Its load reports a miss (never that KV as data), its
    finish_load is ignored (no block released twice) and its checksum failures drop
    nothing of the new entries."""
    clock = Clock()
    plan = make_plan("full", cpu_blocks=4)
    owner = tier(4, clock, shared=True)
    view = CpuTierView(plan, owner.arena_spec)
    old, _ = _jobs(plan, 4, 1)
    eng = OffloadEngine(filled_kv(plan, 1), view, checksums=True)
    eng.submit_store(old, owner.prepare_store(old.keys, holder="pool"))
    eng.wait_all()
    owner.apply(view.take())
    lease = owner.prepare_load(old.keys, holder="engine")  # the engine then stalls
    clock.now = T + 1
    assert owner.reclaim() == 1 and owner.stats.expired_leases == 1
    new, _ = _jobs(plan, 4, 2)  # every block evicted and rewritten: same rows, other KV
    eng.submit_store(new, owner.prepare_store(new.keys, holder="pool"))
    eng.wait_all()
    owner.apply(view.take())
    assert sorted(owner.prepare_load(new.keys).blocks) == sorted(lease.blocks)
    before = snapshot(owner)
    dst = GpuKV.allocate(plan, "cpu")
    late = OffloadEngine(dst, view, checksums=True)
    late.submit_load(_load(old, lease, [5, 6, 7, 8]), lease)
    (res,) = late.wait_all()
    assert not res.ok and "reclaimed" in res.error  # a miss: nothing counts as loaded
    owner.apply(view.take())
    assert snapshot(owner) == before and owner.stats.late_finishes == 1
    assert owner.stats.checksum_errors == 0 and all(k in owner for k in new.keys)
    owner.check_consistency()
    shm.release(owner.arena_spec)


def test_a_late_store_apply_after_expiry_is_never_made_readable() -> None:
    """A writer's reservation expires before it copies; its blocks go to another store of
    the same keys. The late writer copies nothing (its generation changed), and its
    finish changes nothing: the other writer's KV is what a load gets."""
    clock = Clock()
    plan = make_plan("full", cpu_blocks=4)
    owner = tier(4, clock, shared=True)
    view = CpuTierView(plan, owner.arena_spec)
    job, ids = _jobs(plan, 3, 1)
    stale = owner.prepare_store(job.keys, holder="dead engine")
    clock.now = T + 1
    fresh = owner.prepare_store(job.keys, holder="engine")  # reclaims first, then reserves
    assert owner.stats.expired_reservations == 1 and fresh.keys == job.keys
    assert sorted(fresh.blocks) == sorted(stale.blocks) and fresh.gens != stale.gens
    src = filled_kv(plan, 7)
    good = OffloadEngine(src, view, checksums=True)
    good.submit_store(job, fresh)
    good.wait_all()
    owner.apply(view.take())
    before = snapshot(owner)
    late = OffloadEngine(filled_kv(plan, 8), view, checksums=True)  # other bytes, same keys
    late.submit_store(job, stale)
    (res,) = late.wait_all()
    assert not res.ok and "reclaimed" in res.error
    owner.apply(view.take())
    assert snapshot(owner) == before and owner.stats.late_finishes == 1
    lease = owner.prepare_load(job.keys)
    dst = GpuKV.allocate(plan, "cpu")
    reader = OffloadEngine(dst, view, checksums=True)
    reader.submit_load(_load(job, lease, ids), lease)
    (res,) = reader.wait_all()
    assert res.ok and res.missed == ()
    gid = plan.groups[0].group_id
    got, want = (torch.empty((len(ids), src.row_bytes(gid)), dtype=torch.uint8) for _ in "ab")
    ops.gather_blocks(dst.entries(gid), torch.tensor(ids), got)
    ops.gather_blocks(src.entries(gid), torch.tensor(ids), want)
    assert torch.equal(got, want)  # the fresh writer's KV, not the late one's
    owner.apply(view.take())
    owner.check_consistency()
    shm.release(owner.arena_spec)


def test_a_late_finish_store_of_one_tp_writer_does_not_complete_the_entry() -> None:
    clock = Clock()
    t = tier(4, clock)
    res = t.prepare_store([b"a"], writers=2, holder="pool")
    t.finish_store(res, ok=True)  # rank 0 done, rank 1 stalls
    clock.now = T + 1
    assert t.reclaim() == 1 and t.state(b"a") is None
    t.finish_store(res, ok=True)
    assert t.state(b"a") is None and t.stats.stored == 0 and t.stats.late_finishes == 1
    t.check_consistency()


def test_current_sees_every_block_freed_since_the_hold_was_taken() -> None:
    """``current`` answers at once while the tier freed nothing since a hold was taken (its
    release count unchanged), else block by block: a hold any of whose blocks was freed
    (reclaimed, dropped, reused) is never current, on the owner or on a view; one whose
    blocks all stayed is current, whatever other blocks were freed meanwhile."""
    clock = Clock()
    plan = make_plan("full", cpu_blocks=4)
    t = tier(4, clock, shared=True)
    view = CpuTierView(plan, t.arena_spec)
    store(t, b"a", b"b")
    lease = t.prepare_load([b"a"], holder="reader")
    res = t.prepare_store([b"c"], holder="writer")
    assert all(x.current(h) for x in (t, view) for h in (lease, res))
    t.drop(b"b")  # another block freed: the count moved, the holds' blocks did not
    assert int(view.releases[0]) == lease.releases + 1 == res.releases + 1
    assert all(x.current(h) for x in (t, view) for h in (lease, res))
    clock.now = T + 1
    assert t.reclaim() == 2  # the lease's reference goes (a stays), c's block is freed
    assert t.current(lease) and view.current(lease)  # its rows still hold a's bytes
    assert not t.current(res) and not view.current(res)
    t.drop(b"a")  # now a's block is freed too
    assert not t.current(lease) and not view.current(lease)
    again = t.prepare_store([b"d", b"e", b"f", b"g"], holder="writer")  # every block, reused
    assert set(lease.blocks + res.blocks) <= set(again.blocks)
    for held in (lease, res):  # also without the count: the generations alone
        assert not t.current(held) and not t.current(dataclasses.replace(held, releases=-1))
    assert t.current(again) and view.current(dataclasses.replace(again, releases=-1))
    view.close()
    t.release()


def test_the_lease_timeout_is_checked() -> None:
    assert check_timeout("2.5") == 2.5
    for bad in (0, -1, "soon", float("inf"), float("nan"), None):
        with pytest.raises(ConfigError, match="positive number of seconds"):
            check_timeout(bad, "RAYKV_LEASE_TIMEOUT_S")
    with pytest.raises(ConfigError, match="RAYKV_LEASE_TIMEOUT_S"):
        check_timeout("x", "RAYKV_LEASE_TIMEOUT_S")


def test_finished_holds_do_not_pile_up_in_the_deadline_heap() -> None:
    holds = Holds(T)
    keep = holds.open("load", "a", [0], 0.0, None)
    for i in range(1000):  # finished out of order: the oldest (keep) stays live
        holds.close(holds.open("load", "b", [1], float(i), None))
    assert len(holds) == 1 and len(holds._due) <= 65
    assert holds.due(T + 1) == [keep]


# --- the invariant, under any interleaving ------------------------------------------------


@dataclasses.dataclass
class _Held:
    kind: str
    obj: object  # the LoadLease / StoreReservation
    holder: str
    deadline: float
    writers: int = 1
    live: bool = True


def _pattern(key: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(key.ljust(8, b".")[:8]), dtype=torch.uint8)


class LeaseMachine(RuleBasedStateMachine):
    """Leases, reservations, finishes (in time or late), reads, writes, drops, evictions,
    sweeps and holders going away, in any order. Invariants: a block is in one writer's
    hands or in readers' hands, never both and never two writers'; free + writing +
    readable + reading == the arena; the tier's holds are exactly the model's live ones; a
    finish after its hold ended changes nothing; a reader whose blocks are still current
    reads its keys' bytes (a writer writes only while its blocks are current)."""

    HOLDERS = ("a", "b", "c")

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.held: list[_Held] = []

    @initialize(size=st.integers(1, 5))
    def create(self, size):
        self.t = tier(size, self.clock)

    def _expire(self, now: float, limit: int | None = None) -> None:
        due = sorted(
            (h for h in self.held if h.live and h.deadline <= now and h.obj.blocks),
            key=lambda h: (h.deadline, h.obj.hold),
        )
        for h in due[:limit]:
            h.live = False

    def _row(self, block: int) -> torch.Tensor:
        return self.t.rows(0)[self.t.row(block, 0), :8]

    @rule(keys=st.lists(st.integers(0, 5), min_size=1, max_size=3),
          holder=st.sampled_from(HOLDERS), writers=st.integers(1, 2))  # fmt: skip
    def reserve(self, keys, holder, writers):
        self._expire(self.clock.now)  # prepare_store reclaims what is due first
        r = self.t.prepare_store([b"k%d" % k for k in keys], writers, holder=holder)
        if r is not None and r.blocks:
            self.held.append(_Held("store", r, holder, self.clock.now + T, writers))

    @rule(keys=st.lists(st.integers(0, 5), min_size=1, max_size=3),
          holder=st.sampled_from(HOLDERS))  # fmt: skip
    def lease(self, keys, holder):
        lease = self.t.prepare_load([b"k%d" % k for k in keys], holder=holder)
        if lease is not None:
            self.held.append(_Held("load", lease, holder, self.clock.now + T))

    def _finish(self, h: _Held, call) -> None:
        if h.live:
            call()
            return
        before, late = snapshot(self.t), self.t.stats.late_finishes
        call()
        assert snapshot(self.t) == before and self.t.stats.late_finishes == late + 1

    @rule(data=st.data(), ok=st.booleans())
    @precondition(lambda self: any(h.kind == "store" for h in self.held))
    def write_and_finish_store(self, data, ok):
        h = data.draw(st.sampled_from([h for h in self.held if h.kind == "store"]))
        r = h.obj
        if self.t.current(r):  # the engine's check before it copies
            for k, b in zip(r.keys, r.blocks, strict=True):
                self._row(b).copy_(_pattern(k))
        else:
            assert not h.live
        live = h.live
        self._finish(h, lambda: self.t.finish_store(r, ok))
        if live:
            h.writers -= 1
            h.live = h.writers > 0

    @rule(data=st.data())
    @precondition(lambda self: any(h.kind == "load" for h in self.held))
    def read_and_finish_load(self, data):
        h = data.draw(st.sampled_from([h for h in self.held if h.kind == "load"]))
        lease = h.obj
        got = [self._row(b).clone() for b in lease.blocks]
        if self.t.current(lease):  # the reader's check after its copy: then it is the KV
            for k, row in zip(lease.keys, got, strict=True):
                assert torch.equal(row, _pattern(k)), (k, bytes(row.tolist()))
        # a reader that found its rows corrupt reports it with its finish, in one batch
        ops = [("drop", k, True) for k in lease.keys] if not h.live else []
        self._finish(h, lambda: self.t.apply([*ops, ("finish_load", lease, 0)]))
        h.live = False

    @rule(key=st.integers(0, 5))
    def drop(self, key):
        self.t.drop(b"k%d" % key)

    @rule(dt=st.floats(0.5, 2 * T))
    def advance(self, dt):
        self.clock.now += dt

    @rule(limit=st.one_of(st.none(), st.integers(1, 3)))
    def sweep(self, limit):
        want = sum(h.live for h in self.held)
        self._expire(self.clock.now, limit)
        assert self.t.reclaim(limit=limit) == want - sum(h.live for h in self.held)

    @rule(holder=st.sampled_from(HOLDERS))
    def holder_gone(self, holder):
        mine = [h for h in self.held if h.live and h.holder == holder]
        assert self.t.release_holder(holder) == len(mine)
        for h in mine:
            h.live = False

    @invariant()
    def one_pair_of_hands_and_nothing_lost(self):
        t = self.t
        t.check_consistency()  # holds <-> block states: readers, one reservation per block
        live = [h for h in self.held if h.live]
        assert t.num_holds == len(live)
        writing = [b for h in live if h.kind == "store" for b in t._holds.get(h.obj.hold,
                   "store").blocks]  # fmt: skip
        reading = {b for h in live if h.kind == "load" for b in h.obj.blocks}
        assert len(writing) == len(set(writing)) and not set(writing) & reading
        for h in live:  # a live hold's blocks were never freed under it
            assert t.current(h.obj)
        c = t.counts()
        assert c["free"] == t.num_free
        assert c["free"] + c["writing"] + c["readable"] + c["reading"] == t.num_blocks
        assert c["writing"] == len(writing)


LeaseMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_lease_machine = LeaseMachine.TestCase


# --- rows used in place by a transport --------------------------------------------------


def test_hold_left_counts_down_to_the_deadline_and_is_zero_once_finished() -> None:
    """A transport receives into reserved rows (or sends from leased ones) only while the
    hold outlasts it: ``hold_left`` is what it asks."""
    clock = Clock()
    t = tier(4, clock)
    r = t.prepare_store([b"a", b"b"])
    clock.now = 3.0
    assert t.hold_left(r) == pytest.approx(T - 3.0)
    t.finish_store(r, ok=True)
    assert t.hold_left(r) == 0.0
    lease = t.prepare_load([b"a"])
    assert t.hold_left(lease) == pytest.approx(T)
    clock.now = 3.0 + T + 1
    t.reclaim()
    assert t.hold_left(lease) == 0.0  # reclaimed: nothing left to use
    t.finish_load(lease)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.integers(-1, 12), max_size=8),
    narrower=st.booleans(),
    copy=st.integers(0, 1),
)
def test_run_view_covers_exactly_the_rows_named_or_none(rows, narrower, copy) -> None:
    """``run_view`` (what a transport sends from or receives into in place) is a view of
    exactly the named arena rows, in order, or None: never a byte of a row not named."""
    t = CpuTier(make_plan("full", tp_size=2, cpu_blocks=6, factor=2))
    n, row = t.arena.shape[1], t.arena.shape[2]
    assert n == 12 and t.copies == 2
    view = t.run_view(rows, row - 8 if narrower else row, copy)
    run = bool(rows) and rows[0] >= 0 and rows == list(range(rows[0], rows[0] + len(rows)))
    if not run or rows[-1] >= n or narrower:
        assert view is None
        return
    assert view is not None and view.shape == (len(rows), row) and view.is_contiguous()
    assert view.data_ptr() == t.arena[copy, rows[0]].data_ptr()

"""OffloadEngine: runs StoreJobs (GPU -> CPU tier) and LoadJobs (CPU tier -> GPU) of one rank.

Every byte moves through ``raykv.ops.gather_blocks`` / ``scatter_blocks``: straight into (or
out of) the arena's rows when a group's rows are full-width and consecutive, else through a
staging buffer and one host-side row copy. On CUDA the copies run on a side stream that first
waits for the compute stream, and ``poll()`` reports jobs whose event has fired; on CPU they
run synchronously and the next ``poll()`` reports them, so callers see one protocol. A job
copies each run of consecutive arena rows directly, each row's checksum taken by the copy
itself as it moves the row (``raykv.tiers.job_copy``): on CUDA
by the copy kernels, only the sums crossing to the host; on the host by the native fused copy
(``raykv.ops.reference``), every byte read once.

Store: reserve CPU blocks (all-or-nothing) -> fence the GPU blocks (invariant 9) -> gather ->
on completion checksum the rows (optional), mark the CPU blocks readable and lift the fence.
A failure anywhere frees the reserved CPU blocks (nothing half-readable) and lifts the fence.
Load: take read references -> drop keys whose CPU block lacks a needed GPU block, keeping each
group's prefix -> scatter, each row's sum taken as it is written, compared with the stored
checksums when the copy completed. The first key that fails and the rest of its group are
misses (never reported loaded, so never read, whatever bytes landed in their blocks), the
failed one a counted error, never wrong KV -> on completion drop the references.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raykv import ops
from raykv.errors import TierError
from raykv.layout import tp
from raykv.tiers import job_copy
from raykv.tiers.cpu_tier import (
    CpuTier,
    KeyRows,
    KeySums,
    LoadLease,
    StoreReservation,
    int_array,
)
from raykv.tiers.fence import StoreFence
from raykv.tiers.gpu_kv import GpuKV
from raykv.tiers.jobs import BlockJob, LoadJob, StoreJob

_RECLAIMED = (
    "the CPU tier reclaimed this job's lease or reservation (its deadline passed or its "
    "holder was released): not copied, a miss; finish jobs within the tier's lease timeout "
    "(RAYKV_LEASE_TIMEOUT_S)"
)


@dataclass(frozen=True)
class JobResult:
    job_id: int
    kind: str  # "store" or "load"
    request_id: str
    ok: bool
    job: BlockJob  # what was actually carried (keys already stored / missed left out)
    missed: tuple[bytes, ...] = ()  # load: requested keys not loaded
    error: str | None = None


@dataclass
class _HostCopy:
    """Rows to move between a staging buffer and the arena on the host side."""

    rows: torch.Tensor  # int64 arena row indices
    staging: torch.Tensor  # [n, width] uint8
    width: int


@dataclass
class _InFlight:
    job_id: int
    kind: str
    job: BlockJob
    reservation: StoreReservation | None = None
    lease: LoadLease | None = None
    event: torch.cuda.Event | None = None
    host_copies: list[_HostCopy] = field(default_factory=list)
    taken: list[job_copy.TakenSums] = field(default_factory=list)  # a store's row sums
    checks: list[job_copy.LoadCheck] = field(default_factory=list)  # a load's
    asked: tuple[bytes, ...] = ()  # a load: the keys requested
    missed: tuple[bytes, ...] = ()
    error: str | None = None
    writes: bool = True  # False: a replica rank, another rank writes this copy
    entry: np.ndarray | None = None  # each key's index in the reservation / lease (``_copy``)


class OffloadEngine:
    def __init__(
        self,
        gpu: GpuKV,
        tier: CpuTier,
        *,
        rank: int = 0,
        checksums: bool = False,
        fence: StoreFence | None = None,
    ) -> None:
        plan = gpu.plan
        if not 0 <= rank < plan.tp_size:
            raise ValueError(f"rank {rank} is outside tp_size={plan.tp_size}")
        self.gpu, self.tier, self.rank = gpu, tier, rank
        self.checksums = checksums
        self.fence = fence or StoreFence()
        # Ranks holding the same bytes (replicated heads, MLA) share one copy; its first
        # rank writes it, every rank reads it.
        self.copy = tp.copy_of_rank(rank, plan.tp_size, tier.copies)
        self.writes = tp.writes(rank, plan.tp_size, tier.copies)
        self.stream = torch.cuda.Stream(gpu.device) if gpu.device.type == "cuda" else None
        self.pin = tier.arena.is_pinned()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._inflight: dict[int, _InFlight] = {}
        self._by_request: dict[str, set[int]] = defaultdict(set)
        self._done: list[JobResult] = []

    # ---------------------------------------------------------------- public
    def submit_store(
        self, job: StoreJob, reservation: StoreReservation | None = None
    ) -> int | None:
        """Start a store; None when the CPU tier has no room (nothing changed).

        ``reservation`` comes from a caller that reserved for several TP writers
        (``tier.prepare_store(keys, writers=tier.copies)``); else this engine reserves.
        """
        if reservation is None:
            reservation = self.tier.prepare_store(job.keys, writers=1)
            if reservation is None:
                return None
        run = job.select(reservation.keys)
        rec = _InFlight(self._next_id(), "store", run, reservation=reservation)
        rec.writes = self.writes
        if rec.writes:
            try:
                self.fence.fence(rec.job_id, run.block_ids)
            except Exception:
                self.tier.finish_store(reservation, ok=False)  # nothing half-reserved
                raise
            try:
                self._copy(rec, gather=True)
            except Exception as e:  # finish in poll(): frees the CPU blocks, lifts the fence
                rec.error = f"{type(e).__name__}: {e}"
        self._track(rec)  # only now may poll() (from any thread) see it
        return rec.job_id

    def submit_load(self, job: LoadJob, lease: LoadLease | None = None) -> int | None:
        """Start a load; None when a key is no longer readable (nothing changed).

        ``lease`` comes from a caller that took the read references itself (a
        ``CpuTierView``'s owner); else this engine takes them. Either way every key's
        checksums are verified before it counts as loaded (invariant 12): the copy sums each
        row as it writes it (the CUDA kernels; natively on the host), compared in poll()
        (``_check_loaded``)."""
        if lease is None:
            lease = self.tier.prepare_load(job.keys)
        if lease is None:
            return None
        usable = job.select(self._usable_keys(job, lease))
        rec = _InFlight(self._next_id(), "load", usable, lease=lease)
        try:
            self._copy(rec, gather=False)  # poll() keeps in rec.job the keys verified whole
        except Exception as e:
            rec.error = f"{type(e).__name__}: {e}"
        rec.asked = job.keys
        self._track(rec)
        return rec.job_id

    def poll(self) -> list[JobResult]:
        """Finish every job whose copy completed; returns their results (once each)."""
        with self._lock:
            ready = [r for r in self._inflight.values() if self._ready(r)]
            for r in ready:
                del self._inflight[r.job_id]
        for r in ready:
            self._finish(r)
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, job_id: int) -> list[JobResult]:
        """Wait for job ``job_id``'s copy (jobs submitted after it may still run), then
        ``poll``."""
        with self._lock:
            rec = self._inflight.get(job_id)
        if rec is not None and rec.event is not None and rec.error is None:
            with contextlib.suppress(Exception):  # a CUDA error: ``_ready`` records it
                rec.event.synchronize()
        return self.poll()

    def wait_all(self) -> list[JobResult]:
        if self.stream is not None:
            self.stream.synchronize()
        return self.poll()

    def join(self) -> None:
        """Make the current (compute) stream wait for every copy submitted so far, e.g.
        before attention reads blocks a load is filling. No-op on CPU."""
        if self.stream is not None:
            torch.cuda.current_stream(self.gpu.device).wait_stream(self.stream)

    def in_flight(self, request_id: str | None = None) -> tuple[int, ...]:
        with self._lock:
            if request_id is None:
                return tuple(self._inflight)
            return tuple(sorted(self._by_request.get(request_id, ())))

    # ---------------------------------------------------------------- copies
    def _copy(self, rec: _InFlight, gather: bool) -> None:
        job, tier = rec.job, self.tier
        if not tier.current(rec.reservation if gather else rec.lease):
            raise TierError(_RECLAIMED)
        held = rec.reservation if gather else rec.lease
        # each position's arena row, for the whole job at once (numpy, not a step per block)
        rec.entry = _index_in(held.keys, job.keys)
        a = job.arrays
        rows_of = tier.row(held.block_array[rec.entry][a.keys], a.subs)
        if self.stream is not None:  # copies see every KV write queued before them
            self.stream.wait_stream(torch.cuda.current_stream(self.gpu.device))
        stream_ctx = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        with stream_ctx:
            for g, sl in zip(self.gpu.plan.groups, job.group_slices(), strict=True):
                if sl.start == sl.stop:  # no block of this group
                    continue
                entries = self.gpu.entries(g.group_id)
                width = ops.row_bytes(entries)
                rows = rows_of[sl]
                ids_t = torch.from_numpy(a.ids[sl])
                # a load is checked in poll(), once it landed
                self._copy_rows(rec, entries, ids_t, rows, sl, width, gather)
            if self.stream is not None:
                rec.event = torch.cuda.Event()
                rec.event.record(self.stream)

    def _copy_rows(
        self,
        rec: _InFlight,
        entries: list,
        ids_t: torch.Tensor,
        rows: np.ndarray,
        at: slice,
        width: int,
        gather: bool,
    ) -> None:
        """One group's copy (on CUDA queued on the side stream; on the host run now), each
        row's checksum taken as it is copied (``raykv.tiers.job_copy``): each run of
        consecutive full-width arena rows straight between the blocks and the arena; rows
        more scattered (or narrower) through a staging buffer (a store lands it in poll(), a
        load keeps it alive till then). A load's sums are compared with the stored ones in
        poll()."""
        rows_all = self.tier.rows(self.copy)
        runs = job_copy.row_runs(rows) if width == self.tier.slot_bytes else None
        if runs is not None:
            g = job_copy.GroupRows(entries, ids_t, rows_all, rows, runs)
        else:  # through a staging buffer
            idx = torch.from_numpy(rows)
            src = torch.empty((len(rows), width), dtype=torch.uint8, pin_memory=self.pin)
            rec.host_copies.append(_HostCopy(idx, src, width))
            if not gather:
                torch.index_select(rows_all[:, :width], 0, idx, out=src)
            g = job_copy.GroupRows(entries, ids_t, src, range(len(rows)), [(0, len(rows))])
        sums = job_copy.copy_rows(g, gather, self.checksums)
        if sums is None:
            return
        a = rec.job.arrays
        if gather:
            rec.taken.append(job_copy.TakenSums(a.keys[at], a.subs[at], sums))
        else:  # the expected sums are looked up while the copy runs
            rec.checks.append(self._load_check(rec, at, sums))

    def _ready(self, rec: _InFlight) -> bool:
        if rec.event is None or rec.error is not None:
            return True
        try:
            return rec.event.query()
        except Exception as e:  # an asynchronous CUDA error surfaces here
            rec.error = f"{type(e).__name__}: {e}"
            return True

    def _finish(self, rec: _InFlight) -> None:
        ok = rec.error is None
        if ok and not self.tier.current(rec.reservation or rec.lease):  # a store lands after
            rec.error, ok = _RECLAIMED, False  # this, a load's bytes were copied before it
        if not ok and self.stream is not None:
            self.stream.synchronize()  # copies launched before the failure must not outlive it
        if rec.kind == "store":
            if rec.writes:
                checksums = None
                try:
                    if ok:
                        self._land_store(rec)
                        checksums = self._store_checksums(rec) if self.checksums else None
                except Exception as e:
                    rec.error, ok = f"{type(e).__name__}: {e}", False
                valid = KeyRows(rec.job.valid_array(), rec.job.arrays.widths)
                self.tier.finish_store(rec.reservation, ok, valid, checksums, copy=self.copy)
                self.fence.release(rec.job_id)
        else:
            if ok:
                self._check_loaded(rec)
            if rec.job.keys != rec.asked:  # some keys not carried (else: all loaded or none)
                carried = set(rec.job.keys)
                rec.missed = tuple(k for k in rec.asked if k not in carried)
            self.tier.finish_load(rec.lease, loaded=len(rec.job.keys) if ok else 0)
        with self._lock:
            ids = self._by_request.get(rec.job.request_id)
            if ids is not None:
                ids.discard(rec.job_id)
                if not ids:
                    del self._by_request[rec.job.request_id]
            self._done.append(
                JobResult(
                    rec.job_id, rec.kind, rec.job.request_id, ok, rec.job, rec.missed, rec.error
                )
            )

    def _land_store(self, rec: _InFlight) -> None:
        rows_all = self.tier.rows(self.copy)
        for hc in rec.host_copies:
            rows_all[:, : hc.width].index_copy_(0, hc.rows, hc.staging)
        rec.host_copies.clear()

    # ---------------------------------------------------------------- checksums
    def _store_checksums(self, rec: _InFlight) -> Sequence[tuple[int, ...]]:
        """Per key, one checksum per sub-slot (0 where a null block carried nothing): the
        sums the copy took of every position of every group (``rec.taken``)."""
        job = rec.job
        by_key = np.zeros((len(job.keys), max(job.key_widths, default=0)), np.int64)
        for t in rec.taken:
            t.fill(by_key)
        return KeyRows(by_key, job.arrays.widths)

    def _usable_keys(self, job: LoadJob, lease: LoadLease) -> Sequence[bytes]:
        """Keys whose CPU block holds every GPU block the job needs; per group, only the
        prefix before the first unusable key (KV is a prefix). Their checksums are verified
        once they are copied (``_check_loaded``)."""
        a, valid = job.arrays, KeyRows.of(lease.valid, bool)
        entry = _index_in(lease.keys, job.keys)[a.keys]  # each position's key in the lease
        ok = a.subs < valid.lengths[entry]
        ok[ok] = valid.values[entry[ok], a.subs[ok]]
        if ok.all():
            return job.keys  # the usual load: every key (``select`` keeps the job as it is)
        # a null GPU block at store time: nothing to load, a plain miss
        bad = set(a.keys[~ok].tolist())
        keep, stopped = [], set()
        for k, key in enumerate(job.keys):
            g = job.key_groups[k]
            if k in bad:
                stopped.add(g)
            elif g not in stopped:
                keep.append(key)
        return keep

    def _check_loaded(self, rec: _InFlight) -> None:
        """A load landed: the first key of each group whose rows' sums (taken by the copy as
        it wrote them) differ from the stored checksums is dropped as corrupt, and it and
        every later key of its group count as not loaded (invariant 12)."""
        refused: set[bytes] = set()
        for check in rec.checks:
            bad = check.first_bad()
            if bad is not None:
                self.tier.drop(check.keys[bad], corrupt=True)
                refused.update(check.keys[bad:])
        if refused:
            rec.job = rec.job.select(k for k in rec.job.keys if k not in refused)

    def _load_check(self, rec: _InFlight, at: slice, sums: torch.Tensor) -> job_copy.LoadCheck:
        """The check of one group's load (positions ``at`` of the job, ``sums`` the copy
        takes): each row's stored checksum, from the lease's arrays."""
        job, stored = rec.job, rec.lease.checksums
        assert isinstance(stored, KeySums)  # a tier's lease (prepare_load) carries its arrays
        a = job.arrays
        entry, subs = rec.entry[a.keys[at]], a.subs[at]
        n = stored.lengths[self.copy, entry]
        if ((n >= 0) & (subs >= n)).any():
            raise IndexError("a key's stored checksums cover fewer sub-slots than it carries")
        known = n >= 0
        expected = np.where(known, stored.sums[self.copy, entry, np.where(known, subs, 0)], 0)
        return job_copy.LoadCheck(_KeyAt(job.keys, a.keys[at]), expected, known, sums)

    # ---------------------------------------------------------------- bookkeeping
    def _next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def _track(self, rec: _InFlight) -> None:
        with self._lock:
            self._inflight[rec.job_id] = rec
            self._by_request[rec.job.request_id].add(rec.job_id)


def _index_in(keys: tuple[bytes, ...], wanted: tuple[bytes, ...]) -> np.ndarray:
    """The index in ``keys`` of each of ``wanted`` (the last, for a repeated key)."""
    if keys == wanted:  # the usual job: its reservation's / lease's own keys, in order
        return np.arange(len(keys), dtype=np.int64)
    at = dict(zip(keys, range(len(keys)), strict=True))
    return int_array(map(at.__getitem__, wanted), len(wanted))


class _KeyAt(Sequence[bytes]):
    """Each position's key (``keys[index[i]]``), looked up only when read: a load's check
    reads them only where a row failed."""

    def __init__(self, keys: tuple[bytes, ...], index: np.ndarray) -> None:
        self.keys, self.index = keys, index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int | slice) -> Any:  # a key; a slice: a list of them
        if isinstance(i, slice):
            return [self.keys[k] for k in self.index[i].tolist()]
        return self.keys[self.index[i]]

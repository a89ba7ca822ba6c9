"""CpuTier: one host arena per node, blocks keyed by block hash, with per-block state.

Sizing (invariant 5): ``plan.cpu_num_blocks`` blocks of ``plan.cpu_bytes_per_block`` bytes;
one CPU block holds ``block_size_factor`` GPU blocks of ``gpu_bytes_per_block`` bytes for
each distinct copy across the TP group (``copies = cpu_bytes_per_block / (gpu_bytes_per_block
x block_size_factor)``: tp_size, fewer when KV heads are replicated, 1 for MLA). The arena is
laid out copy-major, ``[copies, cpu_num_blocks * block_size_factor, gpu_bytes_per_block]``, so
that each rank sees its slices of all blocks as one uniform row array (``rows(copy)``); row
``block * block_size_factor + sub`` holds GPU block ``sub`` of CPU block ``block``.

State machine of a block: FREE -> WRITING (prepare_store) -> READABLE (every writer finished)
or FREE (a writer failed: nothing half-readable); READABLE <-> READING (prepare_load /
finish_load, with a reader count). Only READABLE blocks without readers may be evicted, and
never the keys of the store being prepared. One lock guards all metadata; the byte copies run
outside it, protected by the states.

Every reservation and lease is a hold (``raykv.tiers.holds``) with a holder and a deadline
(``lease_timeout_s``, 60 s by default): ``reclaim`` (also run lazily by each ``prepare_store``)
frees the blocks of reservations past their deadline and drops the read references of such
leases, ``release_holder`` does the same at once for a holder that is gone. A finish that
comes after its hold was reclaimed changes nothing (``stats.late_finishes``): no block is
released twice, no reclaimed reservation is made readable. Each block has a generation,
bumped whenever it goes back to FREE, and the tier counts the releases (``releases``: one
more for every batch of blocks freed); a lease or reservation carries its blocks'
generations and that count, and ``current`` (on the owner and on every ``CpuTierView``,
through a shared array) tells whether they still hold what they held when it was taken: at
once while the count is unchanged (nothing was freed since), else block by block. A reader
checks it after copying, so a late load of reclaimed, reused entries is a miss, never wrong
KV.

The blocks' metadata are arrays, one entry per block (state, readers, writers, the failed
and dropped flags, key, valid sub-slots and checksums), so that a job moves its thousands of
blocks from state to state in a few numpy operations instead of touching a Python object
per block (a CUDA engine's 1 GiB store and load of 2048 keys spent 12-18 ms each in such
per-key bookkeeping beside a 19.6 ms copy on the H200 host; issue 45). Valid flags and
checksums cross the tier's API as ``KeyRows`` / ``KeySums``: arrays that read as the tuple
(dict) per key they stand for.

Each held block also records its tenant (the ``tenant_key`` of the store that created it) and
the tier counts each tenant's blocks: with ``quotas`` (``raykv.tiers.quotas``), a store over
its tenant's quota evicts that tenant's own entries and leaves out what still does not fit,
never another tenant's (invariant 13; ``prepare_store``).
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import operator
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from raykv import ops
from raykv.blocks.hashing import Tenant, tenant_label
from raykv.errors import ConfigError
from raykv.layout import tp
from raykv.layout.plan import Plan
from raykv.tiers import shm
from raykv.tiers.holds import DEFAULT_TIMEOUT_S, LOAD, STORE, Hold, Holds
from raykv.tiers.policies import EvictionPolicy, evict_all, insert_all, make_policy, touch_all
from raykv.tiers.quotas import TenantQuotas
from raykv.tiers.shm import SharedSpec

Key = bytes
# the CPU tier's eviction hands its victims to the tier below (``raykv.tiers.disk_tier``):
# (keys, their blocks, valid sub-slots, checksums, each key's tenant: the disk tier's quotas
# count them), under the tier's lock, before the blocks are freed; it must copy the rows out
# of ``arena`` before it returns and never call the tier
Demote = Callable[[list[Key], np.ndarray, "KeyRows", "KeySums", list[Tenant]], None]


class BlockState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    READABLE = "readable"
    READING = "reading"


READABLE = (BlockState.READABLE, BlockState.READING)  # a key in these states is a hit
# a block's state as the tier stores it (int8 per block): _STATES[code]; code >= _READABLE
# is a hit
_FREE, _WRITING, _READABLE, _READING = range(4)
_STATES = (BlockState.FREE, BlockState.WRITING, BlockState.READABLE, BlockState.READING)


@dataclass(slots=True)
class _Block:
    """One block's metadata as one record: what ``CpuTier._blocks`` shows (a snapshot)."""

    index: int
    key: Key | None = None
    state: BlockState = BlockState.FREE
    readers: int = 0
    writers: int = 0  # writers (TP copies) still copying into the block
    failed: bool = False
    dropped: bool = False  # left the index while being read; freed by the last reader
    valid: tuple[bool, ...] = ()  # sub-slots that hold a GPU block (null ones do not)
    checksums: dict[int, tuple[int, ...]] = field(default_factory=dict)  # copy -> per sub


def int_array(values: Iterable[int] | np.ndarray, n: int = -1) -> np.ndarray:
    """``values`` (``n`` of them where known) as an int64 array; an int64 array as it is."""
    if isinstance(values, np.ndarray):
        return values.astype(np.int64, copy=False)
    if n < 0 and isinstance(values, Sequence):
        n = len(values)
    return np.fromiter(values, np.int64, n)


def _blocks_of(index: dict[Key, int], keys: Sequence[Key]) -> np.ndarray:
    """``index[key]`` of each of ``keys`` as an int64 array (KeyError for one not there):
    the lookups in one C call, no Python call per key."""
    if len(keys) < 2:
        return np.array([index[k] for k in keys], np.int64)
    return np.fromiter(operator.itemgetter(*keys)(index), np.int64, len(keys))


class KeyRows(Sequence[tuple]):
    """Per key a short tuple (which of its sub-slots hold a GPU block, or their checksums) as
    two arrays: ``values [keys, width]`` and each key's length, ``lengths [keys]``. It reads
    as the tuple of tuples it stands for, but a job's thousands of keys are stored, sliced
    and pickled (a ``CpuTierView``'s calls to the owner) as arrays, never a tuple per key."""

    __slots__ = ("lengths", "values")

    def __init__(self, values: np.ndarray, lengths: np.ndarray) -> None:
        self.values, self.lengths = values, lengths

    @classmethod
    def of(cls, rows: Sequence[Sequence], dtype: type) -> KeyRows:
        """``rows`` (a sequence of tuples, or a ``KeyRows`` already) as a ``KeyRows``."""
        if isinstance(rows, KeyRows):
            return rows
        lengths = int_array(map(len, rows), len(rows))
        width = int(lengths.max(initial=0))
        values = np.zeros((len(rows), width), dtype)
        if len(rows) and (lengths == width).all():  # one width (one group's keys): at once
            values[:] = rows
        else:
            for i, row in enumerate(rows):
                values[i, : len(row)] = row
        return cls(values, lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int | slice) -> tuple:  # a slice: a tuple of key tuples
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        return tuple(self.values[i, : self.lengths[i]].tolist())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == tuple(b) for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # compared by value, like the tuples

    def __repr__(self) -> str:
        return f"KeyRows({tuple(self)!r})"

    def __getstate__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.values, self.lengths

    def __setstate__(self, state: tuple[np.ndarray, np.ndarray]) -> None:
        self.values, self.lengths = state


class KeySums(Sequence[dict]):
    """A lease's stored checksums, per key ``{copy: (sum per sub-slot, ...)}`` (copies that
    stored none are absent), as two arrays: ``sums [copies, keys, width]`` and ``lengths
    [copies, keys]`` (-1: none stored by that copy). Reads as the tuple of dicts it stands
    for; the engine compares a load's sums with ``sums`` directly."""

    __slots__ = ("lengths", "sums")

    def __init__(self, sums: np.ndarray, lengths: np.ndarray) -> None:
        self.sums, self.lengths = sums, lengths

    def __len__(self) -> int:
        return self.lengths.shape[1]

    def __getitem__(self, i: int | slice) -> Any:  # a key's dict; a slice: a tuple of them
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        return {
            c: tuple(self.sums[c, i, :n].tolist())
            for c, n in enumerate(self.lengths[:, i].tolist())
            if n >= 0
        }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"KeySums({tuple(self)!r})"

    def __getstate__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.sums, self.lengths

    def __setstate__(self, state: tuple[np.ndarray, np.ndarray]) -> None:
        self.sums, self.lengths = state


@dataclass(frozen=True)
class ArenaSpec(SharedSpec):
    """A shared arena's ``SharedSpec`` plus the shared array of its blocks' generations
    (int64 per block, then the tier's release count), which ``CpuTierView.current`` reads."""

    gens: SharedSpec | None = None


@dataclass(frozen=True)
class StoreReservation:
    """Blocks reserved (WRITING) for the new keys of one store; ``present`` keys were already
    stored or being stored and are skipped. ``hold``: its id at the tier while live;
    ``gens``: each block's generation when reserved; ``releases``: the tier's release count
    then (-1: unknown, ``current`` checks every block)."""

    keys: tuple[Key, ...]
    blocks: tuple[int, ...]
    present: tuple[Key, ...]
    evicted: tuple[Key, ...]
    hold: int = 0
    gens: tuple[int, ...] = ()
    releases: int = -1

    @cached_property
    def block_array(self) -> np.ndarray:
        """``blocks`` as an int64 array (the tier hands it over with the reservation)."""
        return int_array(self.blocks)

    def block_of(self) -> dict[Key, int]:
        return dict(zip(self.keys, self.blocks, strict=True))

    def split(self, keep: Callable[[Key], bool]) -> tuple[StoreReservation, StoreReservation]:
        """(the reserved keys ``keep`` takes, the rest): two reservations finished apart, e.g.
        the entries a pull filled (stored) and those it did not (released)."""
        picked = [keep(k) for k in self.keys]
        gens = self.gens or (0,) * len(self.keys)
        parts = tuple(
            StoreReservation(
                tuple(k for k, p in zip(self.keys, picked, strict=True) if p is want),
                tuple(b for b, p in zip(self.blocks, picked, strict=True) if p is want),
                (),
                (),
                self.hold,
                tuple(g for g, p in zip(gens, picked, strict=True) if p is want),
                self.releases,
            )
            for want in (True, False)
        )
        return parts[0], parts[1]


@dataclass(frozen=True)
class LoadLease:
    """Read references on the blocks of ``keys`` (state READING until ``finish_load``, or
    until the tier reclaims the lease: ``hold``, ``gens``, ``releases`` as in
    ``StoreReservation``). ``valid`` / ``checksums``: per key, its sub-slots holding a GPU
    block and its stored checksums (``KeyRows`` / ``KeySums`` from the tier)."""

    keys: tuple[Key, ...]
    blocks: tuple[int, ...]
    valid: Sequence[tuple[bool, ...]]
    checksums: Sequence[dict[int, tuple[int, ...]]]
    hold: int = 0
    gens: tuple[int, ...] = ()
    releases: int = -1

    @cached_property
    def block_array(self) -> np.ndarray:
        """``blocks`` as an int64 array (the tier hands it over with the lease)."""
        return int_array(self.blocks)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    stored: int = 0
    loaded: int = 0
    evicted: int = 0
    failed_stores: int = 0
    rejected_stores: int = 0  # prepare_store found no room (all-or-nothing)
    checksum_errors: int = 0
    expired_leases: int = 0  # leases reclaimed at their deadline (read references dropped)
    expired_reservations: int = 0  # reservations reclaimed at their deadline (blocks freed)
    released_holds: int = 0  # leases and reservations of a holder that went away
    late_finishes: int = 0  # finishes of holds reclaimed already: ignored
    quota_evicted: int = 0  # entries a store evicted of its own tenant's, over its quota
    quota_refused: int = 0  # new entries a store left out: over quota, none of its own free


class ArenaRows:
    """Addressing of the arena, the one place it is written down (tier and views alike):
    row ``block * factor + sub`` of each copy holds GPU block ``sub`` of CPU block ``block``."""

    arena: torch.Tensor
    factor: int
    copies: int
    gens: torch.Tensor | None = None  # int64 per block: its generation (bumped when freed)
    releases: torch.Tensor | None = None  # int64 [1]: blocks were freed this many times

    def current(self, held: LoadLease | StoreReservation) -> bool:
        """Whether every block of ``held`` still has the generation it had when leased or
        reserved (never freed since: its bytes are the ones leased). A reader checks this
        after its copy (a seqlock's second read), a writer before it. O(1) while the tier
        freed nothing since ``held`` was taken (its release count unchanged: the owner bumps
        it after the generations, so a count still equal means no generation moved), else
        one vector compare of the blocks' generations."""
        if self.gens is None or not held.gens:
            return True
        if self.releases is not None and held.releases == self.releases.numpy()[0]:
            return True
        gens = self.gens.numpy()[held.block_array]
        return bool(np.array_equal(gens, int_array(held.gens)))

    def rows(self, copy: int = 0) -> torch.Tensor:
        """``[num_blocks * factor, gpu_bytes_per_block]`` rows of one TP copy."""
        return self.arena[copy]

    def row(self, block: int | np.ndarray, sub: int | np.ndarray) -> int | np.ndarray:
        """The row of GPU block ``sub`` of CPU block ``block`` (numbers or arrays of them)."""
        return block * self.factor + sub

    def run_view(self, rows: Sequence[int], width: int, copy: int = 0) -> torch.Tensor | None:
        """Arena ``rows`` of ``copy`` as one view ``[len(rows), width]`` when they are
        consecutive and ``width`` is the whole row (nothing lies between them), else None:
        the rows a transport sends from, or receives into, in place."""
        first = rows[0] if rows else -1
        if (
            not 0 <= first <= self.arena.shape[1] - len(rows)
            or width != self.arena.shape[2]
            or list(rows) != list(range(first, first + len(rows)))
        ):
            return None
        return self.arena[copy, first : first + len(rows)]

    def read(
        self, picks: Sequence[tuple[int, int]], width: int, out: np.ndarray | None = None
    ) -> torch.Tensor:
        """The first ``width`` bytes of the rows ``(block, sub)`` of every copy, as one
        buffer ``[copies, len(picks), width]``: in ``out`` (uint8, 1-D) where it is big
        enough, else new. The paged-copy op's host path (``ops.gather_blocks``: one copy per
        run of consecutive rows, many rows side by side on the host threads; a UCX server's
        gather of scattered rows on one thread ran at 3-4 GB/s on the 2-core box, 8-9 this
        way)."""
        rows = torch.tensor([self.row(b, s) for b, s in picks], dtype=torch.long)
        shape = (self.copies, len(picks), width)
        need = self.copies * len(picks) * width
        if out is not None and out.nbytes >= need and out.dtype == np.uint8:
            dst = torch.from_numpy(out.reshape(-1)[:need].reshape(shape))
        else:
            dst = torch.empty(shape, dtype=torch.uint8)
        if len(picks):
            for c in range(self.copies):
                ops.gather_blocks([self.arena[c][:, :width]], rows, dst[c])
        return dst


class CpuTier(ArenaRows):
    def __init__(
        self,
        plan: Plan,
        policy: str | EvictionPolicy = "lru",
        *,
        pin_memory: bool | None = None,
        shared: bool = False,
        lease_timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        demote: Demote | None = None,
        quotas: TenantQuotas | None = None,
    ) -> None:
        self.plan = plan
        self.demote = demote
        self.quotas = quotas
        self.num_blocks = n = plan.cpu_num_blocks
        self.factor = max(1, plan.block_size_factor)
        self.copies = tp.plan_copies(plan)
        self.slot_bytes = plan.gpu_bytes_per_block
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        shape = (self.copies, n * self.factor, self.slot_bytes)
        # shared: in /dev/shm, so pools, TP ranks and engines of the node map it (CpuTierView)
        self.arena_spec: ArenaSpec | None = None
        if shared:
            self.arena, spec = shm.create(shape, "arena")
            gens, gens_spec = shm.create(((n + 1) * 8,), "gens")
            counters = gens.view(torch.int64)
            self.arena_spec = ArenaSpec(spec.path, spec.shape, gens_spec)
        else:
            self.arena = torch.empty(shape, dtype=torch.uint8, pin_memory=pin_memory)
            counters = torch.zeros(n + 1, dtype=torch.int64)
        # the blocks' generations, then the release count: one shared array for the views
        self.gens, self.releases = counters[:n], counters[n:]
        self._gens, self._releases = self.gens.numpy(), self.releases.numpy()
        self.policy = make_policy(policy, n) if isinstance(policy, str) else policy
        self.stats = TierStats()
        self._lock = threading.Lock()
        # per block (see _Block): state code, readers, writers, flags, key, valid sub-slots
        # (``_valid`` up to ``_nvalid``) and each copy's checksums (up to ``_nsums``, -1: none)
        self._state = np.zeros(n, np.int8)
        self._readers = np.zeros(n, np.int64)
        self._writers = np.zeros(n, np.int64)
        self._failed = np.zeros(n, bool)
        self._dropped = np.zeros(n, bool)
        self._key = np.full(n, None, object)  # each block's key (objects: set in bulk)
        self._valid = np.zeros((n, self.factor), bool)
        self._nvalid = np.zeros(n, np.int64)
        self._sums = np.zeros((self.copies, n, self.factor), np.int64)
        self._nsums = np.full((self.copies, n), -1, np.int64)
        # sorted, so also a heap (low indices first keeps runs): a store takes its head
        self._free = list(range(n))
        self._by_key: dict[Key, int] = {}
        self._holds = Holds(lease_timeout_s)
        self._clock = clock
        # tenants (invariant 13): each held block's tenant as a small id (-1: free), the
        # blocks each id holds (WRITING ones too: a reservation counts against its quota),
        # ids of tenants holding nothing handed out again (rotating salts grow nothing)
        self.block_bytes = self.copies * self.factor * self.slot_bytes
        self._tenant = np.full(n, -1, np.int32)
        self._tenant_ids: dict[Tenant, int] = {}
        self._tenant_of: list[Tenant] = []
        self._held = np.zeros(0, np.int64)
        self._spare_ids: list[int] = []
        # per tenant label: [entries refused over quota, own entries evicted over quota]
        self.quota_counts: dict[str, list[int]] = {}

    @property
    def total_bytes(self) -> int:
        return self.arena.numel()

    def tenant_bytes(self) -> dict[str, int]:
        """Bytes held (entries stored or being written) per tenant label."""
        with self._lock:
            out: dict[str, int] = {}
            for tid in np.flatnonzero(self._held).tolist():
                label = tenant_label(self._tenant_of[tid])
                out[label] = out.get(label, 0) + int(self._held[tid]) * self.block_bytes
            return out

    def held_bytes(self, tenant: Tenant) -> int:
        """Bytes ``tenant``'s entries hold (stored or being written)."""
        with self._lock:
            tid = self._tenant_ids.get(tenant)
            return 0 if tid is None else int(self._held[tid]) * self.block_bytes

    def _tenant_id(self, tenant: Tenant) -> int:
        tid = self._tenant_ids.get(tenant)
        if tid is not None:
            return tid
        if self._spare_ids:
            tid = self._spare_ids.pop()
            self._tenant_of[tid] = tenant
        else:
            tid = len(self._tenant_of)
            self._tenant_of.append(tenant)
            if tid >= len(self._held):
                self._held = np.concatenate([self._held, np.zeros(max(4, tid), np.int64)])
        self._tenant_ids[tenant] = tid
        return tid

    def _drop_tenants(self, ids: Iterable[int]) -> None:
        """Tenants ``ids`` that hold nothing now: their ids are free for others."""
        for tid in ids:
            if self._held[tid] == 0 and self._tenant_ids.get(self._tenant_of[tid]) == tid:
                del self._tenant_ids[self._tenant_of[tid]]
                self._spare_ids.append(tid)

    def release(self) -> None:
        """Unlink a shared arena's files (their mappings stay valid until dropped): the
        tier is no longer used. A private arena is freed with this object."""
        if self.arena_spec is not None:
            shm.release(self.arena_spec)
            if self.arena_spec.gens is not None:
                shm.release(self.arena_spec.gens)

    def hold_left(self, held: LoadLease | StoreReservation) -> float:
        """Seconds before ``held`` reaches its deadline (0 once finished or reclaimed)."""
        with self._lock:
            h = self._holds.get(held.hold, STORE if isinstance(held, StoreReservation) else LOAD)
            return max(0.0, h.deadline - self._clock()) if h is not None else 0.0

    # ---------------------------------------------------------------- lookups
    def lookup(self, keys: Sequence[Key]) -> int:
        """Number of leading ``keys`` that are readable (a prefix hit); touches them."""
        with self._lock:
            idx = list(map(self._by_key.get, keys))
            if None in idx:
                idx = idx[: idx.index(None)]
            hit = self._state[int_array(idx)] >= _READABLE
            n = len(idx) if hit.all() else int(np.argmin(hit))
            touch_all(self.policy, keys[:n])
            self.stats.hits += n
            self.stats.misses += len(keys) - n
            return n

    def state(self, key: Key) -> BlockState | None:
        return self.states((key,))[0]

    def states(self, keys: Sequence[Key]) -> list[BlockState | None]:
        """Each key's block state (None: not here), under one lock (a pull's store asks for
        hundreds at once)."""
        with self._lock:
            got = list(map(self._by_key.get, keys))
            if None not in got:  # every key here (an apply's stored keys): no step per key
                return list(map(_STATES.__getitem__, self._state[int_array(got)].tolist()))
            idx = [-1 if i is None else i for i in got]
            codes = self._state[int_array(idx)].tolist()
            return [None if i < 0 else _STATES[c] for i, c in zip(idx, codes, strict=True)]

    def __contains__(self, key: Key) -> bool:
        return self.state(key) in READABLE

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def stored_keys(self) -> list[Key]:
        with self._lock:
            return list(self._by_key)

    # ---------------------------------------------------------------- stores
    def prepare_store(
        self,
        keys: Sequence[Key],
        writers: int = 1,
        *,
        holder: Hashable = None,
        timeout_s: float | None = None,
        tenant: Tenant = None,
    ) -> StoreReservation | None:
        """Reserve a block for every key not yet stored, evicting if needed — all or nothing.

        Returns None when the blocks cannot all be found: nothing is reserved or evicted (keys
        already present still count as used, for the policy). Never evicts a block being
        written or read, nor any of ``keys``. Holds past their deadline are reclaimed first.
        The reservation is ``holder``'s until finished, for ``timeout_s`` (the tier's
        ``lease_timeout_s`` by default) at most.

        The new entries are ``tenant``'s (``tenant_key``; None: untenanted). Where the tier
        has a quota for it (``quotas``) and its entries would hold more, it first evicts its
        own least valuable entries (the policy's order, restricted to its entries); the new
        keys it still has no room for, the last ones (a prefix is what a lookup can use), are
        left out of the reservation (``stats.quota_refused``; None if that leaves none): a
        tenant's quota never evicts another tenant's entry (invariant 13). Room the tier
        lacks beyond that is found as before, from every tenant's entries.
        """
        with self._lock:
            now = self._clock()
            self._reclaim_due(now)
            by_key = self._by_key
            wanted = dict.fromkeys(keys)
            if by_key.keys().isdisjoint(wanted):  # the usual store: every key new
                new, present = list(wanted), ()
            else:
                new = [k for k in wanted if k not in by_key]
                present = tuple(k for k in wanted if k in by_key)
                touch_all(self.policy, present)
            tid = self._tenant_id(tenant)
            own: list[Key] = []
            quota = self.quotas.of(tenant) if self.quotas is not None and new else None
            if quota is not None:
                own, refused = self._over_quota(tid, len(new), present)
                if refused:
                    del new[len(new) - refused :]
                    self.stats.quota_refused += refused
                    self.quota_counts.setdefault(tenant_label(tenant), [0, 0])[0] += refused
                    if not new:
                        self.stats.rejected_stores += 1
                        self._drop_tenants((tid,))
                        return None
            need = len(new) - len(self._free) - len(own)
            victims: list[Key] = own
            if need > 0:  # of ``keys``, only the present ones can be candidates
                found = self.policy.victims(need, _Evictable(self, {*present, *own}))
                if found is None:
                    self.stats.rejected_stores += 1
                    self._drop_tenants((tid,))
                    return None
                victims = own + found
            # counted before the evictions: its own victims never leave it holding nothing
            # (its id would be handed to another tenant mid-store)
            self._held[tid] += len(new)
            if own:
                self.stats.quota_evicted += len(own)
                self.quota_counts.setdefault(tenant_label(tenant), [0, 0])[1] += len(own)
            if victims:
                evict_all(self.policy, victims)
                gone = int_array(map(by_key.pop, victims), len(victims))
                if self.demote is not None:  # the rows go below before the blocks are reused
                    self.demote(
                        victims,
                        gone,
                        KeyRows(self._valid[gone], self._nvalid[gone]),
                        KeySums(self._sums[:, gone], self._nsums[:, gone]),
                        [self._tenant_of[t] for t in self._tenant[gone].tolist()],
                    )
                self._release(gone)
                self.stats.evicted += len(victims)
            free = self._free
            blocks = free[: len(new)]  # the lowest free blocks; the rest stay sorted
            del free[: len(new)]
            if blocks and blocks[-1] - blocks[0] == len(blocks) - 1:  # one run (distinct)
                at = np.arange(blocks[0], blocks[0] + len(blocks), dtype=np.int64)
            else:
                at = int_array(blocks)
            self._state[at] = _WRITING  # free blocks are clean (``_release``)
            self._writers[at] = writers
            self._tenant[at] = tid
            if not blocks:
                self._drop_tenants((tid,))
            self._key[at] = np.fromiter(new, object, len(new))
            by_key.update(zip(new, blocks, strict=True))
            hold = self._holds.open(STORE, holder, blocks, now, timeout_s) if blocks else None
            out = StoreReservation(
                tuple(new),
                tuple(blocks),
                present,
                tuple(victims),
                hold.id if hold is not None else 0,
                tuple(self._gens[at].tolist()),
                int(self._releases[0]),
            )
            out.__dict__["block_array"] = at  # what ``block_array`` would compute
            return out

    def finish_store(
        self,
        reservation: StoreReservation,
        ok: bool,
        valid: Sequence[tuple[bool, ...]] | None = None,
        checksums: Sequence[tuple[int, ...]] | None = None,
        copy: int = 0,
    ) -> None:
        """One writer is done with ``reservation``. The blocks become READABLE once every
        writer succeeded; any failure returns them to FREE (never half-readable). After the
        reservation was reclaimed (``reclaim``) this changes nothing. ``valid`` /
        ``checksums``: per key, tuples or a ``KeyRows``."""
        with self._lock:
            if not reservation.blocks:
                return
            hold = self._holds.get(reservation.hold, STORE)
            if hold is None:  # reclaimed: its blocks are free, or someone else's now
                self.stats.late_finishes += 1
                return
            blocks, at, key = reservation.blocks, reservation.block_array, self._key
            if not (self._state[at] == _WRITING).all() or key[at].tolist() != list(
                reservation.keys
            ):
                i = next(
                    i
                    for n, i in enumerate(blocks)
                    if self._state[i] != _WRITING or key[i] != reservation.keys[n]
                )
                state = _STATES[self._state[i]].value
                raise RuntimeError(f"CPU block {i} is {state}, not being written")
            if not ok:
                self._failed[at] = True
            if valid is not None:
                rows = KeyRows.of(valid, bool)
                self._valid[at] = False
                self._valid[at, : rows.values.shape[1]] = rows.values
                self._nvalid[at] = rows.lengths
            if checksums is not None:
                rows = KeyRows.of(checksums, np.int64)
                self._sums[copy, at, : rows.values.shape[1]] = rows.values
                self._nsums[copy, at] = rows.lengths
            self._writers[at] -= 1
            last = self._writers[at] <= 0  # every writer of these blocks is done
            if not last.any():
                return
            done = at[last] if not last.all() else at
            if len(done) == len(hold.blocks):  # the reservation's blocks (or split part's)
                hold.blocks = []
            else:
                gone = set(done.tolist())
                hold.blocks = [i for i in hold.blocks if i not in gone]
            failed = self._failed[done]
            if failed.any():
                bad = done[failed]
                for k in key[bad].tolist():
                    del self._by_key[k]
                self._release(bad)
                self.stats.failed_stores += len(bad)
                done = done[~failed]
            self._state[done] = _READABLE
            whole = len(done) == len(blocks)  # all in order: the reservation's keys
            insert_all(self.policy, reservation.keys if whole else key[done].tolist())
            self.stats.stored += len(done)
            if not hold.blocks:
                self._holds.close(hold)

    def store_rows(
        self,
        keys: Sequence[Key],
        rows: np.ndarray,
        valid: KeyRows,
        sums: KeySums,
        *,
        beside: Sequence[Key] = (),
        tenant: Tenant = None,
    ) -> StoreReservation | None:
        """Store entries whose bytes are at hand (promoted from the tier below): ``rows``
        ``[len(keys), copies, factor, slot_bytes]`` with the valid sub-slots and every copy's
        checksums they were stored with. Reserves (``beside``: keys held here that the same
        load needs, kept from eviction), copies, finishes as every copy's writer. Keys held
        already are skipped. The reservation (its ``evicted`` went below), or None: no room.
        ``tenant``: the entries' (``prepare_store``; a quota may leave the last ones out)."""
        res = self.prepare_store([*beside, *keys], writers=self.copies, tenant=tenant)
        if res is None or not res.keys:
            return res
        at = dict(zip(keys, range(len(keys)), strict=True))
        pos = int_array(map(at.__getitem__, res.keys), len(res.keys))
        dst = self.arena.numpy().reshape(self.copies, -1, self.factor, self.slot_bytes)
        for c in range(self.copies):
            dst[c][res.block_array] = rows[pos, c]
        kept = KeyRows(valid.values[pos], valid.lengths[pos])
        for c in range(self.copies):
            self.finish_store(res, True, kept, KeyRows(sums.sums[c, pos], sums.lengths[c, pos]), c)
        return res

    # ---------------------------------------------------------------- loads
    def prepare_load(
        self, keys: Sequence[Key], *, holder: Hashable = None, timeout_s: float | None = None
    ) -> LoadLease | None:
        """Take a read reference on every key, or on none (None) if one is not readable. The
        lease is ``holder``'s until finished, for ``timeout_s`` at most (as ``prepare_store``)."""
        with self._lock:
            if not len(keys):
                return LoadLease((), (), (), ())
            try:
                at = _blocks_of(self._by_key, keys)
            except KeyError:  # a key not here
                return None
            if (self._state[at] < _READABLE).any():
                return None
            idx = tuple(at.tolist())
            np.add.at(self._readers, at, 1)  # a key leased twice: two references
            self._state[at] = _READING
            touch_all(self.policy, keys)
            # the hold's blocks: the array itself (``_unread`` takes it as it is)
            hold = self._holds.open(LOAD, holder, at, self._clock(), timeout_s)
            out = LoadLease(
                tuple(keys),
                idx,
                KeyRows(self._valid[at], self._nvalid[at]),
                KeySums(self._sums[:, at], self._nsums[:, at]),
                hold.id,
                tuple(self._gens[at].tolist()),
                int(self._releases[0]),
            )
            out.__dict__["block_array"] = at
            return out

    def finish_load(self, lease: LoadLease, loaded: int | None = None) -> None:
        """Drop the read references of ``lease``; ``loaded`` keys count as loaded. After the
        lease was reclaimed this changes nothing (the references went with it)."""
        with self._lock:
            hold = self._holds.get(lease.hold, LOAD)
            if hold is None:
                self.stats.late_finishes += bool(lease.blocks)
                return
            self._holds.close(hold)
            self._unread(hold.blocks)
            self.stats.loaded += len(lease.keys) if loaded is None else loaded

    def drop(self, key: Key, corrupt: bool = False) -> None:
        """Forget a readable key (e.g. a checksum mismatch): it is a miss from now on."""
        with self._lock:
            i = self._by_key.get(key)
            if i is None or self._state[i] == _WRITING:
                return
            del self._by_key[key]
            self.policy.remove(key)
            self.stats.checksum_errors += corrupt
            if self._readers[i]:
                self._dropped[i] = True
            else:
                self._release(np.array([i]))

    def apply(self, ops: Sequence[tuple]) -> None:
        """Apply the metadata calls a ``CpuTierView`` queued (in order). A ``drop`` of a key
        whose lease in the same batch was reclaimed is skipped: what that reader saw says
        nothing about the entry the key may name now."""
        for op, *_ in ops:
            if op not in ("finish_store", "finish_load", "drop"):
                raise ValueError(f"unknown tier operation {op!r}")
        with self._lock:
            stale = {
                k
                for op, *args in ops
                if op == "finish_load" and self._holds.get(args[0].hold, LOAD) is None
                for k in args[0].keys
            }
        for op, *args in ops:
            if op == "drop" and args[0] in stale:
                continue
            getattr(self, op)(*args)

    # ---------------------------------------------------------------- holds
    def reclaim(self, now: float | None = None, limit: int | None = None) -> int:
        """Reclaim holds past their deadline (at most ``limit``, oldest first): a lease's
        read references are dropped, a reservation's blocks freed. Returns how many."""
        with self._lock:
            return self._reclaim_due(self._clock() if now is None else now, limit)

    def release_holder(self, holder: Hashable) -> int:
        """Reclaim every hold of ``holder`` at once (it went away); returns how many."""
        with self._lock:
            held = self._holds.of(holder)
            for h in held:
                self._reclaim(h)
            self.stats.released_holds += len(held)
            return len(held)

    def holders(self) -> list[Hashable]:
        """Holders with a live lease or reservation."""
        with self._lock:
            return self._holds.holders()

    @property
    def num_holds(self) -> int:
        with self._lock:
            return len(self._holds)

    def counts(self) -> dict[str, int]:
        """Blocks per state (``dropped``: left the index, freed by their last reader):
        ``free + writing + readable + reading == num_blocks``."""
        with self._lock:
            per = np.bincount(self._state, minlength=len(_STATES)).tolist()
            out = {s.value: n for s, n in zip(_STATES, per, strict=True)}
            out["dropped"] = int(self._dropped.sum())
            return out

    # ---------------------------------------------------------------- internals
    def _reclaim_due(self, now: float, limit: int | None = None) -> int:
        due = self._holds.due(now, limit)
        for h in due:
            self._reclaim(h)
            if h.kind == LOAD:
                self.stats.expired_leases += 1
            else:
                self.stats.expired_reservations += 1
        return len(due)

    def _reclaim(self, hold: Hold) -> None:
        self._holds.close(hold)
        if hold.kind == LOAD:
            self._unread(hold.blocks)
        elif hold.blocks:  # being written: back to free (a late writer's finish finds no hold)
            at = int_array(hold.blocks)
            for k in self._key[at].tolist():
                del self._by_key[k]
            self._release(at)
        hold.blocks = []

    def _unread(self, blocks: Sequence[int] | np.ndarray) -> None:
        """Drop one read reference per entry of ``blocks`` (repeats: several)."""
        if not len(blocks):
            return
        at = int_array(blocks)
        np.subtract.at(self._readers, at, 1)
        idle = at[self._readers[at] == 0]
        if not len(idle):
            return
        if len(idle) > 1:  # each once (a block leased twice by this hold is twice in it)
            if 8 * len(idle) < self.num_blocks:
                idle = np.unique(idle)
            else:  # marks over the blocks: no sort
                seen = np.zeros(self.num_blocks, bool)
                seen[idle] = True
                idle = np.flatnonzero(seen)
        dropped = self._dropped[idle]
        self._state[idle[~dropped]] = _READABLE
        if dropped.any():
            self._release(idle[dropped])

    def _over_quota(self, tid: int, new: int, present: Sequence[Key]) -> tuple[list[Key], int]:
        """For a store of ``new`` entries by tenant ``tid`` (which has a quota): (its own
        entries to evict, in the policy's order, to stay within its quota; how many of the
        new entries it has no room for even so: its other entries are leased, being
        written, or among the store's ``present`` keys)."""
        quota = self.quotas.of(self._tenant_of[tid]) if self.quotas is not None else None
        limit = (quota or 0) // self.block_bytes
        over = int(self._held[tid]) + new - limit
        if over <= 0:
            return [], 0
        ok = _Evictable(self, set(present), tid)
        found = self.policy.victims(over, ok)
        if found is not None:
            return found, 0
        mine = (self._tenant == tid) & (self._state == _READABLE) & (self._readers == 0)
        if present:  # the store's own keys stay
            mine[_blocks_of(self._by_key, present)] = False
        avail = min(over, int(mine.sum()))
        found = self.policy.victims(avail, ok) if avail else []
        if found is None:  # the policy orders fewer keys than the tier holds: never the rule
            found = []
        return found, min(new, over - len(found))

    def _release(self, blocks: np.ndarray) -> None:
        """Blocks (distinct) back to FREE, clean, in the free list; their generations and
        the release count move on (the count last, ``current``'s fast path relies on it)."""
        ids = self._tenant[blocks]
        ids = ids[ids >= 0]
        if len(ids):  # their tenants hold that much less; one that holds nothing goes
            less = np.bincount(ids, minlength=len(self._held))
            self._held -= less
            self._drop_tenants(np.flatnonzero(less).tolist())
        self._tenant[blocks] = -1
        self._key[blocks] = None
        self._state[blocks] = _FREE
        self._readers[blocks] = self._writers[blocks] = 0
        self._failed[blocks] = self._dropped[blocks] = False
        self._valid[blocks] = False
        self._nvalid[blocks] = 0
        self._sums[:, blocks] = 0
        self._nsums[:, blocks] = -1
        self._gens[blocks] += 1  # whoever still holds one (a reclaimed hold) sees it changed
        self._releases[0] += 1
        free = self._free
        if len(blocks) == 1:
            bisect.insort(free, int(blocks[0]))
        else:
            free += np.sort(blocks).tolist()
            free.sort()  # two sorted runs: merged in one pass

    @property
    def _blocks(self) -> list[_Block]:
        """Every block's metadata as a ``_Block`` record (a snapshot: for checks, tests)."""
        out = []
        for i in range(self.num_blocks):
            sums = {c: tuple(self._sums[c, i, :n].tolist())
                    for c, n in enumerate(self._nsums[:, i].tolist()) if n >= 0}  # fmt: skip
            out.append(
                _Block(
                    i,
                    self._key[i],
                    _STATES[self._state[i]],
                    int(self._readers[i]),
                    int(self._writers[i]),
                    bool(self._failed[i]),
                    bool(self._dropped[i]),
                    tuple(self._valid[i, : self._nvalid[i]].tolist()),
                    sums,
                )
            )
        return out

    def check_consistency(self) -> None:
        """Raise AssertionError if the metadata contradicts itself (used by tests)."""
        with self._lock:
            free = set(self._free)
            assert len(free) == len(self._free), "a block is free twice"
            assert self._free == sorted(self._free), "the free list is not sorted"
            blocks = self._blocks
            for b in blocks:
                if b.index in free:  # as ``_release`` leaves it: a store sets only the rest
                    assert b.state is BlockState.FREE and b.key is None, b
                    assert not (b.readers or b.writers or b.failed or b.dropped), b
                    assert b.valid == () and b.checksums == {}, b
                    assert not self._valid[b.index].any(), b
                    assert not self._sums[:, b.index].any(), b
                else:
                    assert b.state is not BlockState.FREE, b
                    assert b.dropped or self._by_key.get(b.key) == b.index, b
                assert (b.state is BlockState.READING) == (b.readers > 0), b
            readable = {k for k, i in self._by_key.items() if blocks[i].state in READABLE}
            assert set(self.policy) == readable, "policy and index disagree"
            readers = [0] * self.num_blocks
            writing: set[int] = set()
            for h in self._holds:
                for i in h.blocks:
                    if h.kind == LOAD:
                        readers[i] += 1
                    else:
                        assert i not in writing, f"block {i} in two reservations"
                        assert blocks[i].state is BlockState.WRITING, blocks[i]
                        writing.add(i)
            assert readers == [b.readers for b in blocks], "leases and readers disagree"
            assert writing == {b.index for b in blocks if b.state is BlockState.WRITING}, (
                "a block is written outside a reservation"
            )
            held = self._state != _FREE
            assert (self._tenant[~held] == -1).all(), "a free block has a tenant"
            assert (self._tenant[held] >= 0).all(), "a held block has no tenant"
            counts = np.bincount(self._tenant[held], minlength=len(self._held))
            assert (counts == self._held).all(), "blocks per tenant and held counts disagree"
            assert all(self._tenant_of[i] == t for t, i in self._tenant_ids.items())
            assert not self._held[self._spare_ids].any(), "a spare tenant id holds blocks"


class _Evictable:
    """``EvictionPolicy.victims``' ``ok`` for one store: a READABLE block without readers,
    not one of the store's own keys. ``many`` answers for a batch of keys at once (what the
    policies ask when it is there): one array lookup instead of a call per key."""

    __slots__ = ("protected", "tenant", "tier")

    def __init__(self, tier: CpuTier, protected: set[Key], tenant: int = -1) -> None:
        # ``tenant`` (an id >= 0): only that tenant's entries (a store over its quota)
        self.tier, self.protected, self.tenant = tier, protected, tenant

    def __call__(self, key: Key) -> bool:
        return bool(self.many([key])[0])

    def many(self, keys: list[Key]) -> np.ndarray:
        t = self.tier
        at = _blocks_of(t._by_key, keys)
        ok = (t._state[at] == _READABLE) & (t._readers[at] == 0)
        if self.tenant >= 0:
            ok &= t._tenant[at] == self.tenant
        if self.protected and not self.protected.isdisjoint(keys):
            ok &= np.fromiter((k not in self.protected for k in keys), bool, len(keys))
        return ok


# -- another process's view: the arena mapped from /dev/shm, the metadata left with the owner --


class CpuTierView(ArenaRows):
    """Another process's view of a shared ``CpuTier`` (``shared=True``): its arena mapped
    from ``/dev/shm``, its metadata left with the owner. ``OffloadEngine`` runs on a view as
    on the tier itself: the caller takes the reservation / lease from the owner
    (``prepare_store`` / ``prepare_load``, passed to ``submit_store`` / ``submit_load``), and
    the engine's ``finish_store`` / ``finish_load`` / ``drop`` calls queue up in ``outbox``
    for the caller to apply on the owner (``CpuTier.apply``) in one message. So the bytes
    move once, in this process, and the owner's state machine stays the only one."""

    def __init__(self, plan: Plan, spec: SharedSpec) -> None:
        self.plan, self.spec = plan, spec
        self.num_blocks = plan.cpu_num_blocks
        self.factor = max(1, plan.block_size_factor)
        self.copies = tp.plan_copies(plan)
        self.slot_bytes = plan.gpu_bytes_per_block
        want = (self.copies, self.num_blocks * self.factor, self.slot_bytes)
        if tuple(spec.shape) != want:
            raise ConfigError(
                f"shared arena {spec.path} has shape {list(spec.shape)}, the plan needs "
                f"{list(want)}; the tier and this process serve different plans"
            )
        self.arena = shm.attach(spec)
        gens = getattr(spec, "gens", None)
        if gens is not None:  # the owner's block generations and release count: ``current``
            counters = shm.attach(gens).view(torch.int64)
            self.gens = counters[: self.num_blocks]
            if counters.numel() > self.num_blocks:
                self.releases = counters[self.num_blocks :]
        self.outbox: list[tuple] = []

    def close(self) -> None:
        """Let the mappings go (a tier placed again names new files): no copy through this
        view may be in flight."""
        shm.detach(self.spec)
        gens = getattr(self.spec, "gens", None)
        if gens is not None:
            shm.detach(gens)

    def prepare_store(self, keys: Sequence[Key], writers: int = 1, **_: object) -> None:
        raise RuntimeError("reserve on the tier's owner and pass the reservation to the engine")

    def prepare_load(self, keys: Sequence[Key], **_: object) -> None:
        raise RuntimeError("lease on the tier's owner and pass the lease to the engine")

    def finish_store(self, reservation: StoreReservation, ok: bool, valid=None, checksums=None,
                     copy: int = 0) -> None:  # fmt: skip
        self.outbox.append(("finish_store", reservation, ok, valid, checksums, copy))

    def finish_load(self, lease: LoadLease, loaded: int | None = None) -> None:
        # the owner needs the blocks and keys back, not every entry's checksums again
        self.outbox.append(
            ("finish_load", dataclasses.replace(lease, valid=(), checksums=()), loaded)
        )

    def drop(self, key: Key, corrupt: bool = False) -> None:
        self.outbox.append(("drop", key, corrupt))

    def take(self) -> list[tuple]:
        out, self.outbox = self.outbox, []
        return out

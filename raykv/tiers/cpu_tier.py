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
bumped whenever it goes back to FREE; a lease or reservation carries its blocks'
generations, and ``current`` (on the owner and on every ``CpuTierView``, through a shared
array) tells whether they still hold what they held when it was taken: a reader checks it
after copying, so a late load of reclaimed, reused entries is a miss, never wrong KV.
"""

from __future__ import annotations

import enum
import heapq
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from raykv import ops
from raykv.layout import tp
from raykv.layout.plan import Plan
from raykv.tiers import shm
from raykv.tiers.holds import DEFAULT_TIMEOUT_S, LOAD, STORE, Hold, Holds
from raykv.tiers.policies import EvictionPolicy, make_policy
from raykv.tiers.shm import SharedSpec

Key = bytes


class BlockState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    READABLE = "readable"
    READING = "reading"


READABLE = (BlockState.READABLE, BlockState.READING)  # a key in these states is a hit


@dataclass(slots=True)
class _Block:
    index: int
    key: Key | None = None
    state: BlockState = BlockState.FREE
    readers: int = 0
    writers: int = 0  # writers (TP copies) still copying into the block
    failed: bool = False
    dropped: bool = False  # left the index while being read; freed by the last reader
    valid: tuple[bool, ...] = ()  # sub-slots that hold a GPU block (null ones do not)
    checksums: dict[int, tuple[int, ...]] = field(default_factory=dict)  # copy -> per sub


@dataclass(frozen=True)
class ArenaSpec(SharedSpec):
    """A shared arena's ``SharedSpec`` plus the shared array of its blocks' generations
    (int64 per block), which ``CpuTierView.current`` reads."""

    gens: SharedSpec | None = None


@dataclass(frozen=True)
class StoreReservation:
    """Blocks reserved (WRITING) for the new keys of one store; ``present`` keys were already
    stored or being stored and are skipped. ``hold``: its id at the tier while live;
    ``gens``: each block's generation when reserved."""

    keys: tuple[Key, ...]
    blocks: tuple[int, ...]
    present: tuple[Key, ...]
    evicted: tuple[Key, ...]
    hold: int = 0
    gens: tuple[int, ...] = ()

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
            )
            for want in (True, False)
        )
        return parts[0], parts[1]


@dataclass(frozen=True)
class LoadLease:
    """Read references on the blocks of ``keys`` (state READING until ``finish_load``, or
    until the tier reclaims the lease: ``hold``, ``gens`` as in ``StoreReservation``)."""

    keys: tuple[Key, ...]
    blocks: tuple[int, ...]
    valid: tuple[tuple[bool, ...], ...]
    checksums: tuple[dict[int, tuple[int, ...]], ...]
    hold: int = 0
    gens: tuple[int, ...] = ()


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


class ArenaRows:
    """Addressing of the arena, the one place it is written down (tier and views alike):
    row ``block * factor + sub`` of each copy holds GPU block ``sub`` of CPU block ``block``."""

    arena: torch.Tensor
    factor: int
    copies: int
    gens: torch.Tensor | None = None  # int64 per block: its generation (bumped when freed)

    def current(self, held: LoadLease | StoreReservation) -> bool:
        """Whether every block of ``held`` still has the generation it had when leased or
        reserved (never freed since: its bytes are the ones leased). A reader checks this
        after its copy (a seqlock's second read), a writer before it."""
        if self.gens is None or not held.gens:
            return True
        gens = self.gens.numpy()
        return all(int(gens[b]) == g for b, g in zip(held.blocks, held.gens, strict=True))

    def rows(self, copy: int = 0) -> torch.Tensor:
        """``[num_blocks * factor, gpu_bytes_per_block]`` rows of one TP copy."""
        return self.arena[copy]

    def row(self, block: int, sub: int) -> int:
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
    ) -> None:
        self.plan = plan
        self.num_blocks = plan.cpu_num_blocks
        self.factor = max(1, plan.block_size_factor)
        self.copies = tp.plan_copies(plan)
        self.slot_bytes = plan.gpu_bytes_per_block
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        shape = (self.copies, self.num_blocks * self.factor, self.slot_bytes)
        # shared: in /dev/shm, so pools, TP ranks and engines of the node map it (CpuTierView)
        self.arena_spec: ArenaSpec | None = None
        if shared:
            self.arena, spec = shm.create(shape, "arena")
            gens, gens_spec = shm.create((self.num_blocks * 8,), "gens")
            self.gens = gens.view(torch.int64)
            self.arena_spec = ArenaSpec(spec.path, spec.shape, gens_spec)
        else:
            self.arena = torch.empty(shape, dtype=torch.uint8, pin_memory=pin_memory)
            self.gens = torch.zeros(self.num_blocks, dtype=torch.int64)
        self._gens = self.gens.numpy()
        self.policy = make_policy(policy, self.num_blocks) if isinstance(policy, str) else policy
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._blocks = [_Block(i) for i in range(self.num_blocks)]
        self._free = list(range(self.num_blocks))  # a heap: low indices first keeps runs
        self._by_key: dict[Key, int] = {}
        self._holds = Holds(lease_timeout_s)
        self._clock = clock

    @property
    def total_bytes(self) -> int:
        return self.arena.numel()

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
            n = 0
            for key in keys:
                i = self._by_key.get(key)
                if i is None or self._blocks[i].state not in READABLE:
                    break
                self.policy.touch(key)
                n += 1
            self.stats.hits += n
            self.stats.misses += len(keys) - n
            return n

    def state(self, key: Key) -> BlockState | None:
        return self.states((key,))[0]

    def states(self, keys: Sequence[Key]) -> list[BlockState | None]:
        """Each key's block state (None: not here), under one lock (a pull's store asks for
        hundreds at once)."""
        with self._lock:
            index, blocks = self._by_key, self._blocks
            return [None if (i := index.get(k)) is None else blocks[i].state for k in keys]

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
    ) -> StoreReservation | None:
        """Reserve a block for every key not yet stored, evicting if needed — all or nothing.

        Returns None when the blocks cannot all be found: nothing is reserved or evicted (keys
        already present still count as used, for the policy). Never evicts a block being
        written or read, nor any of ``keys``. Holds past their deadline are reclaimed first.
        The reservation is ``holder``'s until finished, for ``timeout_s`` (the tier's
        ``lease_timeout_s`` by default) at most.
        """
        with self._lock:
            now = self._clock()
            self._reclaim_due(now)
            wanted = list(dict.fromkeys(keys))
            present = tuple(k for k in wanted if k in self._by_key)
            new = [k for k in wanted if k not in self._by_key]
            for k in present:
                self.policy.touch(k)
            need = len(new) - len(self._free)
            protected = set(wanted)
            victims: list[Key] = []
            if need > 0:
                found = self.policy.victims(need, lambda k: self._evictable(k, protected))
                if found is None:
                    self.stats.rejected_stores += 1
                    return None
                victims = found
            by_key, evict = self._by_key, self.policy.evict
            for k in victims:
                evict(k)
                self._release(by_key.pop(k))
            self.stats.evicted += len(victims)
            blocks = [heapq.heappop(self._free) for _ in new]
            for k, i in zip(new, blocks, strict=True):  # free blocks are clean (``_release``)
                b = self._blocks[i]
                b.key, b.state, b.writers = k, BlockState.WRITING, writers
                by_key[k] = i
            hold = self._holds.open(STORE, holder, list(blocks), now, timeout_s) if blocks else None
            return StoreReservation(
                tuple(new),
                tuple(blocks),
                present,
                tuple(victims),
                hold.id if hold is not None else 0,
                tuple(self._gens[blocks].tolist()),
            )

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
        reservation was reclaimed (``reclaim``) this changes nothing."""
        with self._lock:
            if not reservation.blocks:
                return
            hold = self._holds.get(reservation.hold, STORE)
            if hold is None:  # reclaimed: its blocks are free, or someone else's now
                self.stats.late_finishes += 1
                return
            for n, i in enumerate(reservation.blocks):
                b = self._blocks[i]
                if b.state is not BlockState.WRITING or b.key != reservation.keys[n]:
                    raise RuntimeError(f"CPU block {i} is {b.state.value}, not being written")
                b.failed |= not ok
                if valid is not None:
                    b.valid = tuple(valid[n])
                if checksums is not None:
                    b.checksums[copy] = tuple(checksums[n])
                b.writers -= 1
                if b.writers > 0:
                    continue
                hold.blocks.remove(i)
                if b.failed:
                    del self._by_key[b.key]
                    self._release(i)
                    self.stats.failed_stores += 1
                else:
                    b.state = BlockState.READABLE
                    self.policy.insert(b.key)
                    self.stats.stored += 1
            if not hold.blocks:
                self._holds.close(hold)

    # ---------------------------------------------------------------- loads
    def prepare_load(
        self, keys: Sequence[Key], *, holder: Hashable = None, timeout_s: float | None = None
    ) -> LoadLease | None:
        """Take a read reference on every key, or on none (None) if one is not readable. The
        lease is ``holder``'s until finished, for ``timeout_s`` at most (as ``prepare_store``)."""
        with self._lock:
            idx = [self._by_key.get(k) for k in keys]
            if any(i is None or self._blocks[i].state not in READABLE for i in idx):
                return None
            for k, i in zip(keys, idx, strict=True):
                b = self._blocks[i]
                b.readers += 1
                b.state = BlockState.READING
                self.policy.touch(k)
            bs = [self._blocks[i] for i in idx]
            hold = (
                self._holds.open(LOAD, holder, list(idx), self._clock(), timeout_s) if idx else None
            )
            return LoadLease(
                tuple(keys),
                tuple(idx),
                tuple(b.valid for b in bs),
                tuple(dict(b.checksums) for b in bs),
                hold.id if hold is not None else 0,
                tuple(int(self._gens[i]) for i in idx),
            )

    def finish_load(self, lease: LoadLease, loaded: int | None = None) -> None:
        """Drop the read references of ``lease``; ``loaded`` keys count as loaded. After the
        lease was reclaimed this changes nothing (the references went with it)."""
        with self._lock:
            hold = self._holds.get(lease.hold, LOAD)
            if hold is None:
                self.stats.late_finishes += bool(lease.blocks)
                return
            self._holds.close(hold)
            for i in hold.blocks:
                self._unread(i)
            self.stats.loaded += len(lease.keys) if loaded is None else loaded

    def drop(self, key: Key, corrupt: bool = False) -> None:
        """Forget a readable key (e.g. a checksum mismatch): it is a miss from now on."""
        with self._lock:
            i = self._by_key.get(key)
            if i is None or self._blocks[i].state is BlockState.WRITING:
                return
            del self._by_key[key]
            self.policy.remove(key)
            self.stats.checksum_errors += corrupt
            b = self._blocks[i]
            if b.readers:
                b.dropped = True
            else:
                self._release(i)

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
            out = {s.value: 0 for s in BlockState}
            for b in self._blocks:
                out[b.state.value] += 1
            out["dropped"] = sum(b.dropped for b in self._blocks)
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
        for i in hold.blocks:
            if hold.kind == LOAD:
                self._unread(i)
            else:  # being written: back to free (a late writer's finish finds no hold)
                b = self._blocks[i]
                del self._by_key[b.key]
                self._release(i)
        hold.blocks = []

    def _unread(self, i: int) -> None:
        b = self._blocks[i]
        b.readers -= 1
        if b.readers == 0:
            if b.dropped:
                self._release(i)
            else:
                b.state = BlockState.READABLE

    def _evictable(self, key: Key, protected: set[Key]) -> bool:
        b = self._blocks[self._by_key[key]]
        return b.state is BlockState.READABLE and b.readers == 0 and key not in protected

    def _release(self, i: int) -> None:
        b = self._blocks[i]
        b.key, b.state, b.readers, b.writers = None, BlockState.FREE, 0, 0
        b.failed = b.dropped = False
        b.valid, b.checksums = (), {}
        self._gens[i] += 1  # whoever still holds it (a reclaimed hold) sees it changed
        heapq.heappush(self._free, i)

    def check_consistency(self) -> None:
        """Raise AssertionError if the metadata contradicts itself (used by tests)."""
        with self._lock:
            free = set(self._free)
            assert len(free) == len(self._free), "a block is free twice"
            for b in self._blocks:
                if b.index in free:  # as ``_release`` leaves it: a store sets only the rest
                    assert b.state is BlockState.FREE and b.key is None, b
                    assert not (b.readers or b.writers or b.failed or b.dropped), b
                    assert b.valid == () and b.checksums == {}, b
                else:
                    assert b.state is not BlockState.FREE, b
                    assert b.dropped or self._by_key.get(b.key) == b.index, b
                assert (b.state is BlockState.READING) == (b.readers > 0), b
            readable = {k for k, i in self._by_key.items() if self._blocks[i].state in READABLE}
            assert set(self.policy) == readable, "policy and index disagree"
            readers = [0] * self.num_blocks
            writing: set[int] = set()
            for h in self._holds:
                for i in h.blocks:
                    if h.kind == LOAD:
                        readers[i] += 1
                    else:
                        assert i not in writing, f"block {i} in two reservations"
                        assert self._blocks[i].state is BlockState.WRITING, self._blocks[i]
                        writing.add(i)
            assert readers == [b.readers for b in self._blocks], "leases and readers disagree"
            assert writing == {b.index for b in self._blocks if b.state is BlockState.WRITING}, (
                "a block is written outside a reservation"
            )

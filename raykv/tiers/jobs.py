"""StoreJob / LoadJob: which GPU blocks of a request go to (or come from) which CPU blocks.

A CPU-tier block holds ``f = offload_block_size / group.block_size`` consecutive GPU blocks of
one group and is keyed by the block hash of the last of them (the hash chain covers the whole
prefix). Only complete offload blocks with known hashes are covered. Null GPU blocks (id 0:
positions a sliding window or chunk dropped) carry no bytes: they are skipped and counted in
``num_skipped``, so ``sum(group_sizes) == len(block_ids)`` always holds (invariant 4), also
where one offload block straddles the window edge and covers null and real GPU blocks at
once (``sum(key_widths) == len(block_ids) + num_skipped``). An offload block whose GPU blocks
are all null is not covered at all.

Jobs are pure data built from a request's block table (logical ids, invariant 7); running
them is ``OffloadEngine``'s business. Beside its tuples a job carries the same positions as
arrays (``arrays``: block ids, key index and sub-slot of each), which the engine computes
arena rows, checksums and masks from with numpy instead of a Python step per block.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Self

import numpy as np

from raykv.blocks.hashing import DIGEST_BYTES
from raykv.blocks.pool import NULL_BLOCK
from raykv.errors import ConfigError, InvalidInput
from raykv.layout.kernel_blocks import require_logical
from raykv.layout.plan import KVGroup, Plan


def group_block_hashes(plan: Plan, hashes: Sequence[bytes] | bytes) -> list[list[bytes]]:
    """Per group, the CPU-tier key of each of its full blocks, from a request's chained
    hashes per hash block (``raykv.blocks`` hashing; or joined in one bytes object,
    ``hash_blocks_joined``): the hash at the end of the block, prefixed with the group id
    so that groups never share a key. Hashes of the hasher's length are cut in one numpy
    pass per group (a 32k-token prompt: 2048 keys without per-key Python); any other
    length goes key by key, to the same keys."""
    joined = isinstance(hashes, bytes)
    n = len(hashes) // DIGEST_BYTES if joined else len(hashes)
    blob = hashes if joined else b"".join(hashes)
    whole = len(blob) == n * DIGEST_BYTES
    rows = np.frombuffer(blob, np.uint8).reshape(n, DIGEST_BYTES) if whole else None
    out = []
    for g in plan.groups:
        per = g.block_size // plan.hash_block_size
        prefix = g.group_id.to_bytes(4, "little")
        if rows is None:
            out.append([prefix + bytes(hashes[i]) for i in range(per - 1, n, per)])
            continue
        picked = rows[per - 1 :: per]
        keys = np.empty((len(picked), len(prefix) + DIGEST_BYTES), np.uint8)
        keys[:, : len(prefix)] = np.frombuffer(prefix, np.uint8)
        keys[:, len(prefix) :] = picked
        out.append(keys.view(f"V{keys.shape[1]}").ravel().tolist())  # bytes, no byte dropped
    return out


def group_factor(plan: Plan, group: KVGroup) -> int:
    """GPU blocks of ``group`` per CPU-tier block."""
    obs, bs = plan.offload_block_size or group.block_size, group.block_size
    if obs <= bs:
        if bs % obs:
            raise ConfigError(
                f"group {group.group_id} block size {bs} is not a multiple of the offload "
                f"block size {obs}; align offload_block_size with every group block size"
            )
        return 1
    if obs % bs:
        raise ConfigError(
            f"offload block size {obs} is not a multiple of group {group.group_id}'s block "
            f"size {bs}; pick an offload_block_size that every group block size divides"
        )
    f = obs // bs
    if f > max(1, plan.block_size_factor):
        raise ConfigError(
            f"group {group.group_id} needs {f} GPU blocks per CPU block but the plan sizes "
            f"block_size_factor={plan.block_size_factor}; rebuild the plan with plan()"
        )
    return f


class JobArrays(NamedTuple):
    """A job's positions as int64 arrays: ``ids[i]`` is ``block_ids[i]``, and it sits in
    sub-slot ``subs[i]`` of the CPU block of key ``keys[i]`` (``slots[i]``); ``widths`` are
    the ``key_widths``."""

    ids: np.ndarray
    keys: np.ndarray
    subs: np.ndarray
    widths: np.ndarray


_units: list[tuple[int, int]] = []  # (i, 0) for i = 0, 1, ...: slots of one-block keys


def _unit_slots(first: int, n: int) -> list[tuple[int, int]]:
    """``[(first, 0), ..., (first + n - 1, 0)]``, the tuples shared between jobs."""
    global _units
    if len(_units) < first + n:  # a new list, swapped in whole: a reader sees either
        _units = _units + [(i, 0) for i in range(len(_units), max(first + n, 2 * len(_units)))]
    return _units[first : first + n]


def slots_of(keys: np.ndarray, subs: np.ndarray) -> tuple[tuple[int, int], ...]:
    """``(keys[i], subs[i])`` for each position, as a job's ``slots``: the shared tuples
    where position ``i`` is key ``i``'s sub-slot 0 (a one-block-per-key job), else made."""
    n = len(keys)
    if not subs.any() and np.array_equal(keys, np.arange(n)):
        return tuple(_unit_slots(0, n))
    return tuple(zip(keys.tolist(), subs.tolist(), strict=True))


@dataclass(frozen=True)
class BlockJob:
    """GPU blocks <-> CPU-tier blocks of one request.

    ``block_ids`` are the GPU logical ids actually carried, grouped by plan group order, and
    ``group_sizes[g]`` of them belong to group ``g`` (invariant 4). ``slots[i]`` is
    ``(key index, sub-slot)``: where ``block_ids[i]`` sits in the CPU block ``keys[key index]``.
    """

    request_id: str
    keys: tuple[bytes, ...]
    key_groups: tuple[int, ...]  # group id of each key
    key_widths: tuple[int, ...]  # GPU blocks each key's CPU block covers (its group factor)
    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    slots: tuple[tuple[int, int], ...]

    @classmethod
    def build(
        cls,
        plan: Plan,
        request_id: str,
        block_table: Sequence[Sequence[int]],
        block_hashes: Sequence[Sequence[bytes]],
        num_chunks: Sequence[int] | None = None,
    ) -> Self:
        return _build(cls, plan, request_id, block_table, block_hashes, num_chunks)

    def __post_init__(self) -> None:
        if sum(self.group_sizes) != len(self.block_ids) or len(self.slots) != len(self.block_ids):
            raise InvalidInput(
                f"job of request {self.request_id!r}: group sizes {self.group_sizes} sum to "
                f"{sum(self.group_sizes)} but it carries {len(self.block_ids)} block ids and "
                f"{len(self.slots)} slots (invariant 4)"
            )
        if NULL_BLOCK in self.block_ids:
            raise InvalidInput(f"job of request {self.request_id!r} carries the null block")

    @property
    def num_skipped(self) -> int:
        """Null GPU blocks inside the covered CPU blocks (carried by nobody)."""
        return sum(self.key_widths) - len(self.block_ids)

    def group_slices(self) -> list[slice]:
        out, start = [], 0
        for n in self.group_sizes:
            out.append(slice(start, start + n))
            start += n
        return out

    @cached_property
    def arrays(self) -> JobArrays:
        """The positions as arrays (computed once; ``build`` and ``select`` hand them over)."""
        n = len(self.slots)
        flat = np.fromiter(itertools.chain.from_iterable(self.slots), np.int64, 2 * n)
        ids = np.fromiter(self.block_ids, np.int64, len(self.block_ids))
        widths = np.fromiter(self.key_widths, np.int64, len(self.key_widths))
        return JobArrays(ids, flat[0::2], flat[1::2], widths)

    def valid_masks(self) -> tuple[tuple[bool, ...], ...]:
        """Per key, which sub-slots this job carries (the rest were null blocks)."""
        masks = [[False] * w for w in self.key_widths]
        for k, s in self.slots:
            masks[k][s] = True
        return tuple(tuple(m) for m in masks)

    def valid_array(self) -> np.ndarray:
        """``valid_masks`` as one bool array ``[keys, widest key]`` (each key's row False
        past its width)."""
        out = np.zeros((len(self.keys), max(self.key_widths, default=0)), bool)
        a = self.arrays
        out[a.keys, a.subs] = True
        return out

    def select(self, keep: Collection[bytes]) -> Self:
        """The same job restricted to the keys in ``keep`` (invariant 4 still holds)."""
        if isinstance(keep, tuple) and keep == self.keys:
            return self  # its own keys (a store's reservation of new keys): no set to build
        keep = set(keep)
        if len(keep) >= len(self.keys) and keep.issuperset(self.keys):
            return self  # every key kept (the usual store / load): the job as it is
        kept = np.fromiter((k in keep for k in self.keys), bool, len(self.keys))
        a = self.arrays
        at = kept[a.keys]  # the positions kept, in order (each group's stay together)
        renumber = np.cumsum(kept) - 1
        picked = JobArrays(a.ids[at], renumber[a.keys[at]], a.subs[at], a.widths[kept])
        sizes = tuple(int(at[sl].sum()) for sl in self.group_slices())
        job = type(self)(
            self.request_id,
            tuple(itertools.compress(self.keys, kept)),
            tuple(itertools.compress(self.key_groups, kept)),
            tuple(itertools.compress(self.key_widths, kept)),
            tuple(picked.ids.tolist()),
            sizes,
            tuple(zip(picked.keys.tolist(), picked.subs.tolist(), strict=True)),
        )
        job.__dict__["arrays"] = picked  # what ``arrays`` would compute
        return job


class StoreJob(BlockJob):
    """GPU -> CPU tier: ``block_ids`` are the request's GPU blocks to copy out."""


class LoadJob(BlockJob):
    """CPU tier -> GPU: ``block_ids`` are freshly allocated GPU blocks to fill."""


def _build(cls, plan, request_id, block_table, block_hashes, num_chunks):
    """``block_table[g]`` / ``block_hashes[g]``: group g's logical ids and block hashes by
    position; ``num_chunks[g]`` caps the offload blocks covered (default: all complete)."""
    for table in block_table:
        require_logical(table, f"{cls.__name__}.build")
    if len(block_table) != len(plan.groups) or len(block_hashes) != len(plan.groups):
        raise InvalidInput(
            f"expected one block table and one hash list per group ({len(plan.groups)}), got "
            f"{len(block_table)} tables and {len(block_hashes)} hash lists"
        )
    keys: list[bytes] = []
    key_groups: list[int] = []
    widths: list[int] = []
    ids: list[int] = []
    slots: list[tuple[int, int]] = []
    sizes: list[int] = []
    units = True  # every key one GPU block: slot i is (i, 0)
    id_parts: list[np.ndarray] = []  # the ids as arrays, while ``units``
    for gi, (group, table, hashes) in enumerate(
        zip(plan.groups, block_table, block_hashes, strict=True)
    ):
        f = group_factor(plan, group)
        n = min(len(table), len(hashes)) // f
        if num_chunks is not None:
            n = min(n, num_chunks[gi])
        size, n = 0, max(n, 0)
        if f == 1:  # one GPU block per key (no offload block-size factor): no chunks to cut
            first = len(keys)
            got = np.fromiter(table[:n], np.int64, n)
            live = got != NULL_BLOCK
            if live.all():  # no null block (no window): every position
                picked = hashes[:n]
            else:
                picked = [hashes[c] for c in np.flatnonzero(live).tolist()]
                got = got[live]
            # hashes are bytes already, as a rule: no call per key to make them bytes
            exact = operator.countOf(map(type, picked), bytes) == len(picked)
            keys += picked if exact else map(bytes, picked)
            ids += got.tolist()
            id_parts.append(got)
            m = len(got)
            key_groups += [group.group_id] * m
            widths += [1] * m
            slots += _unit_slots(first, m)
            sizes.append(m)
            continue
        units = False
        for c in range(n):
            chunk = table[c * f : (c + 1) * f]
            if all(b == NULL_BLOCK for b in chunk):
                continue
            k = len(keys)
            keys.append(bytes(hashes[(c + 1) * f - 1]))
            key_groups.append(group.group_id)
            widths.append(f)
            for s, b in enumerate(chunk):
                if b != NULL_BLOCK:
                    ids.append(int(b))
                    slots.append((k, s))
                    size += 1
        sizes.append(size)
    job = cls(
        request_id,
        tuple(keys),
        tuple(key_groups),
        tuple(widths),
        tuple(ids),
        tuple(sizes),
        tuple(slots),
    )
    if units:  # the arrays without reading the ids and slots back
        at = np.arange(len(ids), dtype=np.int64)
        ids_at = np.concatenate(id_parts) if id_parts else at
        job.__dict__["arrays"] = JobArrays(ids_at, at, np.zeros_like(at), np.ones_like(at))
    return job

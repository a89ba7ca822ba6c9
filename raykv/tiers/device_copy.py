"""CUDA tier jobs: the copy in chunks on the engine's side stream, the checksums on the
hashing threads beside it.

A GPU <-> pinned-arena copy moves at PCIe's pace (~55 GB/s on the H100 device host), where
one thread's xxh3 hashes ~11 GB/s and eight ~57 (measured there, 1 GiB of pinned rows). A
store that hashed its rows after the copy, or a load that verified every row before it on
one thread, took the copy plus ~5 times the copy. ``OffloadEngine`` (``_copy_device``)
hands each run of consecutive full-width arena rows to these two instead:

* ``store`` gathers chunk by chunk straight into the arena rows (sizes halving towards the
  end, so the last hashing is short), records an event after each chunk and hashes the
  chunk's rows on the hashing threads (``raykv.ops_threads.in_parallel``) once the event
  fired, while the next chunks cross PCIe;
* ``load`` verifies every key on the hashing threads from the start, in pieces of whole
  keys, and queues the scatter of each span of verified keys as soon as they are verified:
  nothing of a key that fails its checksum, nor anything after it, is written (invariant 12).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from raykv import ops
from raykv.ops_threads import in_parallel
from raykv.tiers.checksum import checksums_at
from raykv.tiers.host_copy import key_chunks, within

STORE_FIRST_BYTES = 4 << 20  # a store's last chunk: the hashing left after the copy
STORE_CHUNK_BYTES = 128 << 20  # a gather per chunk (each call costs tens of us of host time)
PIECE_BYTES = 4 << 20  # one hashing task: keeps 8 threads busy, and the first load span short
LOAD_SPAN_BYTES = 64 << 20  # verified rows queued per scatter call


@dataclass(frozen=True)
class GroupRows:
    """One group's copy: ``entries[block_ids[i]]`` <-> ``arena[rows[i]]`` (full-width rows,
    ``runs`` of consecutive ones, ``host_copy.row_runs``), ``slots`` each position's
    ``(key, sub-slot)``."""

    entries: list[torch.Tensor]
    block_ids: torch.Tensor
    arena: torch.Tensor
    rows: Sequence[int]
    runs: Sequence[tuple[int, int]]
    slots: Sequence[tuple[int, int]]

    def copy(self, start: int, end: int, gather: bool) -> None:
        """Queue positions ``start .. end - 1`` on the current stream, one call per run."""
        for s, e in within(self.runs, start, end):
            rows = self.arena[self.rows[s] : self.rows[s] + e - s]
            if gather:
                ops.gather_blocks(self.entries, self.block_ids[s:e], rows)
            else:
                ops.scatter_blocks(rows, self.entries, self.block_ids[s:e])


def store(
    g: GroupRows, stream: torch.cuda.Stream, hashing: bool
) -> list[tuple[Sequence[int], Future[list[int]]]]:
    """Queue the gather of ``g`` into the arena on ``stream`` (the current stream), chunk by
    chunk; with ``hashing``, each chunk's rows' checksums are taken on the hashing threads
    once the chunk landed. Returns (arena rows, their checksums' future) per piece."""
    table, width = g.arena.numpy(), g.arena.shape[1]
    out: list[tuple[Sequence[int], Future[list[int]]]] = []
    chunks = key_chunks(g.slots, width, last_small=True, first=STORE_FIRST_BYTES,
                        top=STORE_CHUNK_BYTES)  # fmt: skip
    try:
        for a, b in chunks:
            g.copy(a, b, gather=True)
            if not hashing:
                continue
            landed = torch.cuda.Event()
            landed.record(stream)
            for pa, pb in _pieces(a, b, width):
                part = g.rows[pa:pb]
                out.append((part, in_parallel(_sums_after, landed, table, part, width)))
    except BaseException:  # the hashing started ends before the caller frees the rows
        concurrent.futures.wait([f for _, f in out])
        raise
    return out


def _sums_after(landed: torch.cuda.Event, table: np.ndarray, rows: Sequence[int], width: int):
    landed.synchronize()  # releases the GIL while it waits
    return checksums_at(table, rows, width)


def load(g: GroupRows, verify: Callable[[int, int], int | None] | None) -> tuple[int, int | None]:
    """Queue the scatter of ``g`` from the arena on the current stream, each span only once
    ``verify`` (``OffloadEngine._verifier``: the first position of the first key failing its
    checksum in a range of whole keys, or None) passed every key in it. Returns (rows
    written, the failing position or None). No verification outlives the call."""
    n, width = len(g.rows), g.arena.shape[1]
    if verify is None:
        g.copy(0, n, gather=False)
        return n, None
    pieces = key_chunks(g.slots, width, first=PIECE_BYTES, top=PIECE_BYTES)
    futures = [in_parallel(verify, a, b) for a, b in pieces]
    queued = verified = 0
    bad = None
    try:
        for (_, b), fut in zip(pieces, futures, strict=True):
            bad = fut.result()
            verified = b if bad is None else bad
            if bad is not None or verified == n or (verified - queued) * width >= LOAD_SPAN_BYTES:
                g.copy(queued, verified, gather=False)
                queued = verified
            if bad is not None:
                break
    finally:
        for fut in futures:
            fut.cancel()  # not started: never will
        concurrent.futures.wait(futures)
    return queued, bad


def _pieces(start: int, end: int, width: int) -> list[tuple[int, int]]:
    step = max(1, PIECE_BYTES // max(1, width))
    return [(a, min(a + step, end)) for a in range(start, end, step)]

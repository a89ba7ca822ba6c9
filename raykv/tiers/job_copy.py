"""A tier job's copies: runs of arena rows, each row's checksum taken by the copy itself as it
moves the row, and a load's check of those sums (invariant 12).

A job's rows (one per GPU block it carries) land wherever the tier's free entries are. Each run
of consecutive full-width arena rows moves straight into (or out of) the arena in one paged
copy (``row_runs``; a staging buffer's fresh pages and its landing cost more than the copy
itself); a job whose rows are more scattered than one run per ``RUN_ROWS`` rows (or narrower
than a slot) goes through a staging buffer (``OffloadEngine._copy_rows``).

Every copy passes ``sums=`` to ``raykv.ops``' paged copy, on every device, so no pass of its
own reads the bytes again:

* on CUDA the kernel adds each row's sum (``kernels/row_sum.h``, the tiers' one checksum) as
  it fills or empties the device chunk of the staged pipeline, and only the sums (8 bytes a
  row) cross to the host, behind the copy on the same stream. Host threads summing beside a
  GPU <-> pinned copy ran the tier's CUDA jobs at 0.27 x a plain pinned copy (16 threads,
  H200 host); the kernels move the rows with their sums at PCIe's pace;
* on the host (a CPU-device pool, an engine attached through shared memory:
  ``raykv.engine``) the native fused copy of ``raykv.ops.reference`` adds each 64-bit word's
  row-sum term as it copies the word, split over the host threads (``raykv.ops.threads``)
  without the GIL. With the shared-memory bench's shapes (128 MiB of 512 KiB rows), a store
  or load with its sums took 12-15 ms on the 2-core box (two threads, stores that bypass the
  cache) against ~20 ms for a plain one-thread copy, and 7-9 ms on the 16-core H200 host
  (eight threads) against 24-33 ms; a copy on the caller's thread with the sums on a
  checksum thread beside it ran at 0.6-0.7 x a plain copy.

A store's sums (``TakenSums``) are the rows' checksums once the job's copy completed. A
load's (``LoadCheck``) are compared with the stored checksums then: the first key that fails
and every key after it in its group are not loaded (the job reports them missed; the engine
recomputes those blocks, whatever bytes landed in them) and the failed key is dropped as
corrupt. Only verified rows ever become valid.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from raykv import ops

RUN_ROWS = 8  # row_runs gives up beyond one run per this many rows (a staging copy is cheaper)


def row_runs(rows: np.ndarray) -> list[tuple[int, int]] | None:
    """``(start, end)`` position ranges of each run of consecutive arena ``rows`` (each run
    is one direct copy), or None where there are more than one per ``RUN_ROWS`` rows."""
    cuts = (np.flatnonzero(rows[1:] != rows[:-1] + 1) + 1).tolist()
    if len(cuts) + 1 > max(1, len(rows) // RUN_ROWS):
        return None
    edges = [0, *cuts, len(rows)]
    return list(itertools.pairwise(edges)) if len(rows) else []


@dataclass(frozen=True)
class GroupRows:
    """One group's copy: ``entries[block_ids[i]]`` <-> ``rows_of[rows[i]]`` (full-width
    rows of the arena or of a staging buffer, ``runs`` of consecutive ones,
    ``row_runs``)."""

    entries: list[torch.Tensor]
    block_ids: torch.Tensor
    rows_of: torch.Tensor
    rows: Sequence[int]
    runs: Sequence[tuple[int, int]]

    def copy(self, gather: bool, sums: torch.Tensor | None) -> None:
        """Queue every position on the current stream, one call per run, each row's sum into
        ``sums`` (on the entries' device) where given."""
        for s, e in self.runs:
            rows = self.rows_of[self.rows[s] : self.rows[s] + e - s]
            part = None if sums is None else sums[s:e]
            if gather:
                ops.gather_blocks(self.entries, self.block_ids[s:e], rows, sums=part)
            else:
                ops.scatter_blocks(rows, self.entries, self.block_ids[s:e], sums=part)


def copy_rows(g: GroupRows, gather: bool, summed: bool) -> torch.Tensor | None:
    """Queue ``g``'s gather (into the rows) or scatter (out of them) on the current stream;
    where ``summed``, each row's sum as the kernel read it, in pinned host memory (int64 per
    position), landing behind the copy on the stream."""
    if not summed:
        g.copy(gather, None)
        return None
    device = g.entries[0].device
    sums = torch.empty(len(g.rows), dtype=torch.int64, device=device)
    g.copy(gather, sums)
    host = torch.empty(len(g.rows), dtype=torch.int64, pin_memory=device.type == "cuda")
    host.copy_(sums, non_blocking=True)
    return host


@dataclass(frozen=True)
class TakenSums:
    """A store's row sums (``copy_rows``): read them only once the stream reached the job's
    event."""

    keys: np.ndarray  # each position's key index (int64)
    subs: np.ndarray  # and sub-slot in that key's CPU block
    sums: torch.Tensor  # int64 per position, pinned host memory

    def fill(self, out: np.ndarray) -> None:
        """``out[key, sub-slot]`` = the sum of the row stored there (int64 ``[keys, width]``)."""
        out[self.keys, self.subs] = self.sums.numpy()


@dataclass(frozen=True)
class LoadCheck:
    """A load's rows' sums as the kernel wrote them, against the checksums stored with them
    (``expected``; ``known`` False where none was stored): compared once the job's event
    fired."""

    keys: Sequence[bytes]  # each position's key
    expected: np.ndarray  # int64 per position
    known: np.ndarray  # bool per position
    sums: torch.Tensor  # int64 per position, pinned host memory

    def first_bad(self) -> int | None:
        """The first position of the first key a row of which does not match, or None."""
        wrong = np.flatnonzero(self.known & (self.sums.numpy() != self.expected))
        if not len(wrong):
            return None
        i = int(wrong[0])
        while i > 0 and self.keys[i - 1] == self.keys[i]:
            i -= 1
        return i

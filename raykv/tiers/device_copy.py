"""CUDA tier jobs: the copy kernels take each row's checksum while they copy, so the host never
reads the bytes (invariant 12 on the GPU).

A GPU <-> pinned-arena copy moves at PCIe's pace (~55 GB/s on the H200 host). Checksums
taken by host threads beside it cost most of that bandwidth (the tier's CUDA jobs ran at
0.27 x a plain pinned copy with 16 threads summing). Instead ``OffloadEngine._copy_device``
hands each group's rows to these two, which pass ``sums=`` to ``raykv.ops``' paged copy: the
kernel adds each row's sum (``kernels/row_sum.h``, the tiers' one checksum) as it fills or
empties the device chunk of the staged pipeline, and only the sums (8 bytes a row) cross to
the host, behind the copy on the same stream:

* a store gathers the blocks into the arena rows (``copy_rows``); its sums (``TakenSums``)
  are the rows' checksums once the job's event fired;
* a load scatters the arena rows into the engine's blocks; ``LoadCheck.first_bad``
  compares the sums the kernel took as it wrote them with the stored checksums once the
  job's event fired. The first key that fails and every key after it in its group are not
  loaded: the job reports them missed (the engine recomputes those blocks, whatever bytes
  landed in them) and the failed key is dropped as corrupt. Only verified rows ever become
  valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from raykv import ops


@dataclass(frozen=True)
class GroupRows:
    """One group's copy: ``entries[block_ids[i]]`` <-> ``rows_of[rows[i]]`` (full-width
    rows of the arena or of a staging buffer, ``runs`` of consecutive ones,
    ``host_copy.row_runs``)."""

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


def load_check(
    keys: Sequence[bytes], expected: Sequence[int | None], sums: torch.Tensor
) -> LoadCheck:
    """``LoadCheck`` of positions with these keys and stored checksums."""
    known = np.fromiter((c is not None for c in expected), bool, len(expected))
    want = np.fromiter((0 if c is None else c for c in expected), np.int64, len(expected))
    return LoadCheck(keys, want, known, sums)

"""Per-block checksums: the row sum of each stored row, checked again before a load
(invariant 12).

The row sum (``kernels/row_sum.h``; ``raykv.ops.row_sums`` is its torch reference) is raykv's
one checksum: the paged copies take it while they copy (the CUDA kernels: a CUDA engine's tier
jobs, the NCCL pipeline; on the host the native fused copy of ``raykv.ops.reference``: a CPU
engine's tier jobs), and the host computes the same value of rows at rest here, natively (the
extension ``raykv.blocks.hashing`` builds: four words an AVX2 instruction, ~10 GB/s a thread
from memory on the 2-core box where the scalar loop made ~4.7; without the GIL) or, until that
is built or where it cannot be, with the torch reference. Any single-bit flip changes it.

The one home of the host's checksums of rows at rest (``row_checksums``) and of the check
every copy between members makes (``verified_prefix``: the service's pool-to-pool copies and
``raykv.transport``'s receivers); ``raykv.tiers.offload`` verifies CPU-tier loads key by key
with the same sum, taken by the load's copy. A mismatch means the copy is not what was stored
(bit flip, a stray writer): the reader treats the block as a miss and counts an error; it
never uses the bad bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from raykv.blocks.hashing import native_module
from raykv.ops.reference import row_sums


def row_checksums(rows: torch.Tensor) -> tuple[int, ...]:
    """The row sum of each row of a CPU uint8 ``[n, bytes]`` tensor (each row contiguous)."""
    arr = _host_rows(rows)
    return tuple(checksums_at(arr, range(arr.shape[0]), arr.shape[1]))


def _host_rows(rows: torch.Tensor) -> np.ndarray:
    """A CPU uint8 ``[n, bytes]`` tensor as numpy (no copy); anything else is refused."""
    if rows.device.type != "cpu" or rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"checksums need CPU uint8 rows, got {rows.dtype} {rows.device}")
    return rows.numpy()


def checksums_at(table: np.ndarray, rows: Sequence[int], width: int) -> list[int]:
    """The row sums of the first ``width`` bytes of rows ``rows`` of a uint8 ``[n, bytes]``
    table (each row contiguous): what ``row_checksums`` gives for those rows, without a
    gather (natively; the torch reference gathers them while the extension is not loaded)."""
    index = np.asarray(rows, dtype=np.int64)
    native = native_module()
    if native is None:
        return row_sums(torch.from_numpy(table[index, :width])).tolist()
    out = np.empty(len(index), np.int64)
    native.row_sums(table, index, width, out)
    return out.tolist()


def verified_prefix(rows: torch.Tensor | np.ndarray, expected: Sequence[int]) -> int:
    """How many leading ``rows`` (CPU uint8 ``[n, bytes]``, a tensor or a numpy array) match
    ``expected``, the checksums they were stored with: the first row that does not and every
    row after it must not be used (invariant 12). Sums every row, then compares (a reader's
    copy threads call it span by span)."""
    if isinstance(rows, torch.Tensor):
        rows = _host_rows(rows)
    if len(rows) != len(expected):
        raise ValueError(f"{len(rows)} rows but {len(expected)} checksums")
    got = checksums_at(rows, range(len(rows)), rows.shape[1])
    bad = (i for i, (g, w) in enumerate(zip(got, expected, strict=True)) if g != w)
    return next(bad, len(expected))

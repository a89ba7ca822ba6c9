"""Per-block checksums: xxh3-64 of each stored row, checked again before a load (invariant 12).

The one home of the hash (``row_checksums``) and of the check every copy between members
makes (``verified_prefix``: the service's pool-to-pool copies and ``raykv.transport``'s
receivers); ``raykv.tiers.offload`` verifies CPU-tier loads key by key with the same hash.
A mismatch means the copy is not what was stored (bit flip, a stray writer): the reader
treats the block as a miss and counts an error; it never scatters the bad bytes to the GPU.

``in_background`` runs checksums on the process's one checksum thread, beside a copy on the
caller's thread (``raykv.tiers.host_copy``): xxhash releases the GIL while it hashes a row of
a few hundred KiB, and numpy / torch copies release it while they copy. Many rows at once are
hashed on the host threads (``raykv.ops_threads.in_parallel``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
import xxhash

T = TypeVar("T")
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def row_checksums(rows: torch.Tensor) -> tuple[int, ...]:
    """xxh3-64 of each row of a CPU uint8 ``[n, bytes]`` tensor (each row contiguous)."""
    arr = _host_rows(rows)
    return tuple(xxhash.xxh3_64_intdigest(arr[i]) for i in range(arr.shape[0]))


def _host_rows(rows: torch.Tensor) -> np.ndarray:
    """A CPU uint8 ``[n, bytes]`` tensor as numpy (no copy); anything else is refused."""
    if rows.device.type != "cpu" or rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"checksums need CPU uint8 rows, got {rows.dtype} {rows.device}")
    return rows.numpy()


def checksums_at(table: np.ndarray, rows: Sequence[int], width: int) -> list[int]:
    """xxh3-64 of the first ``width`` bytes of rows ``rows`` of a uint8 ``[n, bytes]`` table
    (each row contiguous): what ``row_checksums`` gives for those rows, without a gather."""
    return [xxhash.xxh3_64_intdigest(table[r, :width]) for r in rows]


def verified_prefix(rows: torch.Tensor | np.ndarray, expected: Sequence[int]) -> int:
    """How many leading ``rows`` (CPU uint8 ``[n, bytes]``, a tensor or a numpy array) match
    ``expected``, the checksums they were stored with: the first row that does not and every
    row after it must not be used (invariant 12). Hashes row by row and stops at the first
    mismatch; nothing but the hash per row (a reader's copy threads call it span by span)."""
    if isinstance(rows, torch.Tensor):
        rows = _host_rows(rows)
    if len(rows) != len(expected):
        raise ValueError(f"{len(rows)} rows but {len(expected)} checksums")
    for i, want in enumerate(expected):
        if xxhash.xxh3_64_intdigest(rows[i]) != want:
            return i
    return len(expected)


def in_background(fn: Callable[..., T], *args: object) -> Future[T]:
    """``fn(*args)`` on the checksum thread (one per process, started on first use); tasks
    run one at a time, in the order they were submitted."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="raykv-checksum")
        return _pool.submit(fn, *args)

"""Host copies of tier jobs with their checksums on the checksum thread beside them.

Where a job's blocks and the arena are both host memory (a CPU-device pool, an engine attached
through shared memory: ``raykv.engine``), its paged copy and the row sum of each of its
rows both run on the host; one after the other they cost a copy plus a hash of every byte
(~26 + ~17 ms per 128 MiB on the 2-core box). ``OffloadEngine`` overlaps the two on two
threads, the caller's and the checksum thread (``raykv.tiers.checksum.in_background``):

* a store copies chunk by chunk and hashes chunk i on the checksum thread while it copies
  chunk i + 1 (``store_chunks``): only the last chunk's hashing is left after the copy;
* a load keeps ``raykv.ops.scatter_blocks``' span-by-span ``check`` (nothing of a key that
  fails its checksum is written; keys after it count as not loaded, whatever of them the
  copy's other threads wrote: invariant 12) and ``VerifyAhead`` answers it: every chunk is
  verified on the checksum thread ahead of the copy, and a span waits only for the chunks it
  reaches; only the first chunk's verification is not hidden.

Chunks double from ``FIRST_CHUNK_BYTES`` to ``CHUNK_BYTES`` on key boundaries, laid out so
that the small one is the exposed end (a load's first, a store's last, ``key_chunks``). Each
run of consecutive arena rows moves straight into (out of) the arena (``row_runs``): a
staging buffer's fresh pages and its landing cost more than the copy itself.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from raykv.tiers.checksum import in_background

FIRST_CHUNK_BYTES = 2 << 20  # the exposed end: a store's last hashing, a load's first verify
# each ops call costs ~0.2-0.4 ms of Python (measured, 2-core box: 64 calls of 2 MiB copied
# 128 MiB ~25 ms slower than one call; 8 of 16 MiB ~4 ms), so chunks grow to a few large ones
CHUNK_BYTES = 32 << 20
RUN_ROWS = 8  # row_runs gives up beyond one run per this many rows (a staging copy is cheaper)


def key_chunks(
    slots: Sequence[tuple[int, int]],
    width: int,
    *,
    last_small: bool = False,
    first: int | None = None,
    top: int | None = None,
) -> list[tuple[int, int]]:
    """``(start, end)`` position ranges covering ``slots`` (each position's ``(key, sub)``)
    in order, cut only where the key changes: at the first key boundary once a chunk holds
    its size in ``width``-byte rows. Sizes double from ``first`` (``FIRST_CHUNK_BYTES``) up
    to ``top`` (``CHUNK_BYTES``) bytes; with ``last_small`` they are laid out from the end
    (halving towards it)."""
    first = FIRST_CHUNK_BYTES if first is None else first
    top = CHUNK_BYTES if top is None else top
    if last_small:
        n = len(slots)
        back = key_chunks(slots[::-1], width, first=first, top=top)
        return [(n - b, n - a) for a, b in reversed(back)]
    out: list[tuple[int, int]] = []
    rows, top = max(1, first // max(1, width)), max(1, top // max(1, width))
    start = 0
    for i in range(1, len(slots) + 1):
        end_of_key = i == len(slots) or slots[i][0] != slots[i - 1][0]
        if end_of_key and (i == len(slots) or i - start >= rows):
            out.append((start, i))
            start, rows = i, min(top, 2 * rows)
    return out


def row_runs(rows: Sequence[int]) -> list[tuple[int, int]] | None:
    """``(start, end)`` position ranges of each run of consecutive arena ``rows`` (each run
    is one direct copy), or None where there are more than one per ``RUN_ROWS`` rows."""
    runs, start = [], 0
    limit = max(1, len(rows) // RUN_ROWS)
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((start, i))
            start = i
            if len(runs) > limit:
                return None
    return runs


def within(runs: Sequence[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The parts of ``runs`` inside positions ``start .. end - 1``."""
    return [(max(a, start), min(b, end)) for a, b in runs if a < end and b > start]


def store_chunks(
    chunks: Sequence[tuple[int, int]],
    copy: Callable[[int, int], None],
    sums: Callable[[int, int], list[int]] | None,
) -> list[Future[list[int]]]:
    """``copy(start, end)`` of each chunk on this thread, then ``sums(start, end)`` of it on
    the checksum thread beside the next copy; returns the sums' futures, one per chunk (none
    without ``sums``). If a copy raises, the sums already started end before it propagates."""
    out: list[Future[list[int]]] = []
    try:
        for a, b in chunks:
            copy(a, b)
            if sums is not None:
                out.append(in_background(sums, a, b))
    except BaseException:
        concurrent.futures.wait(out)
        raise
    return out


class VerifyAhead:
    """A ``check`` for ``raykv.ops.scatter_blocks`` whose verification runs ahead of the copy.

    ``verify(start, end)`` returns the position of the first row of the first key among
    positions ``start .. end - 1`` that fails its checksum, or None. It runs for every chunk
    (whole keys) on the checksum thread from the start (on the caller's thread when there is
    one chunk: no hand-over for a small load). ``check(lo, hi)`` waits for the chunks that
    start before ``hi`` (so the key of row ``hi - 1`` is verified whole) and allows the rows
    before the first failure (thread-safe: the copy's host threads call it, a span each).
    ``bad``: that failure's position, once found. ``close`` (always call it) waits for
    verification still running, so none outlives the caller's lease."""

    def __init__(
        self, chunks: Sequence[tuple[int, int]], verify: Callable[[int, int], int | None]
    ) -> None:
        self._chunks, self._verify = list(chunks), verify
        self._futures = (
            [in_background(verify, a, b) for a, b in self._chunks] if len(self._chunks) > 1 else []
        )
        self._waited = 0  # chunks whose verification came back
        self._lock = threading.Lock()
        self.bad: int | None = None

    def __call__(self, lo: int, hi: int) -> int:
        with self._lock:  # chunks are waited for in order, whichever thread asks
            while self.bad is None and self._waited < len(self._chunks):
                a, b = self._chunks[self._waited]
                if a >= hi:
                    break
                fut = self._futures[self._waited] if self._futures else None
                self.bad = fut.result() if fut is not None else self._verify(a, b)
                self._waited += 1
        if self.bad is not None and self.bad < hi:
            return max(self.bad - lo, 0)
        return hi - lo

    def close(self) -> None:
        for fut in self._futures:
            fut.cancel()  # not started: never will
        concurrent.futures.wait(self._futures)

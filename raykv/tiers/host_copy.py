"""Arena rows in runs: how a tier job's rows are laid out for its copies.

A job's rows (one per GPU block it carries) land wherever the tier's free entries are. Each run
of consecutive full-width arena rows moves straight into (or out of) the arena in one paged
copy (a staging buffer's fresh pages and its landing cost more than the copy itself); a job
whose rows are more scattered than one run per ``RUN_ROWS`` rows (or narrower than a slot)
goes through a staging buffer (``OffloadEngine._copy_device``).

The copies take each row's checksum as they move it, on every device: on CUDA the kernels, on
the host (a CPU-device pool, an engine attached through shared memory: ``raykv.engine``) the
native fused copy of ``raykv.ops.reference``, which adds each 64-bit word's row-sum term as it
copies the word, split over the host threads (``raykv.ops.threads``) without the GIL. So a
host store or load reads every byte once, with no checksum pass beside or after it. With the
shared-memory bench's shapes (128 MiB of 512 KiB rows), a store or load with its sums took
12-15 ms on the 2-core box (two threads, stores that bypass the cache) against ~20 ms for a
plain one-thread copy, and 7-9 ms on the 16-core H200 host (eight threads) against 24-33 ms.
A copy on the caller's thread with the sums on a checksum thread beside it, this module's
approach before, ran the tier jobs at 0.6-0.7 x a plain copy.
"""

from __future__ import annotations

from collections.abc import Sequence

RUN_ROWS = 8  # row_runs gives up beyond one run per this many rows (a staging copy is cheaper)


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

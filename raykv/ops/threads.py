"""The process's host worker threads: rows hashed (``raykv.tiers.checksum``) and large host
copies (``raykv.ops.reference``) run side by side on them. The native row sums and copies,
numpy and torch release the GIL while they hash or copy, so the threads add up (one thread
copies ~12 GB/s of 256 KiB rows on this project's 2-core CI box, two 22).

A task running on one of these threads never waits for another task of the pool
(``side_by_side`` runs inline there): with every thread waiting, nothing would run.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
_PREFIX = "raykv-host"
_parallel: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def host_threads() -> int:
    """Threads of ``in_parallel``: ``RAYKV_HASH_THREADS``, else half the host's cores, 2 to
    16 (one thread hashes ~11 GB/s of pinned rows on the H100 device host, 8 threads 49 alone
    but 34-40 beside a PCIe copy; on a 32-core H200 host a CUDA engine's tier store and load
    ran 1.4 x faster with 16 threads than with 8)."""
    env = os.environ.get("RAYKV_HASH_THREADS")
    if env:
        return max(1, int(env))
    return min(16, max(2, (os.cpu_count() or 2) // 2))


def in_parallel(fn: Callable[..., T], *args: object) -> Future[T]:
    """``fn(*args)`` on the process's host threads (``host_threads``); tasks run side by
    side."""
    global _parallel
    with _lock:
        if _parallel is None:
            _parallel = ThreadPoolExecutor(host_threads(), thread_name_prefix=_PREFIX)
        return _parallel.submit(fn, *args)


def on_host_thread() -> bool:
    """Whether the caller runs on one of the host threads."""
    return threading.current_thread().name.startswith(_PREFIX)


def side_by_side(fn: Callable[[int, int], None], lo: int, hi: int, piece: int) -> None:
    """``fn(a, b)`` over ``[lo, hi)`` cut into ranges of at least ``piece`` items (at most one
    per host thread), the first on the caller's thread and the others on the host threads at
    the same time; returns once every range is done (the first error raised, after all of
    them ended). Inline in one call where the range is small or the caller is a host
    thread."""
    n = hi - lo
    k = min(host_threads(), n // max(1, piece))
    if k <= 1 or on_host_thread():
        fn(lo, hi)
        return
    cuts = [lo + n * i // k for i in range(k + 1)]
    rest = [in_parallel(fn, a, b) for a, b in itertools.pairwise(cuts[1:])]
    try:
        fn(cuts[0], cuts[1])
    finally:
        wait(rest)
    for f in rest:
        f.result()

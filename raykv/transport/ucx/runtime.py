"""ucxx in a process that already runs an event loop of its own (a Ray async actor, a driver
under ``asyncio.run``): one private event loop thread per process owns every ucxx object.

Why a loop of its own. ucxx's asyncio layer binds its application context to the event
loop that is current when the context is created: its notifier thread (progress mode
``thread``, the default, where a C++ thread progresses the UCX worker and completes requests)
hands finished requests to that loop with ``run_coroutine_threadsafe`` (with Python futures
on, ``enable_python_future``; off, ucxx's default, each awaited request spins the loop until
it is done). Created from a Ray actor's ``__init__`` (no loop running yet) it binds a fresh
loop nobody runs and every send hangs; created on the actor's loop it works, but then every
transfer's completion competes with the actor's own calls, and the loop is blocked by the
synchronous gathers, checksums and scatters those calls do (tens of ms for a large batch),
stalling UCX. So raykv creates the context inside a daemon thread running its own loop
(``raykv-ucx``) and submits every ucxx coroutine there (``call``, from any loop; ``submit``,
from plain threads). The ``polling`` and ``blocking`` modes need the owning loop to spin or
wake for progress; the ``thread`` mode needs nothing from it, which is why it is the one used.

Several UCX workers (``worker(i)``). A UCX worker's transfers are progressed by one thread:
its progress thread makes every socket call (over tcp, the kernel's copies of each byte), so
one worker moves what one core can copy, however many endpoints it has. Stripe ``i`` of a
connection runs on worker ``i`` of each side, each with its own progress thread. Raw ucxx over
tcp on loopback, one 128 MiB message split over workers in one pair of processes (16-core H100
host, 2026-11-27): 1 worker 3.0-4.4 GB/s (4 endpoints on it: 2.9), 2 workers 5.5-6.8, 4
workers 8.2-11.3, 8 workers 11.8-16.5. Worker 0 is ucxx's process-wide context (``ucxx.init``);
the others are contexts of their own on the same loop (their completions come back to it, so
every ucxx object is still this loop's), each given its progress thread here (ucxx starts one
per event loop, for the loop's first context only).

``UCX_TLS`` and ``UCX_NET_DEVICES`` come from ``UcxConfig.tls`` / ``net_devices`` (passed to
``ucxx.init`` as the context's ``TLS`` / ``NET_DEVICES`` options, so they win over the
environment; unset, UCX reads its own variables); the first caller in a process fixes them.
The tcp transport's segment sizes are raised to 1 MiB (``TCP_SEGMENTS``) unless the
environment sets ``UCX_TCP_TX_SEG_SIZE`` or ``UCX_TCP_RX_SEG_SIZE``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import logging
import os
import threading
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from raykv.errors import TransportError

T = TypeVar("T")
log = logging.getLogger(__name__)
INIT_TIMEOUT_S = 60.0


def available() -> bool:
    """Whether ucxx is installed (``pip install 'raykv[ucx]'``)."""
    return importlib.util.find_spec("ucxx") is not None


# UCX's tcp transport cuts a large message into 8 KiB send and 64 KiB receive segments by
# default: one raw ucxx endpoint moved ~1.1 GB/s over loopback on a 16-core host (H100 device
# host, 128 MiB messages), 4.1 GB/s with 1 MiB segments (1.06 -> 1.81 GB/s on a 2-core box).
TCP_SEGMENTS = {"TCP_TX_SEG_SIZE": "1M", "TCP_RX_SEG_SIZE": "1M"}


def tcp_options(env: Mapping[str, str]) -> dict[str, str]:
    """raykv's tcp segment sizes, unless the node's environment sets either of UCX's own
    (``UCX_TCP_TX_SEG_SIZE`` / ``UCX_TCP_RX_SEG_SIZE``): then both are the node's and UCX's,
    as a pair (UCX refuses a receive segment smaller than the send segment: one of ours next
    to one of the node's could stop UCX from starting)."""
    return {} if any(f"UCX_{k}" in env for k in TCP_SEGMENTS) else dict(TCP_SEGMENTS)


class UcxRuntime:
    """The process's ucxx context and the loop thread that owns it (``UcxRuntime.get``)."""

    _instance: UcxRuntime | None = None
    _lock = threading.Lock()

    def __init__(self, tls: str | None, net_devices: str | None = None) -> None:
        self.tls, self.net_devices = tls, net_devices
        self._options: dict[str, str] = {}
        self._workers: list[Any] = []  # ucxx ApplicationContexts; [0] is ucxx's global one
        self._progress: list[Any] = []  # the progress threads of workers 1.. (kept alive)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="raykv-ucx", daemon=True)
        self._thread.start()
        try:
            self.submit(self._init(tls, net_devices)).result(INIT_TIMEOUT_S)
        except Exception as e:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise TransportError(
                f"UCX did not start (UCX_TLS={tls or 'default'}, UCX_NET_DEVICES="
                f"{net_devices or 'default'}): {e!r}; check RAYKV_UCX_TLS / RAYKV_UCX_NET_DEVICES "
                "name transports and devices this host has (ucx_info -d), or set RAYKV_UCX=0"
            ) from e

    @classmethod
    def get(cls, tls: str | None = None, net_devices: str | None = None) -> UcxRuntime:
        """The process's runtime, started on first use with ``tls`` and ``net_devices``."""
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(tls, net_devices)
            else:
                for name, want, have in (("UCX_TLS", tls, cls._instance.tls),
                                         ("UCX_NET_DEVICES", net_devices,
                                          cls._instance.net_devices)):  # fmt: skip
                    if want and want != have:
                        log.warning("UCX already runs here with %s=%s; %s ignored",
                                    name, have, want)  # fmt: skip
            return cls._instance

    async def _init(self, tls: str | None, net_devices: str | None) -> None:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx

        options = {k: v for k, v in (("TLS", tls), ("NET_DEVICES", net_devices)) if v}
        self._options = options | tcp_options(os.environ)
        # on this (running) loop: ucxx binds its notifier thread to the current loop; Python
        # futures, so an awaited request is completed by that thread (without them ucxx awaits
        # each request by yielding to the loop until it is done: a process with one receive
        # posted, as every server's hello receive is, burned a whole core while idle, and a
        # 2-core host's transfers ran at half speed beside those spinning loops)
        ucxx.init(options=self._options, progress_mode="thread", enable_python_future=True)
        self._workers.append(ucxx.core._get_ctx())

    async def worker(self, i: int) -> Any:
        """UCX worker ``i`` of this process (an ucxx ``ApplicationContext``: ``worker_address``,
        ``create_endpoint_from_worker_address``, ``recv``), created on first use with the
        process's options. Call on the UCX loop."""
        from ucxx._lib_async import ApplicationContext
        from ucxx._lib_async.continuous_ucx_progress import ThreadMode

        while len(self._workers) <= i:
            ctx = ApplicationContext(self._options, progress_mode="thread",
                                     enable_python_future=True)  # fmt: skip
            # ucxx progresses only a loop's first context (worker 0's); this one gets its
            # progress thread the way ucxx starts that one (same start callback; stopped when
            # the object goes, i.e. at exit: it is kept here)
            self._progress.append(ThreadMode(ctx.worker, self.loop, polling_mode=False))
            self._workers.append(ctx)
        return self._workers[i]

    async def worker_address(self, i: int = 0) -> bytes:
        """The address of this process's UCX worker ``i`` (what a peer creates an endpoint
        from)."""
        return bytes((await self.worker(i)).worker_address.tobytes())

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the UCX loop (from any thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Await ``coro`` on the UCX loop from another loop; cancelling the caller (or
        ``timeout_s``) cancels it there too."""
        fut = asyncio.wrap_future(self.submit(coro))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise TransportError(
                f"a UCX operation took more than {timeout_s:.0f}s; the peer is unreachable or "
                "stalled (raise RAYKV_UCX_TIMEOUT_S for slow links)"
            ) from None

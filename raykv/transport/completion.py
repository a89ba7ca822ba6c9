"""Waiting for queued GPU work (a CUDA event, an NCCL op) without a millisecond's lag.

asyncio's timers sleep in whole milliseconds (epoll's timeout: ``asyncio.sleep(1e-4)``
returns after ~1.1 ms), longer than a 32 MiB batch takes on NVLink. A wait that polled that
way ended up to 1 ms late each time it ran past its spin (a batch queued behind others, a
large one): on 2 x H100 raykv's 4096 x 64 KiB NCCL batches moved 0.80 / 0.82 x one contiguous
send with this wait against 0.72 / 0.74 x before (docs/performance-log.md, "Waits without
asyncio's millisecond timer"). So ``until_done`` spins first (``SPIN_S``: a done batch is seen
within microseconds) and then hands its check to the process's one watcher thread, which
checks every ``POLL_S`` with a real sleep and wakes the loop as soon as the check passes
(``call_soon_threadsafe``); the watcher sleeps on a condition while nothing is watched.
``block_until_done`` is the same wait for a thread of its own (a real sleep between checks).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable

import torch

SPIN_S = 0.002  # checked on the loop this long first
POLL_S = 50e-6  # then on the watcher thread, this often


class Watcher:
    """One thread that checks the registered ``done`` callables every ``poll_s`` and
    resolves each one's future on its loop once it returns true (or raises: the future gets
    the error). A future cancelled meanwhile (its waiter timed out) is dropped unchecked.
    Each check runs with the CUDA device its waiter had current: a thread that never set one
    would make device 0's context current (and create it, if the process had not) to query
    an event of another GPU."""

    def __init__(self, poll_s: float = POLL_S) -> None:
        self.poll_s = poll_s
        self._items: list[tuple[Callable[[], bool], int | None, asyncio.AbstractEventLoop,
                                asyncio.Future]] = []  # fmt: skip
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._device: int | None = None  # the watcher thread's current CUDA device

    def watch(self, done: Callable[[], bool]) -> asyncio.Future[None]:
        """A future of the running loop, resolved once ``done()`` is true."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        with self._cv:
            self._items.append((done, device, loop, fut))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="raykv-completion", daemon=True
                )
                self._thread.start()
            self._cv.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._items:
                    self._cv.wait()
                items = list(self._items)
            finished = []
            for item in items:
                done, device, loop, fut = item
                if fut.done():  # cancelled: its waiter gave up
                    finished.append(item)
                    continue
                try:
                    if device is not None and device != self._device:
                        torch.cuda.set_device(device)
                        self._device = device
                    ok, error = bool(done()), None
                except Exception as e:  # surfaces on the waiter's loop
                    ok, error = True, e
                if ok:
                    finished.append(item)
                    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits
                        loop.call_soon_threadsafe(_resolve, fut, error)
            if finished:
                with self._cv:
                    self._items = [i for i in self._items if i not in finished]
            time.sleep(self.poll_s)


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


_watcher = Watcher()


def _fresh_watcher() -> None:  # a forked child has the list but not the thread
    global _watcher
    _watcher = Watcher()


os.register_at_fork(after_in_child=_fresh_watcher)


async def until_done(
    done: Callable[[], bool], timeout_s: float, yield_loop: bool = True, spin_s: float = SPIN_S
) -> None:
    """Returns once ``done()`` is true: checked on the loop for ``spin_s`` (between checks
    the loop runs its other tasks, or with ``yield_loop`` False nothing: for work that takes
    about as long as a loop turn), then on the watcher thread. ``TimeoutError`` once
    ``timeout_s`` have passed; an error ``done()`` raises is raised here."""
    start = time.monotonic()
    while not done():
        waited = time.monotonic() - start
        if waited > timeout_s:
            raise TimeoutError(f"no completion within {timeout_s:.0f}s")
        if waited > spin_s:
            try:
                await asyncio.wait_for(_watcher.watch(done), timeout_s - waited)
            except TimeoutError:
                raise TimeoutError(f"no completion within {timeout_s:.0f}s") from None
            return
        if yield_loop:
            await asyncio.sleep(0)


def block_until_done(done: Callable[[], bool], timeout_s: float) -> None:
    """``until_done`` for a thread that may block: checks every ``POLL_S``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no completion within {timeout_s:.0f}s")
        time.sleep(POLL_S)

"""``raykv.transport.completion``: a wait for queued work spins, then goes to the watcher
thread, never to asyncio's millisecond timers; it ends, times out and fails as the caller
needs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.transport import completion


def _after(seconds: float):
    """A ``done`` that turns true ``seconds`` from now, recording the threads that asked."""
    at = time.monotonic() + seconds
    askers: set[str] = set()

    def done() -> bool:
        askers.add(threading.current_thread().name)
        return time.monotonic() >= at

    return done, askers


def test_a_short_wait_is_spun_on_the_loop():
    done, askers = _after(0.0005)
    asyncio.run(completion.until_done(done, timeout_s=5, spin_s=5))
    assert done() and askers == {threading.current_thread().name}


def test_a_long_wait_goes_to_the_watcher_thread_and_no_timer(monkeypatch):
    real_sleep = asyncio.sleep

    async def no_timers(delay, *a, **k):  # a millisecond quantum per poll is the bug
        assert delay == 0, f"asyncio.sleep({delay}) in a completion wait"
        return await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", no_timers)
    done, askers = _after(0.02)
    asyncio.run(completion.until_done(done, timeout_s=5, spin_s=0.001))
    assert done() and "raykv-completion" in askers


@settings(max_examples=15, deadline=None)
@given(
    delays=st.lists(st.floats(0, 0.01), min_size=1, max_size=12),
    yield_loop=st.booleans(),
)
def test_every_one_of_many_waits_ends_once_its_work_is_done(delays, yield_loop):
    async def main() -> list[bool]:
        dones = [_after(d)[0] for d in delays]
        await asyncio.gather(
            *(completion.until_done(d, 5, yield_loop=yield_loop, spin_s=0.001) for d in dones)
        )
        return [d() for d in dones]

    assert all(asyncio.run(main()))


def test_a_wait_that_never_ends_times_out_and_is_dropped_by_the_watcher():
    async def main() -> None:
        await completion.until_done(lambda: False, timeout_s=0.05, spin_s=0.001)

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no completion within"):
        asyncio.run(main())
    assert time.monotonic() - t0 < 2
    deadline = time.monotonic() + 2  # the cancelled watch leaves the watcher's list
    while completion._watcher._items and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not completion._watcher._items


def test_an_error_of_the_check_reaches_the_waiter_and_the_watcher_goes_on():
    calls = {"n": 0}

    def broken() -> bool:
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("CUDA error: an illegal memory access")
        return False

    with pytest.raises(RuntimeError, match="illegal memory access"):
        asyncio.run(completion.until_done(broken, timeout_s=5, spin_s=0))
    done, _ = _after(0.01)  # the watcher still serves the next wait
    asyncio.run(completion.until_done(done, timeout_s=5, spin_s=0))
    assert done()


def test_a_forked_child_waits_with_a_watcher_of_its_own():
    import multiprocessing as mp

    done, _ = _after(0.01)  # the parent's watcher thread is running
    asyncio.run(completion.until_done(done, timeout_s=5, spin_s=0))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_waits, args=(q,))
    p.start()
    p.join(20)
    assert q.get(timeout=5) == "done"


def _child_waits(q) -> None:
    done, askers = _after(0.01)
    try:
        asyncio.run(completion.until_done(done, timeout_s=5, spin_s=0))
        q.put("done" if "raykv-completion" in askers else f"not watched: {askers}")
    except Exception as e:
        q.put(repr(e))


def test_a_blocking_wait_ends_with_its_work_or_times_out():
    done, askers = _after(0.005)
    completion.block_until_done(done, timeout_s=5)
    assert done() and askers == {threading.current_thread().name}
    with pytest.raises(TimeoutError, match="no completion within"):
        completion.block_until_done(lambda: False, timeout_s=0.01)


def test_the_watcher_checks_with_the_waiters_cuda_device(monkeypatch):
    set_on: list[tuple[int, str]] = []
    monkeypatch.setattr(completion, "_watcher", completion.Watcher())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: set_on.append((d, threading.current_thread().name))
    )
    done, askers = _after(0.01)

    def checked() -> bool:  # the device is current before the first check there
        if threading.current_thread().name == "raykv-completion":
            assert set_on == [(3, "raykv-completion")]
        return done()

    asyncio.run(completion.until_done(checked, timeout_s=5, spin_s=0))
    assert set_on == [(3, "raykv-completion")] and "raykv-completion" in askers

"""The tier's ``_AppliedOrder``: a reserve / lease naming an engine's applies runs only once
each of them ran, whatever order they arrive in; numbers up to an apply's floor count as run
(a tier placed again never saw them); an apply that never comes ends the wait (a miss later,
never a hang)."""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.service.cpu_tier import _AppliedOrder


@settings(max_examples=100, deadline=None)
@given(count=st.integers(1, 8), seed=st.integers(0, 2**16), wanted=st.data())
def test_a_call_runs_only_after_every_apply_it_names_whatever_their_order(count, seed, wanted):
    numbers = list(range(1, count + 1))
    named = tuple(wanted.draw(st.lists(st.sampled_from(numbers), min_size=1, unique=True)))
    order = numbers[:]
    random.Random(seed).shuffle(order)

    async def scenario() -> None:
        applied = _AppliedOrder()
        ran: list[int] = []
        waiter = asyncio.create_task(applied.wait(("e", named)))
        for n in order:
            for _ in range(10):  # turns enough for a woken waiter to finish
                await asyncio.sleep(0)
            assert waiter.done() == (set(named) <= set(ran))
            applied.done(("e", n, 0))
            ran.append(n)
        await asyncio.wait_for(waiter, 1)

    asyncio.run(scenario())


def test_numbers_up_to_the_floor_count_as_run_and_engines_are_apart():
    async def scenario() -> None:
        applied = _AppliedOrder()
        applied.done(("e", 57, 56))  # a tier placed again: 1..56 went to the old one
        assert all(applied.has_run("e", n) for n in range(1, 58))
        assert not applied.has_run("e", 58) and not applied.has_run("other", 1)
        await asyncio.wait_for(applied.wait(("e", (3, 57))), 1)
        applied.done(("e", 59, 57))  # 58 still out: only it is remembered past the floor
        assert applied.has_run("e", 59) and not applied.has_run("e", 58)

    asyncio.run(scenario())


def test_an_apply_that_never_comes_ends_the_wait(monkeypatch):
    monkeypatch.setattr(_AppliedOrder, "WAIT_S", 0.05)

    async def scenario() -> None:
        applied = _AppliedOrder()
        await asyncio.wait_for(applied.wait(("e", (1,))), 1)  # returns, does not hang
        await applied.wait(None)  # nothing to wait for

    asyncio.run(scenario())

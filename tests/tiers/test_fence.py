"""StoreFence: a block stays fenced while any store fencing it is in flight, however the
stores' blocks overlap (a shared prefix), repeat or include the null block."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.tiers import NULL_BLOCK, StoreFence


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.booleans(), st.integers(0, 5), st.lists(st.integers(0, 8), max_size=6)),
        max_size=30,
    )
)
def test_fence_counts_every_store_of_a_block(steps) -> None:
    held, released = [], []
    fence = StoreFence(hold=held.append, release=released.append)
    heard: list[tuple[int, ...]] = []
    fence.on_release(heard.append)
    model: Counter[int] = Counter()
    jobs: dict[int, list[int]] = {}
    for is_fence, job, ids in steps:
        if is_fence and job not in jobs:
            fence.fence(job, ids)
            jobs[job] = [b for b in ids if b != NULL_BLOCK]
            model.update(jobs[job])
        elif not is_fence:
            gone = jobs.pop(job, [])
            want = []
            for b in gone:
                model[b] -= 1
                if not model[b]:
                    del model[b]
                    want.append(b)
            assert fence.release(job) == tuple(want)
            if want:
                assert heard[-1] == tuple(want)
        assert fence.fenced_blocks() == frozenset(model)
        for b in range(9):
            assert fence.is_fenced(b) == (b in model) != fence.can_reuse(b)
        assert set(fence.jobs()) == set(jobs)
    assert all(h and NULL_BLOCK not in h for h in held + released)

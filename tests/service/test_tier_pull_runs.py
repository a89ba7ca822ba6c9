"""The tier pull writes each run of consecutive rows of a received chunk as one paged copy
(``raykv.service.tier_pull._runs``): every row to write exactly once, in order, and a run
never spans a row that is skipped (its entry is stored already)."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from raykv.service.tier_pull import _runs


@given(st.lists(st.one_of(st.just(-1), st.integers(0, 10_000)), max_size=40))
def test_runs_cover_each_row_to_write_once_in_order(dests) -> None:
    out = _runs(dests)
    flat = [(first + i, d) for first, ds in out for i, d in enumerate(ds)]
    assert flat == [(j, d) for j, d in enumerate(dests) if d >= 0]
    # a skipped row starts a new run; nothing else does
    starts = [j for j, d in enumerate(dests) if d >= 0 and (j == 0 or dests[j - 1] < 0)]
    assert [first for first, _ in out] == starts
    assert all(ds for _, ds in out)
    assert sum(1 for a, b in itertools.pairwise(dests) if a < 0 <= b) + (
        1 if dests and dests[0] >= 0 else 0
    ) == len(out)

"""The tier pull writes each run of consecutive rows of a received chunk as one paged copy
(``raykv.service.tier.pull._runs``): every row to write exactly once, in order, and a run
never spans a row that is skipped (its entry is stored already)."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from raykv.service.tier.pull import _held_run, _runs


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


class _Copy:
    def __init__(self, member: str) -> None:
        self.member = member


# runs of keys sharing one list of copies (as ``_locate`` answers), or equal lists apart
_copies = st.lists(st.sampled_from("abc"), max_size=3).map(lambda ms: [_Copy(m) for m in ms])
_where = st.lists(st.tuples(_copies, st.integers(1, 6), st.booleans()), max_size=8).map(
    lambda runs: [locs if shared else list(locs) for locs, n, shared in runs for _ in range(n)]
)


@given(_where, st.sampled_from("abc"), st.data())
def test_held_run_ends_at_the_first_key_the_member_does_not_hold(where, member, data) -> None:
    end = data.draw(st.integers(0, len(where)))
    start = data.draw(st.integers(0, end))
    naive = next((i for i in range(start, end) if all(c.member != member for c in where[i])), end)
    assert _held_run(where, start, end, member) == naive

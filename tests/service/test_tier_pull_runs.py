"""The tier pull writes runs of consecutive rows of one batch buffer as one copy each
(``raykv.service.tier_pull._runs``): every (source row, destination) pair exactly once, in
order, and a run never spans two buffers or a gap."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from raykv.service.tier_pull import _runs


@st.composite
def pulls(draw):
    bufs = [object() for _ in range(draw(st.integers(1, 3)))]
    sizes = [draw(st.integers(1, 6)) for _ in bufs]
    rows = [(b, r) for b, n in zip(bufs, sizes, strict=True) for r in range(n)]
    src = sorted(draw(st.sets(st.sampled_from(range(len(rows))), min_size=1)))  # skips: present
    idx = draw(st.permutations(range(100, 100 + len(src))))
    return rows, src, list(idx)


@given(pulls())
def test_runs_cover_each_row_once_in_order_within_one_buffer(case) -> None:
    rows, src, idx = case
    out = _runs(rows, src, idx)
    flat = [((buf, first + i), d) for buf, first, dests in out for i, d in enumerate(dests)]
    assert flat == [(rows[j], d) for j, d in zip(src, idx, strict=True)]
    for buf, first, dests in out:  # each run is consecutive rows of one buffer
        assert all((buf, first + i) in rows for i in range(len(dests)))
    # a skipped row or a new buffer starts a new run; nothing else does
    breaks = sum(
        1 for a, b in itertools.pairwise(src) if b != a + 1 or rows[a][0] is not rows[b][0]
    )
    assert len(out) == breaks + 1

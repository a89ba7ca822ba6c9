"""raykv.tiers.host_copy: row runs cover a job's arena rows exactly, each run the maximal
consecutive one, or none where the rows are too scattered (they go through staging)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.tiers import host_copy


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.integers(0, 30), max_size=60))
def test_row_runs_are_the_maximal_runs_of_consecutive_rows_or_none_when_many(rows):
    runs = host_copy.row_runs(rows)
    cuts = sum(1 for i in range(1, len(rows)) if rows[i] != rows[i - 1] + 1)
    if cuts + 1 > max(1, len(rows) // host_copy.RUN_ROWS):
        assert runs is None
        return
    assert runs is not None
    at = 0
    for a, b in runs:
        assert a == at and b > a
        assert all(rows[i] == rows[a] + i - a for i in range(a, b))  # one direct copy
        assert b == len(rows) or rows[b] != rows[b - 1] + 1  # maximal
        at = b
    assert at == len(rows)

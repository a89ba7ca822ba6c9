"""raykv.tiers.job_copy on CPU tensors (the CUDA path runs the same code with the kernels
taking the sums; tests/tiers/test_offload.py and tests/ops/test_paged_copy_gpu.py run it on
CUDA): row runs cover a job's arena rows exactly, each run the maximal consecutive one, or none
where the rows are too scattered (they go through staging); a store's sums are the row sums of
the rows as they landed in the arena, and a load's check finds the first row of the first key
whose rows differ from what was stored, whatever the runs of arena rows."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.ops import row_sums
from raykv.tiers import job_copy

WIDTH = 64


@settings(max_examples=300, deadline=None)
@given(rows=st.lists(st.integers(0, 30), max_size=60))
def test_row_runs_are_the_maximal_runs_of_consecutive_rows_or_none_when_many(rows):
    runs = job_copy.row_runs(np.array(rows, np.int64))
    cuts = sum(1 for i in range(1, len(rows)) if rows[i] != rows[i - 1] + 1)
    if cuts + 1 > max(1, len(rows) // job_copy.RUN_ROWS):
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


def _rig(widths: list[int], gaps: list[bool], perm: list[int]):
    slots = [(k, s) for k, w in enumerate(widths) for s in range(w)]
    n = len(slots)
    rows, r = [], 0
    for i in range(n):  # arena rows in runs, with gaps where ``gaps`` says
        r += 1 + gaps[i]
        rows.append(r)
    runs = job_copy.row_runs(np.array(rows, np.int64)) or [(i, i + 1) for i in range(n)]
    return slots, rows, runs, r + 1, perm[:n]


@settings(max_examples=100, deadline=None)
@given(
    widths=st.lists(st.integers(1, 3), min_size=1, max_size=20),
    gaps=st.lists(st.booleans(), min_size=60, max_size=60),
    data=st.data(),
)
def test_store_takes_the_landed_rows_sums_and_load_finds_the_first_corrupt_key(widths, gaps, data):
    n = sum(widths)
    perm = data.draw(st.permutations(list(range(1, n + 4))))
    slots, rows, runs, arena_rows, ids = _rig(widths, gaps, perm)
    entries = [torch.randint(0, 256, (n + 4, WIDTH), dtype=torch.uint8)]
    arena = torch.zeros((arena_rows, WIDTH), dtype=torch.uint8)
    g = job_copy.GroupRows(entries, torch.tensor(ids), arena, rows, runs)
    sums = job_copy.copy_rows(g, gather=True, summed=True)
    assert sums is not None
    by_key = np.zeros((len(widths), max(widths)), np.int64)
    keys_at, subs_at = (np.array([slot[j] for slot in slots], np.int64) for j in (0, 1))
    job_copy.TakenSums(keys_at, subs_at, sums).fill(by_key)
    for i, (k, s) in enumerate(slots):  # the landed rows, and their sums
        assert torch.equal(arena[rows[i]], entries[0][ids[i]])
        assert by_key[k][s] == int(row_sums(arena[rows[i] : rows[i] + 1])[0])

    bad_key = data.draw(st.one_of(st.none(), st.integers(0, len(widths) - 1)))
    keys = [b"k%d" % k for k, _ in slots]
    if bad_key is not None:  # one bit of one of its rows flips in the arena
        positions = [i for i, (k, _) in enumerate(slots) if k == bad_key]
        at = data.draw(st.sampled_from(positions))
        bit = data.draw(st.integers(0, WIDTH * 8 - 1))
        arena[rows[at], bit // 8] ^= 1 << (bit % 8)
    expected = [by_key[k][s] for k, s in slots]
    unknown = data.draw(st.sets(st.integers(0, n - 1), max_size=2))
    for i in unknown:  # no checksum stored for these rows: not checked
        expected[i] = None
    out = [torch.zeros((n + 4, WIDTH), dtype=torch.uint8)]
    g2 = job_copy.GroupRows(out, torch.tensor(ids), arena, rows, runs)
    loaded = job_copy.copy_rows(g2, gather=False, summed=True)
    assert loaded is not None
    known = np.array([c is not None for c in expected])
    want_sums = np.array([0 if c is None else c for c in expected], np.int64)
    check = job_copy.LoadCheck(keys, want_sums, known, loaded)
    want = None  # the corrupt key's first position, unless its flipped row was not checked
    if bad_key is not None and expected[at] is not None:
        want = next(i for i, (k, _) in enumerate(slots) if k == bad_key)
    assert check.first_bad() == want
    for i in range(n):  # every row was written; only the check says which may be used
        assert torch.equal(out[0][ids[i]], arena[rows[i]])


def test_load_without_checksums_copies_and_checks_nothing():
    _, rows, runs, arena_rows, ids = _rig([2, 1], [False] * 3, [3, 1, 2])
    arena = torch.randint(0, 256, (arena_rows, WIDTH), dtype=torch.uint8)
    out = [torch.zeros((5, WIDTH), dtype=torch.uint8)]
    g = job_copy.GroupRows(out, torch.tensor(ids), arena, rows, runs)
    assert job_copy.copy_rows(g, gather=False, summed=False) is None
    for i in range(3):
        assert torch.equal(out[0][ids[i]], arena[rows[i]])

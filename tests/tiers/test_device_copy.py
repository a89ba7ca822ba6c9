"""raykv.tiers.device_copy's load on CPU tensors (the CUDA path runs the same code, queued on a
stream; tests/tiers/test_offload.py runs it on CUDA too): spans are scattered only once every
key in them is verified, a corrupt key stops the copy at its first row whatever the piece and
span sizes, and no verification outlives the call."""

from __future__ import annotations

import threading
from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.tiers import device_copy, host_copy

WIDTH = 64


@settings(max_examples=150, deadline=None)
@given(
    widths=st.lists(st.integers(1, 3), min_size=1, max_size=20),
    piece_rows=st.integers(1, 6),
    span_rows=st.integers(1, 8),
    gaps=st.lists(st.booleans(), min_size=60, max_size=60),
    data=st.data(),
)
def test_load_scatters_only_verified_keys_and_stops_at_the_first_corrupt_one(
    widths, piece_rows, span_rows, gaps, data
):
    slots = [(k, s) for k, w in enumerate(widths) for s in range(w)]
    n = len(slots)
    rows, r = [], 0
    for i in range(n):  # arena rows in runs, with gaps where ``gaps`` says
        r += 1 + gaps[i]
        rows.append(r)
    arena = torch.randint(0, 256, (r + 1, WIDTH), dtype=torch.uint8)
    entries = [torch.zeros((n + 4, WIDTH), dtype=torch.uint8)]
    ids = data.draw(st.permutations(list(range(1, n + 4))))[:n]
    bad_key = data.draw(st.one_of(st.none(), st.integers(0, len(widths) - 1)))
    key_start = {k: i for i, (k, s) in reversed(list(enumerate(slots)))}
    calls, lock, active = [], threading.Lock(), [0]

    def verify(start: int, end: int) -> int | None:
        assert slots[start][1] == 0 and (end == n or slots[end][1] == 0)  # whole keys
        with lock:
            calls.append((start, end))
            active[0] += 1
        try:
            if bad_key is not None and start <= key_start[bad_key] < end:
                return key_start[bad_key]
            return None
        finally:
            with lock:
                active[0] -= 1

    runs = host_copy.row_runs(rows) or [(i, i + 1) for i in range(n)]
    g = device_copy.GroupRows(entries, torch.tensor(ids), arena, rows, runs, slots)
    with (
        mock.patch.object(device_copy, "PIECE_BYTES", piece_rows * WIDTH),
        mock.patch.object(device_copy, "LOAD_SPAN_BYTES", span_rows * WIDTH),
    ):
        written, bad = device_copy.load(g, verify)
    assert active[0] == 0  # no verification outlives the call
    stop = n if bad_key is None else key_start[bad_key]
    assert (written, bad) == (stop, None if bad_key is None else stop)
    for i in range(n):
        want = arena[rows[i]] if i < stop else torch.zeros(WIDTH, dtype=torch.uint8)
        assert torch.equal(entries[0][ids[i]], want)
    covered = sorted(calls)  # the pieces verified cover every row written, in order
    assert covered[0][0] == 0 and max(b for _, b in covered) >= stop

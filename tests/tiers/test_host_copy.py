"""raykv.tiers.host_copy: chunks cut only between keys, growing from the small end; row runs
cover the rows exactly; a load's check, verified ahead on the checksum thread, lets through
exactly the rows before the first corrupt key whatever the spans; a store hashes a chunk only
once it is copied."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.tiers import host_copy

key_widths = st.lists(st.integers(1, 4), min_size=0, max_size=40)


def slots_of(widths: list[int]) -> list[tuple[int, int]]:
    return [(k, s) for k, w in enumerate(widths) for s in range(w)]


@contextlib.contextmanager
def chunk_sizes(first: int, top: int):
    saved = host_copy.FIRST_CHUNK_BYTES, host_copy.CHUNK_BYTES
    host_copy.FIRST_CHUNK_BYTES, host_copy.CHUNK_BYTES = first, top
    try:
        yield
    finally:
        host_copy.FIRST_CHUNK_BYTES, host_copy.CHUNK_BYTES = saved


@settings(max_examples=300, deadline=None)
@given(
    widths=key_widths,
    width=st.integers(1, 64),
    first=st.integers(0, 256),
    top=st.integers(0, 1024),
    last_small=st.booleans(),
)
def test_key_chunks_cover_in_order_cut_between_keys_and_grow_from_the_small_end(
    widths, width, first, top, last_small
):
    slots = slots_of(widths)
    with chunk_sizes(first, top):
        chunks = host_copy.key_chunks(slots, width, last_small=last_small)
    at = 0
    for a, b in chunks:
        assert a == at and b > a
        assert b == len(slots) or slots[b][0] != slots[b - 1][0]  # a key never straddles two
        at = b
    assert at == len(slots)
    # read from the small end, each chunk but the far one holds its share (doubling up to
    # the top) and ends at the first key boundary past it
    rows, top_rows = max(1, first // width), max(1, top // width)
    ordered = list(reversed(chunks)) if last_small else chunks
    for i, (a, b) in enumerate(ordered):
        if i < len(ordered) - 1:
            keys = [k for k, _ in slots[a:b]]
            keys = keys[::-1] if last_small else keys  # in the order the chunk filled
            assert len(keys) >= rows and keys.index(keys[-1]) < rows
        rows = min(top_rows, 2 * rows)


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


@given(
    cuts=st.lists(st.integers(0, 50), max_size=8),
    start=st.integers(0, 50),
    length=st.integers(0, 50),
)
def test_within_gives_the_parts_of_runs_inside_a_range(cuts, start, length):
    edges = sorted({0, 50, *cuts})
    runs = list(itertools.pairwise(edges))
    end = start + length
    parts = host_copy.within(runs, start, end)
    covered = [i for a, b in parts for i in range(a, b)]
    assert covered == list(range(start, min(end, 50)))
    assert all(any(a <= s and e <= b for a, b in runs) for s, e in parts)


def verifier(slots, bad, seen=None):
    """``verify`` of a load whose keys in ``bad`` fail their checksums."""

    def verify(a, b):
        if seen is not None:
            seen.append((a, b, threading.current_thread().name))
        time.sleep(0.0005)  # the copy side overtakes it now and then
        return next((i for i in range(a, b) if slots[i][0] in bad and slots[i][1] == 0), None)

    return verify


@settings(max_examples=200, deadline=None)
@given(
    widths=key_widths,
    rows=st.integers(1, 8),
    bad=st.sets(st.integers(0, 39), max_size=3),
    data=st.data(),
)
def test_verify_ahead_lets_through_exactly_the_rows_before_the_first_corrupt_key(
    widths, rows, bad, data
):
    slots = slots_of(widths)
    with chunk_sizes(rows, 2 * rows):
        chunks = host_copy.key_chunks(slots, 1)
    seen: list = []
    check = host_copy.VerifyAhead(chunks, verifier(slots, bad, seen))
    first_bad = next((i for i, (k, _) in enumerate(slots) if k in bad), len(slots))
    written, lo = 0, 0
    try:
        while lo < len(slots):  # spans as scatter_blocks cuts them, of any size
            hi = min(len(slots), lo + data.draw(st.integers(1, 6)))
            ok = check(lo, hi)
            assert 0 <= ok <= hi - lo
            written = lo + ok
            if ok < hi - lo:
                break
            lo = hi
    finally:
        check.close()
    assert written == first_bad  # never a row of a corrupt key, nor one after it
    assert check.bad == (first_bad if first_bad < len(slots) else None)
    if len(chunks) > 1:  # ahead of the copy, on the checksum thread
        assert {name for *_, name in seen} == {"raykv-checksum_0"}
    assert [(a, b) for a, b, _ in seen] == chunks[: len(seen)]


@settings(max_examples=100, deadline=None)
@given(
    widths=key_widths.filter(bool),
    rows=st.integers(1, 8),
    bad=st.sets(st.integers(0, 39), max_size=3),
    data=st.data(),
)
def test_verify_ahead_answers_spans_asked_from_several_threads_at_once(widths, rows, bad, data):
    """The copy's host threads ask for their own spans, in any order, at the same time: each
    span is allowed exactly its rows before the first corrupt key, whoever asks first."""
    from concurrent.futures import ThreadPoolExecutor

    slots = slots_of(widths)
    with chunk_sizes(rows, 2 * rows):
        chunks = host_copy.key_chunks(slots, 1)
    first_bad = next((i for i, (k, _) in enumerate(slots) if k in bad), len(slots))
    inner = (
        data.draw(st.sets(st.integers(1, len(slots) - 1), max_size=6)) if len(slots) > 1 else set()
    )
    spans = list(itertools.pairwise(sorted(inner | {0, len(slots)})))
    order = data.draw(st.permutations(spans))
    check = host_copy.VerifyAhead(chunks, verifier(slots, bad))
    try:
        with ThreadPoolExecutor(4) as pool:
            got = dict(zip(order, pool.map(lambda s: check(*s), order), strict=True))
    finally:
        check.close()
    assert all(n == max(0, min(hi, first_bad) - lo) for (lo, hi), n in got.items())


def test_verify_ahead_close_waits_for_verification_still_running():
    running, finished = threading.Event(), []

    def verify(a, b):
        running.set()
        time.sleep(0.05)
        finished.append(a)
        return None

    check = host_copy.VerifyAhead([(0, 1), (1, 2), (2, 3)], verify)
    running.wait(5)
    check.close()  # the copy failed early: nothing reads the arena once it returns
    time.sleep(0.1)
    assert finished == sorted(finished) and len(finished) >= 1
    after = list(finished)
    time.sleep(0.1)
    assert finished == after


@settings(max_examples=100, deadline=None)
@given(widths=key_widths, rows=st.integers(1, 8))
def test_store_hashes_each_chunk_on_the_checksum_thread_after_its_copy(widths, rows):
    slots = slots_of(widths)
    with chunk_sizes(rows, 4 * rows):
        chunks = host_copy.key_chunks(slots, 1, last_small=True)
    copied: set[int] = set()

    def copy(a, b):
        copied.update(range(a, b))

    def sums(a, b):
        assert set(range(a, b)) <= copied  # hashed only once copied
        assert threading.current_thread().name.startswith("raykv-checksum")
        return list(range(a, b))

    futures = host_copy.store_chunks(chunks, copy, sums)
    assert [x for f in futures for x in f.result()] == list(range(len(slots)))
    assert host_copy.store_chunks(chunks, copy, None) == []


def test_a_failed_store_copy_waits_for_the_hashing_started_before_it():
    finished = []

    def copy(a, b):
        if a == 2:
            raise RuntimeError("copy failed")

    def sums(a, b):
        time.sleep(0.05)
        finished.append(a)
        return [0] * (b - a)

    with pytest.raises(RuntimeError, match="copy failed"):
        host_copy.store_chunks([(0, 1), (1, 2), (2, 3)], copy, sums)
    assert finished == [0, 1]

"""Host copies split over the host threads (``raykv.ops.threads.side_by_side``): every row
moves exactly once, whatever the cut, and a task on a host thread never waits for the pool."""

from __future__ import annotations

import os
import threading
from concurrent.futures import wait
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_copy_cases import DTYPES, kv_entries, oracle_rows

from raykv.ops import gather_blocks, row_bytes, scatter_blocks
from raykv.ops import reference as ops_reference
from raykv.ops.threads import host_threads, in_parallel, on_host_thread, side_by_side

FAST = settings(max_examples=25, deadline=None)


@FAST
@given(
    lo=st.integers(0, 50),
    n=st.integers(0, 200),
    piece=st.integers(0, 40),
    threads=st.integers(1, 6),
)
def test_side_by_side_covers_every_index_once(lo, n, piece, threads):
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()

    def fn(a: int, b: int) -> None:
        with lock:
            seen.append((a, b))

    with mock.patch.dict(os.environ, {"RAYKV_HASH_THREADS": str(threads)}):
        side_by_side(fn, lo, lo + n, piece)
    covered = sorted(i for a, b in seen for i in range(a, b))
    assert covered == list(range(lo, lo + n))
    assert len(seen) <= max(1, threads)
    assert all(b - a >= min(n, max(1, piece)) for a, b in seen)  # no range below the piece


def test_side_by_side_on_a_host_thread_runs_inline():
    """Every host thread busy with a task that splits its own copy: each runs inline (with
    every thread waiting for the pool, nothing would ever run)."""
    calls: list[tuple[bool, int, int]] = []

    def task() -> None:
        side_by_side(lambda a, b: calls.append((on_host_thread(), a, b)), 0, 64, 1)

    futures = [in_parallel(task) for _ in range(2 * host_threads())]
    done, pending = wait(futures, timeout=30)
    assert not pending, "a task on a host thread waited for the pool"
    for f in done:
        f.result()
    assert calls == [(True, 0, 64)] * len(futures)


def test_side_by_side_raises_once_every_range_ended():
    ended: list[int] = []
    gate = threading.Event()

    def fn(a: int, b: int) -> None:
        if a == 0:
            raise ValueError("first range failed")
        gate.wait(5)
        ended.append(a)

    with mock.patch.dict(os.environ, {"RAYKV_HASH_THREADS": "3"}):
        timer = threading.Timer(0.2, gate.set)
        timer.start()
        with pytest.raises(ValueError, match="first range failed"):
            side_by_side(fn, 0, 30, 10)
    assert sorted(ended) == [10, 20]  # the other ranges had ended when the error came out


layouts = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["kv", "mla", "interleaved"]),
        "dtype": st.sampled_from(sorted(DTYPES)),
        "layers": st.integers(1, 3),
        "num_blocks": st.integers(2, 40),
        "seed": st.integers(0, 2**31 - 1),
        "piece_rows": st.integers(1, 5),
        "threads": st.integers(2, 5),
    }
)


@FAST
@given(case=layouts, data=st.data())
def test_split_host_copies_move_the_oracle_bytes(case, data):
    """Gather, scatter and a checked scatter, with the host copy cut into pieces of a few rows
    on several threads (each checking its own spans): the bytes of one plain copy; a checked
    scatter counts the rows before the first refused one, never writes a refused row, and
    writes nothing but the source's rows."""
    gen = torch.Generator().manual_seed(case["seed"])
    entries, _ = kv_entries(
        case["kind"], case["num_blocks"], 16, DTYPES[case["dtype"]], case["layers"], gen
    )
    width = row_bytes(entries)
    ids = data.draw(st.permutations(range(case["num_blocks"])))
    ids = ids[: data.draw(st.integers(1, len(ids)))]
    refused = data.draw(st.sets(st.integers(0, len(ids) - 1), max_size=3))  # rows that fail
    refuse = min(refused, default=len(ids))
    span = data.draw(st.integers(1, 3))  # rows per checked span
    env = {"RAYKV_HASH_THREADS": str(case["threads"])}
    piece = case["piece_rows"] * width
    with (
        mock.patch.dict(os.environ, env),
        mock.patch.object(ops_reference, "PARALLEL_PIECE_BYTES", piece),
        mock.patch.object(ops_reference, "CHECK_SPAN_BYTES", span * width),
    ):
        rows = torch.empty((len(ids), width), dtype=torch.uint8)
        gather_blocks(entries, torch.tensor(ids), rows)
        assert [bytes(r.numpy()) for r in rows] == oracle_rows(entries, ids)
        src = torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=gen)
        before = oracle_rows(entries, list(range(case["num_blocks"])))
        written = scatter_blocks(
            src,
            entries,
            torch.tensor(ids),
            check=lambda lo, hi: next((r for r in range(lo, hi) if r in refused), hi) - lo,
        )
    assert written == refuse
    assert oracle_rows(entries, ids[:refuse]) == [bytes(r.numpy()) for r in src[:refuse]]
    after = oracle_rows(entries, list(range(case["num_blocks"])))
    for i, b in enumerate(ids):  # a refused row is never written; a later one may be
        sent = bytes(src[i].numpy())
        assert after[b] == before[b] if i in refused else after[b] in (before[b], sent)
    kept = [b for b in range(case["num_blocks"]) if b not in ids]
    assert [after[b] for b in kept] == [before[b] for b in kept]

"""``raykv.transport``: a batch is one buffer; the receiver's ``verify`` keeps exactly the
leading blocks whose every copy matches its stored checksum."""

import asyncio
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.tiers.checksum import row_checksums
from raykv.transport import BlockBatch, base, export_rows, verify


def _batch(copies: int, n: int, seed: int) -> BlockBatch:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (copies, n, 64), generator=g, dtype=torch.uint8)
    sums = tuple(row_checksums(rows[c]) for c in range(copies))
    return BlockBatch(n, rows, sums)


@settings(max_examples=40, deadline=None)
@given(
    copies=st.integers(1, 3),
    n=st.integers(0, 12),
    flips=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 11), st.integers(0, 63))),
)
def test_verify_keeps_the_prefix_before_the_first_corrupt_row(copies, n, flips) -> None:
    b = _batch(copies, n, 1)
    bad = set()
    for c, i, j in flips:
        if c < copies and i < n:
            b.rows[c, i, j] ^= 0x80
            bad.add(i)
    want = min(bad, default=n)
    assert verify(b) == want
    # a head of the batch is the batch of its first blocks
    assert verify(b.head(want)) == want
    # the threaded check (pieces of 1 to 5 rows, side by side) finds the same prefix
    for rows_per_piece in range(1, 6):
        with mock.patch.object(base, "VERIFY_PIECE_BYTES", rows_per_piece * 64):
            assert asyncio.run(_soon(b)) == want


async def _soon(b: BlockBatch) -> int:
    return await base.verify_soon(b)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5), bad=st.integers(0, 30),
       fail_after=st.integers(0, 6))  # fmt: skip
def test_receive_writes_in_order_up_to_the_first_bad_row_and_keeps_what_came_before_a_failure(
    sizes, bad, fail_after
) -> None:
    """Chunks are verified ahead of the sink (on threads) but reach it in order; a bad row
    ends the fetch there; a stream that fails still delivers every chunk that arrived."""
    chunks, at = [], 0
    for k, size in enumerate(sizes):
        c = _batch(1, size, 10 + k)
        if at <= bad < at + size:
            c.rows[0, bad - at, 3] ^= 1
        chunks.append(c)
        at += size
    total = at

    async def stream():
        for k, c in enumerate(chunks):
            if k == fail_after:
                raise ConnectionError("peer died")
            await asyncio.sleep(0)
            yield c

    written: list[tuple[int, int]] = []

    async def sink(position: int, part: BlockBatch) -> None:
        await asyncio.sleep(0)
        written.append((position, part.count))

    done = base.Fetched()
    fails = fail_after < len(chunks)
    arrived = sum(sizes[:fail_after]) if fails else total
    want = min(bad, arrived)
    # the failure surfaces unless a bad row in an earlier chunk ended the fetch first
    last = sum(sizes[: fail_after - 1]) if fail_after else 0  # the last arrived chunk's start
    if fails and bad >= last:
        with pytest.raises(ConnectionError):
            asyncio.run(base.receive(stream(), sink, done))
    else:
        asyncio.run(base.receive(stream(), sink, done))
    assert done.count == want and done.corrupt == (bad < arrived)
    positions = [p for p, _ in written]
    assert positions == sorted(positions) and sum(n for _, n in written) == want


def test_the_wire_buffer_is_one_array_without_copies() -> None:
    b = _batch(2, 5, 2)
    wire = export_rows(b.rows)
    assert wire.shape == (2, 5, 64) and wire.ctypes.data == b.rows.data_ptr()
    assert b.nbytes == 2 * 5 * 64

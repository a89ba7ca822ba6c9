"""``raykv.transport.collective`` without Ray: two endpoints in one process (gloo, each on
its own pair thread) move blocks as one message, check them, and end a dead pair in time."""

import asyncio
import itertools
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.errors import TransportError
from raykv.tiers.checksum import row_checksums
from raykv.transport.collective import (
    Collective,
    Pair,
    check_wire,
    recv_blocks,
    send_blocks,
    serve_rendezvous,
    wire_sums,
)

W = 64  # row bytes: 2 entries of [4, 8] uint8 per block
_EXAMPLE = itertools.count()


@pytest.fixture(scope="module")
def store():
    s, host, port = serve_rendezvous("127.0.0.1")
    yield (host, port)
    del s


def pool(n: int = 12, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 256, (2, n, 4, 8), generator=g, dtype=torch.uint8)
    return [t[0], t[1]]  # K and V halves: two entries, one row = both


def rows_of(entries: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    return torch.cat([e[ids].reshape(len(ids), -1) for e in entries], dim=1)


def move(a, b, pair, src, dst, ids, into, expected=None):
    async def both():
        return await asyncio.gather(
            send_blocks(a, pair, src, ids, W), recv_blocks(b, pair, dst, into, W, expected)
        )

    return asyncio.run(both())


@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(1, 11), min_size=1, max_size=11, unique=True), st.randoms())
def test_blocks_arrive_byte_equal_as_one_message(store, ids, rnd) -> None:
    # a pair's rendezvous keys stay in the store: new endpoints (an actor's incarnation) or a
    # new generation form a new pair
    me = next(_EXAMPLE)
    a, b = Collective(f"src#{me}", "cpu", timeout_s=5), Collective(f"dst#{me}", "cpu", timeout_s=5)
    try:
        src, dst = pool(seed=len(ids)), pool(seed=99)
        into = rnd.sample(range(1, 12), len(ids))
        want = rows_of(src, ids)
        sent, got = move(a, b, Pair(a.ident, b.ident, 0, store), src, dst, ids, into,
                         row_checksums(want))  # fmt: skip
        assert got == len(ids) and sent == len(ids) * (W + 8)  # rows + one sum each
        assert torch.equal(rows_of(dst, into), want)
    finally:
        a.close()
        b.close()


def test_corrupt_in_flight_cuts_the_batch_and_the_next_generation_recovers(store) -> None:
    a, b = Collective("s#2", "cpu", timeout_s=3), Collective("d#2", "cpu", timeout_s=3)
    src, dst = pool(), pool(seed=7)
    before = dst[0].clone()

    def flip(buf: torch.Tensor) -> None:
        buf[2 * W + 5] ^= 0x10  # row 2, after its sum was taken

    a.tamper = flip
    _, got = move(a, b, Pair("s#2", "d#2", 0, store), src, dst, [1, 2, 3, 4], [5, 6, 7, 8])
    assert got == 2  # rows 0 and 1 landed, row 2 and after are misses
    assert torch.equal(rows_of(dst, [5, 6]), rows_of(src, [1, 2]))
    assert torch.equal(dst[0][[7, 8]], before[[7, 8]])  # never written
    # a receiver with no sender ends in bounded time, as TransportError
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="receive from s#2"):
        asyncio.run(recv_blocks(b, Pair("s#2", "d#2", 1, store), dst, [9], W))
    assert time.monotonic() - t0 < 12
    a.tamper = None
    _, got = move(a, b, Pair("s#2", "d#2", 2, store), src, dst, [3, 4], [7, 8])
    assert got == 2 and torch.equal(rows_of(dst, [7, 8]), rows_of(src, [3, 4]))
    a.close()
    b.close()


def test_wire_check_needs_both_the_sum_and_the_stored_checksum() -> None:
    rows = torch.randint(0, 256, (5, W), dtype=torch.uint8, generator=torch.Generator())
    sums = wire_sums(rows)
    stored = row_checksums(rows)
    assert check_wire(rows, sums, stored) == 5
    bad = list(stored)
    bad[3] ^= 1  # bytes that changed at rest, before the sender took its sum
    assert check_wire(rows, sums, bad) == 3
    swapped = rows.clone()
    swapped[1, :8], swapped[1, 8:16] = rows[1, 8:16], rows[1, :8]  # same words, other places
    assert check_wire(swapped, sums, None) == 1

"""``raykv.transport.collective`` without Ray: two endpoints in one process (gloo, each on
its own pair thread) move blocks as a few chunked messages, check them, and end a dead pair
in time."""

import asyncio
import itertools
import re
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv import ops
from raykv.errors import InvalidInput, TransportError
from raykv.tiers.checksum import row_checksums
from raykv.transport.collective import wire
from raykv.transport.collective.collective import Collective, pipeline_call
from raykv.transport.collective.pair import Pair, serve_rendezvous
from raykv.transport.collective.wire import (
    FIRST_CHUNK_BYTES,
    MAX_CHUNK_BYTES,
    SHARE_MIN_BYTES,
    WirePlan,
    count_intact,
    leading_matches,
    shares,
    wire_bytes,
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
            a.start_send(pair, src, ids, W), b.recv_batch(pair, dst, into, W, expected)
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

    def flip(msg: torch.Tensor) -> None:
        if msg.numel() == 4 * W + 4 * 8:  # the one message: 4 rows, their sums behind
            msg[2 * W + 5] ^= 0x10  # row 2, after its sum was taken

    a.tamper = flip
    _, got = move(a, b, Pair("s#2", "d#2", 0, store), src, dst, [1, 2, 3, 4], [5, 6, 7, 8])
    assert got == 2  # rows 0 and 1 landed, row 2 and after are misses
    assert torch.equal(rows_of(dst, [5, 6]), rows_of(src, [1, 2]))
    assert torch.equal(dst[0][:5], before[:5])  # blocks outside the batch untouched
    # a receiver with no sender ends in bounded time, as TransportError
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="receive from s#2"):
        asyncio.run(b.recv_batch(Pair("s#2", "d#2", 1, store), dst, [9], W))
    assert time.monotonic() - t0 < 12
    a.tamper = None
    _, got = move(a, b, Pair("s#2", "d#2", 2, store), src, dst, [3, 4], [7, 8])
    assert got == 2 and torch.equal(rows_of(dst, [7, 8]), rows_of(src, [3, 4]))
    a.close()
    b.close()


def test_wire_check_needs_both_the_sum_and_the_stored_checksum() -> None:
    rows = torch.randint(0, 256, (5, W), dtype=torch.uint8, generator=torch.Generator())
    stored = row_checksums(rows)
    assert count_intact(5, rows, stored) == 5
    bad = list(stored)
    bad[3] ^= 1  # bytes that changed at rest, before the sender took its sum
    assert count_intact(5, rows, bad) == 3
    assert count_intact(2, rows, stored) == 2  # the sums matched only so far
    sums = ops.row_sums(rows)
    assert int(leading_matches(sums, sums)) == 5
    off = sums.clone()
    off[2] += 1
    assert int(leading_matches(sums, off)) == 2
    swapped = rows.clone()
    swapped[1, :8], swapped[1, 8:16] = rows[1, 8:16], rows[1, :8]  # same words, other places
    assert (ops.row_sums(swapped) == ops.row_sums(rows)).tolist() == [1, 0, 1, 1, 1]


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5000), st.sampled_from([8, 64, 4096, 65536, 1 << 20]))
def test_wire_plan_covers_every_row_in_few_growing_messages(n, width) -> None:
    plan = WirePlan.of(n, width)
    assert plan.n == n and all(c > 0 for c in plan.counts)
    buf = torch.empty(plan.nbytes, dtype=torch.uint8)
    messages = plan.messages(buf)
    # one message per row chunk; the sums ride at the end of the last one
    assert [m.numel() for m in messages] == [c * width for c in plan.counts[:-1]] + [
        plan.counts[-1] * width + 8 * n
    ]
    assert sum(m.numel() for m in messages) == wire_bytes(n, width) == plan.nbytes
    assert messages[-1].data_ptr() + messages[-1].numel() == buf.data_ptr() + plan.nbytes
    rows, sums = plan.split(buf)
    assert rows.shape == (n, width) and sums.shape == (n,)
    first, top = max(1, FIRST_CHUNK_BYTES // width), max(1, MAX_CHUNK_BYTES // width)
    # the first message leaves early and the last lands soon: both a first chunk at most,
    # unless the whole batch is under two of them (one message)
    if n < 2 * first:
        assert plan.counts == (n,)
    else:
        assert plan.counts[0] == plan.counts[-1] == first
    # doubling up to MAX_CHUNK_BYTES and back: never one message per block, none over the cap
    doublings = (MAX_CHUNK_BYTES // FIRST_CHUNK_BYTES).bit_length()
    assert max(plan.counts) <= max(top, first)
    assert len(plan.counts) <= 2 * doublings + -(-n * width // MAX_CHUNK_BYTES)


def test_a_multi_chunk_batch_arrives_equal_and_a_bad_row_in_a_later_chunk_cuts_it(store) -> None:
    width, n = FIRST_CHUNK_BYTES // 64, 300  # messages of 64, 172 and 64 rows (+ the sums)
    assert WirePlan.of(n, width).counts == (64, 172, 64)
    g = torch.Generator().manual_seed(5)
    src = [torch.randint(0, 256, (n + 4, width), generator=g, dtype=torch.uint8)]
    dst = [torch.zeros(n + 4, width, dtype=torch.uint8)]
    ids, into = list(range(2, n + 2)), list(range(n + 3, 3, -1))[:n]
    a, b = Collective("s#mc", "cpu", timeout_s=10), Collective("d#mc", "cpu", timeout_s=10)
    try:
        pair = Pair(a.ident, b.ident, 0, store)

        def run() -> int:
            async def both():
                return await asyncio.gather(
                    a.start_send(pair, src, ids, width), b.recv_batch(pair, dst, into, width)
                )

            return asyncio.run(both())[1]

        assert run() == n and torch.equal(dst[0][into], src[0][ids])
        seen = []

        def flip(msg: torch.Tensor) -> None:
            seen.append(msg.numel())
            if len(seen) == 2:
                msg[10 * width + 7] ^= 1  # row 64 + 10 of the batch

        a.tamper = flip
        assert run() == 74
        assert seen == [64 * width, 172 * width, 64 * width + 8 * n]  # sums behind the last
    finally:
        a.close()
        b.close()


@given(st.integers(0, 5000), st.integers(1, 8), st.sampled_from([64, 1 << 20]))
def test_shares_cut_a_batch_into_consecutive_parts_even_ones_only_when_large(
    n, parts, width
) -> None:
    cuts = shares(n, parts, width)
    assert len(cuts) == parts and cuts[0].start == 0 and cuts[-1].stop == n
    assert all(a.stop == b.start for a, b in itertools.pairwise(cuts))
    if n * width >= parts * SHARE_MIN_BYTES:  # every share crosses as two messages or more
        assert max(map(len, cuts)) - min(map(len, cuts)) <= 1
        assert min(map(len, cuts)) * width >= SHARE_MIN_BYTES - width
    else:  # small: whole, from the first replica
        assert cuts[0] == range(n)


@pytest.fixture
def even_shares(monkeypatch):
    """Tiny rows crossing in shares, as a large batch does."""
    monkeypatch.setattr(wire, "SHARE_MIN_BYTES", 0)


def share_run(store, tp: int, n: int, tag: str, tamper=None, silent=(), timeout_s=5):
    """A copy ``tp`` replicas share: holder ranks ``A{j}`` send share j of ``n`` blocks (each
    from its own pool: the bytes tell which replica a row crossed from), reader ranks ``B{r}``
    receive theirs and pass it on. Returns (holder pools, reader pools, ids, into, counts,
    bytes each holder rank sent)."""
    a = [Collective(f"A{j}#{tag}", "cpu", timeout_s=timeout_s) for j in range(tp)]
    b = [Collective(f"B{r}#{tag}", "cpu", timeout_s=timeout_s) for r in range(tp)]
    src = [pool(n + 1, seed=10 + j) for j in range(tp)]
    dst = [pool(n + 1, seed=50 + r) for r in range(tp)]
    ids, into = list(range(1, n + 1)), list(range(n, 0, -1))
    replicas = [c.ident for c in b]
    if tamper is not None:
        a[-1].tamper = tamper
    cuts = shares(n, tp, W)

    async def run():
        sends = [a[j].start_send(Pair(a[j].ident, b[j].ident, 0, store), src[j],
                                 ids[cuts[j].start : cuts[j].stop], W)
                 for j in range(tp) if cuts[j] and j not in silent]  # fmt: skip
        recvs = [b[r].recv_shares(Pair(a[r].ident, b[r].ident, 0, store), replicas, dst[r],
                                  into, W) for r in range(tp)]  # fmt: skip
        out = await asyncio.gather(*sends, *recvs, return_exceptions=bool(silent))
        return out[len(sends) :], out[: len(sends)]

    try:
        counts, sent = asyncio.run(run())
    finally:
        for c in a + b:
            c.close()
    return src, dst, ids, into, counts, sent


@pytest.mark.parametrize("tp,n,split", [(2, 7, True), (3, 8, True), (2, 1, True), (2, 5, False)])
def test_a_replicated_copy_crosses_once_in_shares_and_every_replica_gets_all_of_it(
    store, monkeypatch, tp, n, split
) -> None:
    if split:
        monkeypatch.setattr(wire, "SHARE_MIN_BYTES", 0)
    src, dst, ids, into, counts, sent = share_run(store, tp, n, f"s{tp}{n}{split}")
    cuts = shares(n, tp, W)
    assert len([c for c in cuts if c]) == (min(tp, n) if split else 1)  # small: one, whole
    want = torch.cat([rows_of(src[j], ids[c.start : c.stop]) for j, c in enumerate(cuts) if c])
    assert counts == [n] * tp
    for r in range(tp):  # share j from holder replica j, on every reader replica
        assert torch.equal(rows_of(dst[r], into), want)
    # one copy crossed between the groups: each holder rank sent its share only
    assert sent == [len(c) * (W + 8) for c in cuts if c]


def test_a_corrupt_share_ends_the_intact_count_on_every_replica(store, even_shares) -> None:
    def flip(msg: torch.Tensor) -> None:
        msg[W + 3] ^= 0x01  # the last share's second row, after its sum was taken

    *_, counts, _ = share_run(store, 2, 6, "bad", tamper=flip)
    assert counts == [4, 4]  # share 0 (3 rows) and the first row of share 1


def test_a_holder_replica_that_never_sends_fails_every_reader_replica_in_bounded_time(
    store, even_shares
) -> None:
    """A1 dies before its share leaves: B1 never gets it, so neither does B0 (B1 passes it
    on); both end with TransportError within their bounded waits, never a hang."""
    t0 = time.monotonic()
    *_, counts, sent = share_run(store, 2, 6, "mute", silent=(1,), timeout_s=2)
    assert len(sent) == 1 and all(isinstance(c, TransportError) for c in counts), counts
    assert time.monotonic() - t0 < 15


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.randoms(use_true_random=False))
def test_a_change_of_any_word_changes_its_row_sum_and_no_other(n, words, rnd) -> None:
    g = torch.Generator().manual_seed(rnd.randrange(1 << 30))
    rows = torch.randint(0, 256, (n, 8 * words), generator=g, dtype=torch.uint8)
    i, byte = rnd.randrange(n), rnd.randrange(8 * words)
    bad = rows.clone()
    bad[i, byte] ^= 1 << rnd.randrange(8)
    before, after = ops.row_sums(rows), ops.row_sums(bad)
    assert [int(x) for x in (before != after)] == [int(r == i) for r in range(n)]


def test_chunked_copies_call_back_in_order_around_each_chunk() -> None:
    g = torch.Generator().manual_seed(4)
    t = torch.randint(0, 256, (2, 12, 4, 8), generator=g, dtype=torch.uint8)
    entries, ids = [t[0], t[1]], torch.tensor([3, 1, 7, 0, 11])
    rows = torch.zeros(5, W, dtype=torch.uint8)
    sums = torch.empty(5, dtype=torch.int64)
    seen = []

    def after(start: int, count: int) -> None:  # a gather's chunk is complete here
        seen.append(
            (
                start,
                count,
                torch.equal(
                    rows[start : start + count],
                    rows_of(entries, ids[start : start + count].tolist()),
                ),
            )
        )

    ops.gather_blocks(entries, ids, rows, sums=sums, chunks=[2, 1, 2], each=after)
    assert seen == [(0, 2, True), (2, 1, True), (3, 2, True)]
    assert torch.equal(sums, ops.row_sums(rows))
    into, fresh = torch.tensor([2, 4, 5, 6, 8]), torch.zeros(5, W, dtype=torch.uint8)

    def before(start: int, count: int) -> None:  # a scatter's chunk arrives here
        fresh[start : start + count] = rows[start : start + count]

    back = torch.empty(5, dtype=torch.int64)
    ops.scatter_blocks(fresh, entries, into, sums=back, chunks=[1, 4], each=before)
    assert torch.equal(rows_of(entries, into.tolist()), rows) and torch.equal(back, sums)
    with pytest.raises(Exception, match="must be positive row counts summing to the 5"):
        ops.gather_blocks(entries, ids, rows, chunks=[2, 2])


def test_copies_take_the_wire_sums_of_the_rows_they_move() -> None:
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, 256, (2, 12, 4, 8), generator=g, dtype=torch.uint8)
    entries, ids = [t[0], t[1]], torch.tensor([3, 1, 7])
    rows = torch.empty(3, W, dtype=torch.uint8)
    sums = torch.empty(3, dtype=torch.int64)
    ops.gather_blocks(entries, ids, rows, sums=sums)
    assert torch.equal(sums, ops.row_sums(rows)) and torch.equal(rows, rows_of(entries, [3, 1, 7]))
    back = torch.empty(3, dtype=torch.int64)
    ops.scatter_blocks(rows, entries, torch.tensor([9, 10, 11]), sums=back)
    assert torch.equal(back, sums)
    with pytest.raises(Exception, match="sums must be a contiguous int64"):
        ops.gather_blocks(entries, ids, rows, sums=torch.empty(2, dtype=torch.int64))


def test_the_pipeline_table_is_built_once_per_entries_list_and_again_when_the_list_changes(
    monkeypatch,
) -> None:
    """A pool passes the same entries list every batch: its checks and segment table are
    made once (``ops.wire_table``); a list changed in place (an entry added or replaced) is
    looked at again, and a row width that is not the entries' is refused."""
    built: list[list[torch.Tensor]] = []

    def fake_table(entries):
        built.append(list(entries))
        return ops.WireTable(None, None, 10, sum(e[0].numel() for e in entries), 1)

    monkeypatch.setattr(ops, "wire_table", fake_table)
    c = Collective("t#table", "cpu", timeout_s=5)
    c.backend = "nccl"  # the table only matters where the C++ NCCL pipeline runs
    entries = [torch.zeros(10, 64, dtype=torch.uint8)]
    first = c._wire_table(entries, 64)
    assert c._wire_table(entries, 64) is first and len(built) == 1
    assert c._wire_table(list(entries), 64) is not first and len(built) == 2  # another list
    entries.append(torch.zeros(10, 8, dtype=torch.uint8))
    assert c._wire_table(entries, 72).width == 72 and len(built) == 3
    entries[0] = torch.zeros(10, 64, dtype=torch.uint8)  # same shapes, another tensor
    assert c._wire_table(entries, 72) is not None and len(built) == 4
    with pytest.raises(InvalidInput, match="rows of 64 bytes, but one block of every entry is 72"):
        c._wire_table(entries, 64)
    c.close()


def test_the_pipelines_bad_id_codes_are_worded_as_invalid_input() -> None:
    """The C++ pipeline reports the first bad block id as ``position * 4 + reason`` (it
    formats no message and throws nothing); the caller raises InvalidInput naming the id, its
    position and the pool's size, and passes every other result through."""
    ids = [3, 99, 3]
    cases = {
        1 * 4 + 2: "block id 99 (position 1) is outside the pool's 16 blocks; ids must lie in "
        "[0, 15]",
        2 * 4 + 3: "block id 3 appears more than once",
        0 * 4 + 1: "block id at position 0 is not an int",
    }
    for code, words in cases.items():
        with pytest.raises(InvalidInput, match=re.escape(words)):
            pipeline_call(lambda *a, c=code: c, "collective receive", 0, 0, None, ids, 16)
    assert pipeline_call(lambda *a: -1, "collective send", 0, 1, None, ids, 16) is None
    marker = torch.zeros(1)
    assert pipeline_call(lambda *a: marker, "collective receive", 0, 0, None, ids, 16) is marker

"""``raykv.transport``: a batch is one buffer; the receiver's ``verify`` keeps exactly the
leading blocks whose every copy matches its stored checksum."""

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
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
            assert asyncio.run(base.RowCheck(b).rest()) == want


@settings(max_examples=60, deadline=None)
@given(
    copies=st.integers(1, 3),
    n=st.integers(1, 16),
    flips=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 15)), max_size=3),
    data=st.data(),
)
def test_receive_with_a_write_hands_on_only_rows_checked_and_intact(copies, n, flips, data):
    """A reader's ``write`` copies the chunk's rows, checking the spans it copies (any spans,
    any order, on several threads) and skipping others (rows landed in place); ``receive``
    checks every row it skipped, and the sink gets exactly the rows before the first corrupt
    one: never a row that failed, whoever checked it."""
    b = _batch(copies, n, 3)
    bad = {i for c, i in flips if c < copies and i < n}
    for c, i in flips:
        if c < copies and i < n:
            b.rows[c, i, 5] ^= 0x10
    want = min(bad, default=n)
    inner = data.draw(st.sets(st.integers(1, n - 1), max_size=4)) if n > 1 else set()
    cuts = sorted(inner | {0, n})
    spans = [(c, a, z) for c in range(copies) for a, z in itertools.pairwise(cuts)]
    checked = data.draw(st.lists(st.sampled_from(spans), unique=True)) if spans else []
    seen: dict[tuple[int, int, int], int] = {}  # span -> rows its check passed

    async def write(at: int, rows: BlockBatch, check: base.RowCheck) -> None:
        def run(c: int, a: int, z: int) -> None:
            seen[(c, a, z)] = check.span(c, a)(0, z - a)

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda s: run(*s), checked))

    got: list[BlockBatch] = []

    async def sink(at: int, rows: BlockBatch) -> None:
        got.append(rows)

    async def stream():
        yield b

    done = asyncio.run(base.receive(stream(), sink, write=write))
    assert done.count == want and done.corrupt == (want < n)
    assert sum(g.count for g in got) == want
    # each span's check passed exactly its rows before the copy's first corrupt one
    for (c, a, z), ok in seen.items():
        assert ok == next((r for r in range(a, z) if (c, r) in flips), z) - a


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=5), bad=st.integers(0, 30),
       fail_after=st.integers(0, 6))  # fmt: skip
def test_receive_hands_verified_chunks_in_order_one_taken_ahead_at_most(
    sizes, bad, fail_after
) -> None:
    """Chunks reach the sink in order, each written first at the position that follows the
    chunks before it; at most one chunk is taken ahead of the sink; a bad row ends the
    fetch there (one chunk after it taken at most, never handed on); a stream that fails
    has delivered every chunk that arrived before it."""
    chunks, at = [], 0
    for k, size in enumerate(sizes):
        c = _batch(1, size, 10 + k)
        if at <= bad < at + size:
            c.rows[0, bad - at, 3] ^= 1
        chunks.append(c)
        at += size
    taken: list[int] = []

    async def stream():
        for k, c in enumerate(chunks):
            if k == fail_after:
                raise ConnectionError("peer died")
            taken.append(k)
            yield c

    written: list[tuple[int, int]] = []
    handed: list[tuple[int, int]] = []

    async def write(position: int, rows: BlockBatch, check) -> None:
        written.append((position, rows.count))

    async def sink(position: int, part: BlockBatch) -> None:
        assert len(taken) <= len(handed) + 2  # this chunk and one more at most
        assert written[len(handed)][0] == position  # written there first
        handed.append((position, part.count))

    done = base.Fetched()
    arrived = sum(sizes[:fail_after])
    if bad >= arrived and fail_after < len(chunks):
        with pytest.raises(ConnectionError):
            asyncio.run(base.receive(stream(), sink, done, write))
    else:
        asyncio.run(base.receive(stream(), sink, done, write))
    assert done.count == min(bad, arrived) and done.corrupt == (bad < arrived)
    assert [p for p, _ in handed] == list(itertools.accumulate([0] + [n for _, n in handed]))[:-1]
    assert [p for p, _ in written] == list(itertools.accumulate([0, *sizes]))[: len(taken)]
    last = min(fail_after, len(chunks))  # chunks the stream gives
    if bad < arrived:  # the chunk with the bad row, and one after it at most, were taken
        kb = next(k for k in range(len(sizes)) if bad < sum(sizes[: k + 1]))
        assert kb + 1 <= len(taken) <= min(kb + 2, last)
    else:
        assert len(taken) == last


def test_receive_hands_a_chunk_on_before_the_next_arrives() -> None:
    """A chunk is verified and handed on while the stream waits for the next one (a stalled
    source still leaves what arrived stored)."""
    first, second = _batch(1, 3, 1), _batch(1, 2, 2)

    async def run() -> list[int]:
        handed: list[int] = []
        seen = asyncio.Event()

        async def stream():
            yield first
            await seen.wait()  # the next chunk comes only once the first was handed on
            yield second

        async def sink(position: int, part: BlockBatch) -> None:
            handed.append(position)
            seen.set()

        await asyncio.wait_for(base.receive(stream(), sink), 10)
        return handed

    assert asyncio.run(run()) == [0, 3]


def test_a_sink_that_fails_ends_the_fetch_with_its_error() -> None:
    """A sink's error (a reader freed mid-load) ends the fetch with that error: one chunk
    taken after it at most, the stream closed, nothing after handed on."""
    chunks = [_batch(1, 2, k) for k in range(4)]
    taken, closed, handed = [], [], []

    async def stream():
        try:
            for k, c in enumerate(chunks):
                taken.append(k)
                yield c
        finally:
            closed.append(True)

    async def sink(position: int, part: BlockBatch) -> None:
        handed.append(position)
        raise LookupError("the reader's blocks were freed")

    with pytest.raises(LookupError):
        asyncio.run(base.receive(stream(), sink))
    assert handed == [0] and len(taken) <= 2 and closed == [True]


def test_receive_verifies_the_next_chunk_while_the_sink_copies_the_one_before(monkeypatch):
    first, second = _batch(1, 3, 1), _batch(1, 2, 2)
    started: list[int] = []
    real = base.RowCheck.rest

    async def rest(self) -> int:
        started.append(self.batch.count)
        return await real(self)

    monkeypatch.setattr(base.RowCheck, "rest", rest)

    async def run() -> base.Fetched:
        async def stream():
            yield first
            yield second

        async def sink(position: int, part: BlockBatch) -> None:
            while position == 0 and len(started) < 2:  # the first chunk's copy is slow
                await asyncio.sleep(0.001)

        return await asyncio.wait_for(base.receive(stream(), sink), 10)

    done = asyncio.run(run())
    assert done.count == 5 and not done.corrupt and started == [3, 2]


def test_the_wire_buffer_is_one_array_without_copies() -> None:
    b = _batch(2, 5, 2)
    wire = export_rows(b.rows)
    assert wire.shape == (2, 5, 64) and wire.ctypes.data == b.rows.data_ptr()
    assert b.nbytes == 2 * 5 * 64


def test_direct_transports_refuse_a_streamed_fetch_and_say_why() -> None:
    import asyncio

    from raykv.errors import TransportError
    from raykv.transport.collective import Collective, CollectiveTransport
    from raykv.transport.peer_read import PeerTransport

    async def first(t) -> None:
        async for _ in t.stream("src", "m", [b"k"]):
            pass

    for t, says in (
        (CollectiveTransport(Collective("me", "cpu")), "rank to rank"),
        (PeerTransport("node", ("m", 1, 64)), "peer reads"),
    ):
        assert t.direct
        with pytest.raises(TransportError, match=f"{says}.*use the object store"):
            asyncio.run(first(t))


def test_fetch_over_takes_each_route_in_turn_direct_ones_through_the_reader() -> None:
    """A failed peer read goes over the next route both ends offer (NCCL, named in the peer
    route's endpoint), a failed pair over the object store, which streams the batch; each
    failure is told with the route taken next. A direct route that works ends the fetch."""
    from raykv.errors import TransportError
    from raykv.transport import FALLBACK, Fetched, fetch_over
    from raykv.transport.select import NCCL, PEER

    batch = _batch(1, 2, seed=3)

    class Direct(base.DirectTransport):
        instead = "lands rank to rank (test)"

        def __init__(self, name: str) -> None:
            self.name = name

    class Store:
        name, direct = FALLBACK, False

        async def stream(self, source, model, keys, *rest):
            yield batch

    transports = {PEER: Direct(PEER), NCCL: Direct(NCCL), FALLBACK: Store()}
    endpoint = {"then": (NCCL, {"store": ("h", 1)})}
    tried, told, got_rows = [], [], []

    async def direct(name, ep, fail=(PEER, NCCL)) -> Fetched:
        tried.append((name, ep))
        if name in fail:
            raise TransportError(f"{name} down (test)")
        return Fetched(2, 8)

    async def sink(at, chunk) -> None:
        got_rows.append((at, chunk.count))

    def fell_back(name, e, then) -> None:
        told.append((name, then))

    def fetch(**kw) -> Fetched:
        keys = [b"a", b"b"]
        return asyncio.run(fetch_over(transports, PEER, "src", "m", keys, sink, endpoint,
                                      fell_back, **kw))  # fmt: skip

    got = fetch(direct=direct)
    assert tried == [(PEER, endpoint), (NCCL, {"store": ("h", 1)})]
    assert told == [(PEER, NCCL), (NCCL, FALLBACK)]
    assert (got.count, got.nbytes, got.corrupt, got_rows) == (2, 128, False, [(0, 2)])

    tried.clear()
    assert fetch(direct=lambda n, ep: direct(n, ep, fail=(PEER,))) == Fetched(2, 8)
    assert [n for n, _ in tried] == [PEER, NCCL]

    told.clear()  # a reader without a direct path: the route is refused, the store streams
    assert fetch().count == 2 and told == [(PEER, FALLBACK)]


def test_fetch_over_tells_the_bytes_each_route_carried() -> None:
    """``carried`` gets each route's verified bytes, once: a direct route that works (not the
    ones that failed before it), a stream, and a stream that failed midway: what it delivered
    is its own, the rest the object store's (the reader's ``raykv_fetched_bytes``)."""
    from raykv.errors import TransportError
    from raykv.transport import FALLBACK, Fetched, fetch_over
    from raykv.transport.select import NCCL, PEER, UCX

    chunks = [_batch(1, 2, seed=k) for k in range(3)]  # 2 rows of 64 bytes each

    class Direct(base.DirectTransport):
        instead = "lands rank to rank (test)"

        def __init__(self, name: str) -> None:
            self.name = name

    class Stream:
        direct = False

        def __init__(self, name: str, fail_after: int | None = None) -> None:
            self.name, self.fail_after = name, fail_after

        async def stream(self, source, model, keys, *rest):
            for k in range(len(keys) // 2):
                if k == self.fail_after:
                    raise TransportError(f"{self.name} down (test)")
                yield chunks[k]

    async def direct(name, endpoint) -> Fetched:
        if name == PEER:
            raise TransportError("peer read down (test)")
        return Fetched(2, 256)

    async def sink(at, chunk) -> None:
        pass

    def fetch(name: str, ucx: Stream, **kw) -> list[tuple[str, int]]:
        told: list[tuple[str, int]] = []
        transports = {PEER: Direct(PEER), NCCL: Direct(NCCL), UCX: ucx, FALLBACK: Stream(FALLBACK)}
        keys = [bytes([k]) for k in range(6)]
        endpoint = {"then": (NCCL, None)}
        asyncio.run(fetch_over(transports, name, "src", "m", keys, sink, endpoint,
                               carried=lambda *t: told.append(t), **kw))  # fmt: skip
        return told

    assert fetch(PEER, Stream(UCX), direct=direct) == [(NCCL, 256)]
    assert fetch(UCX, Stream(UCX)) == [(UCX, 384)]
    assert fetch(UCX, Stream(UCX, fail_after=1)) == [(UCX, 128), (FALLBACK, 256)]
    assert fetch(UCX, Stream(UCX, fail_after=0)) == [(UCX, 0), (FALLBACK, 384)]

"""``CpuTierActor.pull`` driven in-process (no Ray) over a stand-in transport that streams
chunks: entries are reserved up front and each verified chunk is written as it arrives; after
the last, the entries whose every row arrived are stored (with their checksums) and published,
every other reserved entry is released. A row that fails its checksum mid-batch ends the pull
there (the leading intact entries only, the source told to drop the bad one); a source that
dies mid-transfer leaves no half-written entry readable and nothing reserved. Entries are
reserved while the locate is out; the member the last answer named first is asked before
either, and the pull's own work waits until that request is sent."""

import asyncio
import threading
import time

import pytest
import ray
import torch

from raykv.errors import TransportError
from raykv.layout import FullAttention
from raykv.service.control.index import CPU, Located, Location
from raykv.service.served import ServedModel
from raykv.service.tier.actor import CpuTierActor
from raykv.tiers.checksum import row_checksums
from raykv.transport import OBJECT_STORE, BlockBatch

BS, ROW = 16, 2 * 16 * 1 * 16 * 4  # one layer: K,V x 16 tokens x 1 head x 16 x 4 bytes
LAYERS = {"l0": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16)}
SOURCE = "raykv-tier-elsewhere"
N = 12  # blocks pulled: 6 entries of 2 blocks


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class Coordinator:
    """``locate``: every key on the other tier; records what the tier publishes."""

    def __init__(self) -> None:
        self.stored: list = []
        self.locate = _Method(self._locate)
        self.events = _Method(self._events)

    async def _locate(self, model, keys, node_id, reader=None):
        await asyncio.sleep(0)  # a call out, answered later (as Ray's)
        return Located([[Location(SOURCE, "other-node", CPU)] for _ in keys])

    async def _events(self, name, seq, model, keys, blocks, removed):
        self.stored += keys
        return True


class Source:
    """The other tier, as the fallback transport reaches it (``drop_keys``)."""

    def __init__(self) -> None:
        self.dropped: list = []
        self.drop_keys = _Method(lambda model, keys: self.dropped.extend(keys))


class Streaming:
    """Streams ``rows`` in chunks of ``chunk`` rows; ``corrupt``: a row index whose bytes
    differ from what its checksum says; ``die_after``: chunks sent before the source dies."""

    name = OBJECT_STORE

    def __init__(self, rows, chunk, corrupt=None, die_after=None) -> None:
        self.rows, self.chunk, self.corrupt, self.die_after = rows, chunk, corrupt, die_after
        self.source, self.sent, self.closed = Source(), 0, False

    def actor(self, name):
        return self.source

    async def stream(self, source, model, keys, endpoint=None, land=None, asked=None):
        try:
            idx = [int.from_bytes(k[4:], "little") for k in keys]  # key i: row i
            for at in range(0, len(idx), self.chunk):
                if self.die_after is not None and self.sent >= self.die_after:
                    raise TransportError("the source died mid-transfer")
                part = self.rows[idx[at : at + self.chunk]].clone()
                sums = row_checksums(part)
                for j, i in enumerate(idx[at : at + self.chunk]):
                    if i == self.corrupt:
                        part[j, 5] ^= 0xFF
                self.sent += 1
                yield BlockBatch(len(part), part.unsqueeze(0), (tuple(sums),))
                await asyncio.sleep(0)
        finally:
            self.closed = True


@pytest.fixture
def tier(monkeypatch):
    model = ServedModel("p", LAYERS, max_model_len=14 * BS, pool_bytes=16 * ROW,
                        cpu_bytes=16 * ROW, offload_block_size=2 * BS)  # fmt: skip
    plan = model.plan(model.pool_bytes)
    assert plan.block_size_factor == 2
    t = CpuTierActor("this-node", {"p": plan})
    t.coord = Coordinator()
    monkeypatch.setattr(ray, "get_actor", lambda *a, **k: t.coord)
    return t


async def pulled(t, ks) -> int:
    """``t.pull`` of ``ks``, then its publication, which runs after the pull answers."""
    got = await t.pull("p", ks)
    await asyncio.gather(*t._publishing)
    return got


def keys(n: int = N) -> list[bytes]:
    return [bytes([0, 0, 0, 0]) + i.to_bytes(28, "little") for i in range(n)]


def data(n: int = N) -> torch.Tensor:
    return torch.randint(0, 256, (n, ROW), generator=torch.Generator().manual_seed(1),
                         dtype=torch.uint8)  # fmt: skip


def held(t, ks) -> list[bytes]:
    return [k for k in ks if k in t.tiers["p"].where]


def used(t) -> int:
    tier = t.tiers["p"].tier
    return tier.num_blocks - tier.num_free


def arena_rows(t, ks) -> torch.Tensor:
    mt = t.tiers["p"]
    lease = mt.tier.prepare_load(list(dict.fromkeys(e for e, _ in mt.choose(ks))))
    try:
        at = {e: i for i, e in enumerate(lease.keys)}
        return torch.stack([mt.tier.rows(0)[mt.tier.row(lease.blocks[at[e]], s)]
                            for e, s in mt.choose(ks)])  # fmt: skip
    finally:
        mt.tier.finish_load(lease)


def test_a_streamed_pull_stores_every_chunk_verified(tier) -> None:
    rows, ks = data(), keys()
    tier.transports = {OBJECT_STORE: Streaming(rows, chunk=5)}  # chunks straddle entries
    assert asyncio.run(pulled(tier, ks)) == N
    assert held(tier, ks) == ks and sorted(tier.coord.stored) == sorted(ks)
    assert torch.equal(arena_rows(tier, ks), rows)
    assert tier.transports[OBJECT_STORE].sent == 3 and used(tier) == N // 2
    mt = tier.tiers["p"]
    lease = mt.tier.prepare_load([ks[1]])
    assert lease.checksums[0][0] == tuple(row_checksums(rows[:2]))  # stored with its sums
    mt.tier.finish_load(lease)


def test_a_corrupt_row_mid_batch_keeps_the_leading_intact_entries_only(tier) -> None:
    rows, ks = data(), keys()
    t = Streaming(rows, chunk=4, corrupt=7)  # chunk 2 (rows 4..7): 4..6 good, 7 bad
    tier.transports = {OBJECT_STORE: t}
    assert asyncio.run(pulled(tier, ks)) == 6  # entries 0..2; entry 3 (rows 6, 7) is not
    assert held(tier, ks) == ks[:6] and sorted(tier.coord.stored) == sorted(ks[:6])
    assert torch.equal(arena_rows(tier, ks[:6]), rows[:6])
    # the stream was closed at the bad row: the chunk after it was taken (and written into
    # rows that were released, never readable), nothing after that
    assert t.closed and t.sent == 3
    assert t.source.dropped == [ks[7]]  # the source drops its bad copy
    assert used(tier) == 3  # entry 3 (row 6 written, 7 not) and the rest were released
    assert tier.metrics.tally["checksum_errors"] == 1


def test_a_source_dying_mid_transfer_publishes_no_half_written_entry(tier) -> None:
    rows, ks = data(), keys()
    t = Streaming(rows, chunk=3, die_after=1)  # rows 0..2 arrive: entry 0 whole, entry 1 half
    tier.transports = {OBJECT_STORE: t}
    assert asyncio.run(pulled(tier, ks)) == 2
    assert held(tier, ks) == ks[:2] and sorted(tier.coord.stored) == sorted(ks[:2])
    assert torch.equal(arena_rows(tier, ks[:2]), rows[:2])
    assert used(tier) == 1  # entry 1 (row 2 of rows 2, 3) and the rest were released
    mt = tier.tiers["p"]
    assert not mt.pending and all(mt.tier.state(k) is None for k in ks[3::2])
    # the keys are misses, not stuck: a later pull from a healthy source takes them
    tier.transports = {OBJECT_STORE: Streaming(rows, chunk=4)}
    assert asyncio.run(pulled(tier, ks)) == N
    assert torch.equal(arena_rows(tier, ks), rows)


def test_a_pull_cancelled_mid_transfer_releases_what_it_reserved(tier) -> None:
    rows, ks = data(), keys()

    class Stalling(Streaming):
        async def stream(self, source, model, keys, endpoint=None, land=None, asked=None):
            yield BlockBatch(2, rows[:2].unsqueeze(0), (tuple(row_checksums(rows[:2])),))
            await asyncio.sleep(3600)  # the source stalls; the caller gives up

    tier.transports = {OBJECT_STORE: Stalling(rows, chunk=2)}

    async def run():
        task = asyncio.ensure_future(tier.pull("p", ks))
        await asyncio.sleep(0.2)
        assert used(tier) == N // 2  # reserved up front, none readable yet
        assert held(tier, ks) == []
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert used(tier) == 1 and held(tier, ks) == ks[:2]  # the whole entry it got; the rest freed


def test_entries_are_reserved_while_the_locate_is_out_and_those_nobody_holds_released(
    tier,
) -> None:
    rows, ks = data(), keys()
    seen = []

    async def locate(model, keys_, node_id, reader=None):
        seen.append(used(tier))  # the call is out before the reservation is made ...
        await asyncio.sleep(0.05)
        seen.append(used(tier))  # ... which is made while it is
        return Located([[Location(SOURCE, "other-node", CPU)] if i < 7 else []
                        for i in range(len(keys_))])  # fmt: skip

    tier.coord.locate = _Method(locate)
    tier.transports = {OBJECT_STORE: Streaming(rows, chunk=4)}
    assert asyncio.run(pulled(tier, ks)) == 6  # whole entries only: row 6's entry needs 7
    assert seen == [0, N // 2]
    assert held(tier, ks) == ks[:6] and sorted(tier.coord.stored) == sorted(ks[:6])
    assert used(tier) == 3 and not tier.tiers["p"].pending  # the 3 nobody holds: released
    assert torch.equal(arena_rows(tier, ks[:6]), rows[:6])


class BySource:
    """The fallback transport by source: ``SOURCE`` streams from ``full`` (a ``Streaming``),
    any other member through ``other(source, keys)`` (an async generator), or holds nothing."""

    name = OBJECT_STORE

    def __init__(self, full, other=None) -> None:
        self.full, self.other = full, other

    def actor(self, name):
        return self.full.source

    async def stream(self, source, model, keys, endpoint=None, land=None, asked=None):
        rows = self.full.stream(source, model, keys) if source == SOURCE else None
        if rows is None and self.other is not None:
            rows = self.other(source, keys)
        if rows is not None:
            async for b in rows:
                yield b


def test_the_last_answers_first_copy_is_asked_while_the_locate_is_out(tier) -> None:
    rows, ks = data(), keys()
    seen = []

    async def locate(model, keys_, node_id, reader=None):
        await asyncio.sleep(0.05)
        seen.append(stream.sent)  # chunks received when the answer comes
        return Located([[Location(SOURCE, "other-node", CPU)] for _ in keys_])

    tier.coord.locate = _Method(locate)
    stream = Streaming(rows, chunk=4)
    tier.transports = {OBJECT_STORE: stream}
    assert asyncio.run(pulled(tier, ks[:4])) == 4  # no pull before: the answer is waited for
    assert asyncio.run(pulled(tier, ks)) == N  # the rest: from SOURCE, asked right away
    assert seen == [0, 3]  # the second pull's 2 chunks were in before its answer
    assert torch.equal(arena_rows(tier, ks), rows)
    assert sorted(tier.coord.stored) == sorted(ks)


def test_a_remembered_source_that_lost_the_keys_or_its_route_costs_nothing_but_the_ask(tier):
    rows, ks = data(), keys()

    class Broken:
        name, calls = "ucx", 0

        async def stream(self, source, model, keys, endpoint=None, land=None, asked=None):
            Broken.calls += 1
            raise TransportError("the remembered route is gone")
            yield

    full = Streaming(rows, chunk=4)
    tier.transports = {OBJECT_STORE: BySource(full), "ucx": Broken()}
    tier.pull_sources["p"] = Location("raykv-tier-gone", "n", CPU)  # holds nothing now
    assert asyncio.run(pulled(tier, ks[:4])) == 4
    assert tier.pull_sources["p"].member == SOURCE  # the answer's first copy, remembered
    tier.pull_sources["p"] = Location(SOURCE, "other-node", CPU, "ucx")  # a route that fails
    assert asyncio.run(pulled(tier, ks)) == N
    assert Broken.calls == 1 and full.sent == 1 + 2  # asked once, not over the fallback
    tally = tier.metrics.tally  # a guess that failed is no failure, and is not retried
    assert tally["failed_pull"] == 0 and tally["failures_transport_ucx"] == 0
    assert torch.equal(arena_rows(tier, ks), rows)


def test_a_remembered_source_the_answer_does_not_name_is_given_up_mid_stream(tier) -> None:
    rows, ks = data(), keys()
    full, closed = Streaming(rows, chunk=4), []

    async def stalls(source, keys):  # the remembered member sends 2 rows, then stalls
        try:
            part = rows[[int.from_bytes(k[4:], "little") for k in keys[:2]]]
            yield BlockBatch(2, part.unsqueeze(0), (tuple(row_checksums(part)),))
            await asyncio.sleep(3600)
        finally:
            closed.append(source)

    async def locate(model, keys_, node_id, reader=None):
        await asyncio.sleep(0.05)
        return Located([[Location(SOURCE, "other-node", CPU)] for _ in keys_])

    tier.coord.locate = _Method(locate)
    tier.transports = {OBJECT_STORE: BySource(full, stalls)}
    tier.pull_sources["p"] = Location("raykv-tier-stalled", "n", CPU)

    async def cancelled() -> None:  # the caller gives up while both stall: all ends first
        task = asyncio.ensure_future(tier.pull("p", ks))
        await asyncio.sleep(0.02)  # the guess's 2 rows are in, the answer is not
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed == ["raykv-tier-stalled"]
        assert used(tier) == 1 and held(tier, ks) == ks[:2]  # the entry it got; the rest freed

    asyncio.run(cancelled())
    closed.clear()
    tier.pull_sources["p"] = Location("raykv-tier-stalled", "n", CPU)
    got = asyncio.run(asyncio.wait_for(pulled(tier, ks), 30))  # not the stall's hour
    assert got == N and closed == ["raykv-tier-stalled"]  # closed before the rest came
    assert full.sent == 2  # rows 4..11 from SOURCE, 2 and 3 from the first (0, 1: held)
    assert torch.equal(arena_rows(tier, ks), rows)
    assert tier.pull_sources["p"].member == SOURCE


class Landing(Streaming):
    """Streams as ``Streaming``, but receives each chunk where the reader's ``land`` offers
    (as the UCX transport does: the bytes copied there, the chunk handed on viewing them);
    ``seconds``: how long it says it may write there."""

    def __init__(self, rows, chunk, corrupt=None, seconds=1.0) -> None:
        super().__init__(rows, chunk, corrupt)
        self.seconds, self.landed, self.offered = seconds, 0, []

    async def stream(self, source, model, keys, endpoint=None, land=None, asked=None):
        assert land is not None  # the pull offers its rows
        at = 0
        async for b in super().stream(source, model, keys, endpoint):
            dest = land(at, b.count, 1, ROW, self.seconds)
            self.offered.append(dest is not None)
            if dest is not None:
                dest.view(1, b.count, ROW).copy_(b.rows)
                self.landed += 1
                b = BlockBatch(b.count, dest.view(1, b.count, ROW), b.checksums)
            at += b.count
            yield b


@pytest.fixture
def copies(monkeypatch) -> list:
    """The paged copies the pull's writes make (a row received in place needs none)."""
    from raykv.service.tier import pull as tier_pull

    made: list = []
    real = tier_pull.ops.scatter_blocks

    def counted(src, dsts, ids, **kw):
        made.append(len(ids))
        return real(src, dsts, ids, **kw)

    monkeypatch.setattr(tier_pull.ops, "scatter_blocks", counted)
    return made


def test_rows_land_in_their_reserved_rows_and_are_never_copied_again(tier, copies) -> None:
    rows, ks = data(), keys()
    t = Landing(rows, chunk=5)
    tier.transports = {OBJECT_STORE: t}
    assert asyncio.run(pulled(tier, ks)) == N
    assert t.offered == [True, True, True] and copies == []  # in place, no copy
    assert held(tier, ks) == ks and torch.equal(arena_rows(tier, ks), rows)
    mt = tier.tiers["p"]
    lease = mt.tier.prepare_load([ks[-1]])
    assert lease.checksums[0][0] == tuple(row_checksums(rows[-2:]))  # the verified sums
    mt.tier.finish_load(lease)


def test_a_corrupt_row_landed_in_place_is_never_readable(tier, copies) -> None:
    rows, ks = data(), keys()
    t = Landing(rows, chunk=4, corrupt=7)
    tier.transports = {OBJECT_STORE: t}
    assert asyncio.run(pulled(tier, ks)) == 6  # entries 0..2, as when copied
    assert held(tier, ks) == ks[:6] and torch.equal(arena_rows(tier, ks[:6]), rows[:6])
    assert t.landed == 3 and copies == []  # the chunk after the bad one too: released
    assert used(tier) == 3 and tier.tiers["p"].tier.num_holds == 0  # the rest released
    assert t.source.dropped == [ks[7]]


def test_no_row_lands_where_the_reservation_may_end_first_or_rows_do_not_run(tier, copies):
    rows, ks = data(), keys()
    # a transport that may write for longer than the reservation lasts: copied instead
    t = Landing(rows, chunk=2, seconds=10 * 3600)
    tier.transports = {OBJECT_STORE: t}
    assert asyncio.run(pulled(tier, ks[4:6])) == 2  # entry 2 only
    assert t.offered == [False] and copies == [2]
    # entry 2 held: a pull of all N reserves no rows for keys 4, 5, so the chunk of keys
    # 4..7 is copied (keys 6, 7 only); the chunks whose reserved rows run land in place
    copies.clear()
    t = Landing(rows, chunk=4)
    tier.transports = {OBJECT_STORE: t}
    tier.pull_sources.clear()  # the answer waited for: reserved before any row comes
    assert asyncio.run(pulled(tier, ks)) == N
    assert held(tier, ks) == ks and torch.equal(arena_rows(tier, ks), rows)
    assert t.offered == [True, False, True] and copies == [2]


class Asked(Landing):
    """``Landing`` that records the entries in use in the tier when it is asked."""

    def __init__(self, rows, chunk, tier) -> None:
        super().__init__(rows, chunk)
        self.used_when_asked: list[int] = []
        self.tier = tier

    async def stream(self, source, model, keys, endpoint=None, land=None, asked=None):
        self.used_when_asked.append(used(self.tier))
        async for b in super().stream(source, model, keys, endpoint, land):
            yield b


def test_the_remembered_source_is_asked_before_the_reservation_its_early_rows_copied(
    tier, copies
) -> None:
    rows, ks = data(), keys()
    t = Asked(rows, chunk=4, tier=tier)
    tier.transports = {OBJECT_STORE: t}
    assert asyncio.run(pulled(tier, ks[:4])) == 4  # no pull before: the answer is waited for
    assert t.used_when_asked == [2] and t.offered == [True] and copies == []
    assert asyncio.run(pulled(tier, ks)) == N  # keys 4..11 from the remembered source
    # asked while only the first pull's 2 entries were in use: before this pull's 4 were
    # reserved; its first chunk came before them, so it was copied there, the next landed
    assert t.used_when_asked == [2, 2] and t.offered == [True, False, True] and copies == [4]
    assert held(tier, ks) == ks and torch.equal(arena_rows(tier, ks), rows)
    assert used(tier) == N // 2 and not tier.tiers["p"].pending


class SentLate(Asked):
    """``Asked`` whose request is sent (``asked``) from another thread a little later, as the
    UCX loop's thread sends it: records the entries in use at that moment."""

    def __init__(self, rows, chunk, tier) -> None:
        super().__init__(rows, chunk, tier)
        self.used_when_sent: list[int] = []

    async def stream(self, source, model, keys, endpoint=None, land=None, asked=None):
        def send() -> None:
            time.sleep(0.001)
            self.used_when_sent.append(used(self.tier))
            asked()

        if asked is not None:
            threading.Thread(target=send).start()
        async for b in super().stream(source, model, keys, endpoint, land):
            yield b


def test_the_pull_waits_for_the_remembered_sources_request_to_be_sent(tier, copies) -> None:
    """The pull's own work (the locate's call, the reservation) waits until the request to
    the remembered source is sent: it is not held back behind that work (the transport's
    loop shares the GIL)."""
    rows, ks = data(), keys()
    t = SentLate(rows, chunk=4, tier=tier)
    tier.transports = {OBJECT_STORE: t}
    assert asyncio.run(pulled(tier, ks[:4])) == 4  # no pull before: nothing to ask first
    assert t.used_when_sent == []
    assert asyncio.run(pulled(tier, ks)) == N  # keys 4..11 from the remembered source
    assert t.used_when_sent == [2]  # sent before this pull's 4 entries were reserved
    assert held(tier, ks) == ks and torch.equal(arena_rows(tier, ks), rows)
    assert used(tier) == N // 2 and not tier.tiers["p"].pending


def test_a_remembered_source_asked_when_there_is_no_room_writes_nothing(tier, copies) -> None:
    rows, ks = data(20), keys(20)
    t = Asked(rows, chunk=4, tier=tier)
    tier.transports = {OBJECT_STORE: t}
    assert asyncio.run(pulled(tier, ks[:16])) == 16  # the arena's 8 entries, all in use
    mt = tier.tiers["p"]
    lease = mt.tier.prepare_load([ks[i] for i in range(1, 16, 2)])  # all being read
    before = mt.tier.rows(0).clone()
    offered = len(t.offered)
    assert asyncio.run(asyncio.wait_for(pulled(tier, ks[16:]), 30)) == 0  # no room: misses
    assert t.closed and t.used_when_asked == [8, 8]  # it was asked, then cut off
    assert t.offered[offered:] == [False] and copies == []  # its first chunk: not landed, not
    # written (its write waited for a reservation that never came)
    assert torch.equal(mt.tier.rows(0), before) and held(tier, ks[16:]) == []
    assert not mt.pending
    mt.tier.finish_load(lease)


def test_a_tier_lends_its_rows_in_place_leased_until_released(tier) -> None:
    """``export_blocks(lend=seconds)`` (a UCX server sending from the arena): the rows
    themselves, leased until released, where they run and the lease outlasts the send."""
    from raykv.transport import Lent

    rows, ks = data(), keys()
    tier.transports = {OBJECT_STORE: Streaming(rows, chunk=4)}
    assert asyncio.run(pulled(tier, ks)) == N
    mt = tier.tiers["p"].tier
    lent = asyncio.run(tier.export_blocks("p", ks[:6], lend=5.0))
    assert isinstance(lent, Lent) and lent.count == 6
    assert lent.sums == [list(row_checksums(rows[:6]))]
    assert lent.rows.ctypes.data == mt.rows(0)[mt.row(0, 0)].data_ptr()  # no gather
    assert torch.equal(torch.from_numpy(lent.rows[0]), rows[:6]) and mt.num_holds == 1
    lent.release()
    assert mt.num_holds == 0
    # a send that may outlast the lease, or no lend asked: gathered, the lease ended at once
    for seconds in (3600.0, 0.0):
        n, got, sums = asyncio.run(tier.export_blocks("p", ks[:6], lend=seconds))
        assert n == 6 and sums == lent.sums and mt.num_holds == 0
        assert torch.equal(torch.from_numpy(got[0]), rows[:6])


class TwoCopies(Streaming):
    """Streams rows of two TP copies (``rows``: ``[2, n, width]``); ``corrupt``: (copy, row)."""

    async def stream(self, source, model, keys, endpoint=None, land=None, asked=None):
        idx = [int.from_bytes(k[4:], "little") for k in keys]
        for at in range(0, len(idx), self.chunk):
            part = self.rows[:, idx[at : at + self.chunk]].clone()
            sums = tuple(row_checksums(part[c]) for c in range(2))
            for j, i in enumerate(idx[at : at + self.chunk]):
                if self.corrupt is not None and i == self.corrupt[1]:
                    part[self.corrupt[0], j, 5] ^= 0xFF
            self.sent += 1
            yield BlockBatch(part.shape[1], part, sums)


@pytest.mark.parametrize("bad_copy", [0, 1])
def test_a_row_corrupt_in_one_tp_copy_keeps_entries_whole_in_every_copy(monkeypatch, bad_copy):
    """Heads split over two ranks: a tier entry holds both TP copies. A row corrupt in either
    copy mid-chunk ends the pull there: the entries before it are stored with both copies'
    rows as sent (each span checked as it is copied, copy by copy), none after it."""
    layers = {"l0": FullAttention(dtype="float32", num_kv_heads=2, head_dim=16)}
    model = ServedModel("p", layers, max_model_len=14 * BS, pool_bytes=16 * ROW, tp_size=2,
                        cpu_bytes=32 * ROW, offload_block_size=2 * BS)  # fmt: skip
    plan = model.plan(model.pool_bytes)
    t = CpuTierActor("this-node", {"p": plan})
    t.coord = Coordinator()
    monkeypatch.setattr(ray, "get_actor", lambda *a, **k: t.coord)
    mt = t.tiers["p"]
    assert mt.tier.copies == 2
    width, ks = mt.widths[0], keys()
    g = torch.Generator().manual_seed(4)
    rows = torch.randint(0, 256, (2, N, width), generator=g, dtype=torch.uint8)
    t.transports = {OBJECT_STORE: TwoCopies(rows, chunk=8, corrupt=(bad_copy, 5))}
    assert asyncio.run(pulled(t, ks)) == 4  # entries 0, 1; entry 2 (rows 4, 5) is not
    assert held(t, ks) == ks[:4] and t.transports[OBJECT_STORE].source.dropped == [ks[5]]
    lease = mt.tier.prepare_load([ks[1], ks[3]])
    try:
        for c in range(2):
            got = [mt.tier.rows(c)[mt.tier.row(b, s), :width] for b in lease.blocks for s in (0, 1)]
            assert torch.equal(torch.stack(got), rows[c, :4])
    finally:
        mt.tier.finish_load(lease)
    assert used(t) == 2

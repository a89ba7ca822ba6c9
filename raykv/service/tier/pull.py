"""A CPU tier pulls blocks another member holds into its own arena (CPU tier -> CPU tier).

``CpuTierActor.pull(model, keys)``: for the leading ``keys`` of one group that this tier does
not hold yet, the coordinator names who does (``locate``, with this tier as the reader, so the
pair's transport is chosen as for any reader: UCX between two nodes' tiers where both run it).
Entries for every key asked are reserved in this tier's arena while that answer is on its way
(WRITING: nobody reads them, nothing evicts them; a pull is asked for keys a lookup found, and
those nobody holds after all are released again), and the member the last answer named first
for this model is asked for them before either (a prompt's blocks mostly sit where the last
one's did: the answer's round trip, ~5 ms, is then off the pull's path, and the locate and the
reservation overlap the request's way to the source and its first chunk's export; the pull's
own Python waits until that request is sent, ``_ask``; rows in before the reservation are
received into the transport's buffer and copied after it; it is asked once, forgotten if its
route fails, and given up on if the answer does not name it, or if nothing was reserved after
all); the blocks are fetched, from it
and then from the copies the answer names for the rest, through the same
``raykv.transport.fetch_over`` a GPU pool's load uses (the chosen transport, then the object
store), chunk by chunk: each chunk's rows are written straight into their reserved rows
(``_ArenaWriter.write``: one paged copy per run of rows, from the received buffer, each span
verified on the copying thread right before it is written, ``raykv.transport.RowCheck``) while
the next chunk is on the wire, and only its verified rows count (``raykv.transport.receive``:
the fetch is cut at its first bad row, which is dropped at the source and counted); over UCX,
rows whose reserved rows are one run are received there in place (``_ArenaWriter.land``: no
staging buffer, no copy), and are only verified there. After the last chunk, the entries whose
every row was written are stored with the checksums they were verified against and published
(the pull answers once they are stored here; the coordinator learns of them in the background,
in order); every other reserved entry is released, so a source that dies or lies mid-transfer
leaves no entry behind, never a half-written one readable: those keys stay misses. The release
runs whatever ends the pull (an error, a cancellation). (Storing each entry as soon as its rows
were verified, on the loop while the next chunk is on the wire, made a 128 MiB pull ~5 ms
slower on a 16-core host: the loop is the receive's.)

Entries are whole chunks (``raykv.service.groups``): ``keys`` start at a chunk boundary (the
request's first block, as the vLLM connector passes them) and a trailing partial chunk is
not pulled.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
import torch

from raykv import ops
from raykv.errors import InvalidInput, TransportError
from raykv.service.control.index import CPU
from raykv.service.groups import key_group
from raykv.service.served import COORDINATOR, NAMESPACE
from raykv.transport import FALLBACK, Asked, BlockBatch, RowCheck, fetch_over

log = logging.getLogger(__name__)
ASK_WAIT_S = 0.005  # the most a pull waits for its guessed source's request to be sent


def held_prefix(mt: Any, keys: list[bytes]) -> int:
    """Leading ``keys`` this tier's arena holds."""
    return len(mt.choose(keys)) if keys else 0


async def pull(tier: Any, model: str, keys: list[bytes], tenant: bytes | None = None) -> int:
    """Copy the leading ``keys`` held elsewhere into ``tier``'s arena (``tenant``'s entries
    there: its quota bounds them); returns how many leading keys it holds afterwards
    (0..len(keys))."""
    mt = tier._tier(model)
    keys = [bytes(k) for k in keys]
    if not keys:
        return 0
    if any(key_group(k) != key_group(keys[0]) for k in keys):
        raise InvalidInput("pull takes the keys of one KV group, in prefix order")
    f = mt.tier.factor
    have = held_prefix(mt, keys)
    start, end = have // f * f, len(keys) // f * f  # whole chunks only
    if start >= end:
        return have
    want = keys[start:end]
    writer = guessing = locating = None
    pending = _ArenaWriter(mt, want)  # nothing reserved yet: it lands nothing, writes wait
    guess = tier.pull_sources.get(model)
    try:
        if guess is not None:
            # the copy the last answer named first is asked before anything else (a prompt's
            # blocks mostly sit where its last ones did): whatever leading keys it holds,
            # verified as any; the answer then names who holds the rest. Its request and the
            # source's first chunk overlap the locate and the reservation (rows in before it
            # is made are received into the transport's buffer and copied once it is)
            guessing = await _ask(tier, model, want, guess, pending)
        # the coordinator's answer is a round trip (~5 ms measured, most of it Ray's); the
        # reservation for every wanted entry is made meanwhile, on this loop, and what the
        # answer says nobody holds is released again (a pull is asked for keys a lookup found)
        locating = asyncio.ensure_future(_locate(tier, model, want))
        await asyncio.sleep(0)  # the locate call is sent before the reservation's work
        res = await _reserve(tier, mt, model, want, tenant)
        writer = None if res is None else pending.reserved(res)
        if guessing is not None and (writer is None or not writer.todo):
            await _stop(guessing)  # no room, or nothing to write: nothing lands in the arena
            guessing = None
        if guessing is not None:
            await asyncio.wait((guessing, locating), return_when=asyncio.FIRST_COMPLETED)
        where = await locating
        if guessing is not None:
            at = writer.filled
            if at >= len(where) or all(c.member != guess.member for c in where[at]):
                guessing.cancel()  # the answer does not name it (gone, or lost the keys)
            await asyncio.wait((guessing,))
            if not guessing.cancelled():
                guessing.result()  # what it raised, if anything unexpected
        if where and where[0]:
            tier.pull_sources[model] = where[0][0]
        held = next((i for i, locs in enumerate(where) if not locs), len(want)) // f * f
        if writer is not None and writer.filled < held:
            await _fill(tier, model, want[:held], where, writer)
    finally:
        if locating is not None:
            locating.cancel()
        if guessing is not None:  # its rows land in the reservation
            await _stop(guessing)
        if writer is not None:  # whatever ends the pull: entries not filled are released
            # published in the background (in order, as an engine's store): the caller reads
            # this tier next, not the coordinator's index (measured: 7-30 ms of a 128 MiB pull)
            await tier.apply(model, writer.finish(), wait_publish=False)
    return held_prefix(mt, keys)


async def _ask(
    tier: Any, model: str, want: list[bytes], guess: Any, pending: _ArenaWriter
) -> asyncio.Task:
    """The fetch of ``want`` from ``guess`` into ``pending``, started; returns once its request
    is on its way (``ASK_WAIT_S`` at most: a first connection is slower). The UCX loop sends it
    from a thread of its own that shares the GIL with this loop: the pull's own Python work
    after this (the locate's call, the reservation: ~4 ms for 512 keys) held the request back:
    it left 2.7-5.5 ms after the pull started, 0.7-1.3 ms with this wait (16-core H200, 128 MiB
    pulls, medians of 7)."""
    loop = asyncio.get_running_loop()
    asked = asyncio.Event()
    fill = _fill(tier, model, want, [[guess]] * len(want), pending, guessed=True,
                 asked=lambda: loop.call_soon_threadsafe(asked.set))  # fmt: skip
    guessing = asyncio.ensure_future(fill)
    sent = asyncio.ensure_future(asked.wait())
    try:
        await asyncio.wait((guessing, sent), timeout=ASK_WAIT_S,
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    except BaseException:  # the pull was cancelled: so is its ask (nothing was reserved)
        await _stop(guessing)
        raise
    finally:
        sent.cancel()
    return guessing


async def _stop(fetch: asyncio.Future) -> None:
    """Cancel a fetch and wait until it has ended: until then its rows may still land in the
    pull's reservation, which must not be released (or given to another pull) before."""
    fetch.cancel()
    await asyncio.wait((fetch,))


async def _locate(tier: Any, model: str, want: list[bytes]) -> list[list[Any]]:
    """Per key, the other members that hold it, other tiers first (stable: nearest first
    within each: a pull stays off the GPUs); nobody if the coordinator cannot say."""
    try:
        coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
        where = (await coord.locate.remote(model, want, tier.node_id, tier.name)).copies
    except (ray.exceptions.RayError, ValueError) as e:  # coordinator restarting: misses
        log.warning("tier %s: cannot locate copies (%s); pulling nothing", tier.name, e)
        tier.metrics.copy_failed(model, CPU, "locate")
        return [[] for _ in want]
    # keys of one run share their list of Locations (``Located``): ordered once per list
    order: dict[tuple[int, ...], list[Any]] = {}
    out = []
    for locs in where:
        ids = tuple(map(id, locs))
        if ids not in order:
            order[ids] = [c for c in sorted(locs, key=lambda c: c.tier != CPU)
                          if c.member != tier.name]  # fmt: skip
        out.append(order[ids])
    return out


async def _reserve(
    tier: Any, mt: Any, model: str, want: list[bytes], tenant: bytes | None = None
) -> Any:
    """The reservation of ``want``'s entries (whole chunks) in this tier's arena; None when
    there is no room (everything is being read): misses, nothing changed."""
    f = mt.tier.factor
    entries = [tuple(want[e : e + f]) for e in range(0, len(want), f)]
    _, res = await tier.reserve(model, tuple(e[-1] for e in entries), tuple(entries),
                                mt.tier.copies, None, tenant)  # fmt: skip
    return res


async def _fill(
    tier: Any,
    model: str,
    want: list[bytes],
    where: list,
    writer: Any,
    guessed: bool = False,
    asked: Asked | None = None,
) -> None:
    """Stream the leading ``want`` into ``writer``, source by source, until one is missing.
    ``guessed``: ``where`` is the last answer's first copy, not this pull's answer: it is
    asked once, and forgotten if its route fails (no retry over the fallback). ``asked``:
    told once the first source's request is on its way (``Asked``)."""
    failed = {tier.name}
    while writer.filled < len(want):
        i = writer.filled
        loc = next((c for c in where[i] if c.member not in failed), None)
        if loc is None:
            return  # nobody (else) holds it: the prefix ends here
        run = _held_run(where, i, len(want), loc.member)

        async def write(at: int, rows: BlockBatch, check: RowCheck, i: int = i,
                        source: str = loc.member) -> None:  # fmt: skip
            await writer.ready.wait()  # a guessed source's rows may come before the reservation
            writer.write(i + at, rows, check, source)

        async def sink(at: int, rows: BlockBatch, i: int = i) -> None:
            writer.commit(i + at, rows)

        def land(at: int, *rest: Any, i: int = i) -> torch.Tensor | None:
            return writer.land(i + at, *rest)

        try:
            got = await fetch_over(
                tier.transports, loc.transport, loc.member, model, want[i:run], sink,
                loc.endpoint, _gave_up if guessed else _fell_back(tier, loc.member), land,
                write, asked, carried=lambda name, n: tier.metrics.fetched(model, name, n),
            )  # fmt: skip
            asked = None
        except (ray.exceptions.RayActorError, TransportError, ValueError) as e:
            # what arrived before it failed stays (verified); the rest from the next copy
            if guessed:
                log.info("tier %s: last pull's source %s failed (%s)", tier.name, loc.member, e)
                tier.pull_sources.pop(model, None)
                return
            log.warning("tier %s: copy source %s failed (%s)", tier.name, loc.member, e)
            tier.metrics.copy_failed(model, CPU, "pull")
            failed.add(loc.member)
            continue
        finally:
            tier.metrics.moved(model, CPU, writer.take_moved())
        if got.corrupt:  # the source's copy is corrupt: a miss, dropped there
            tier.metrics.checksum_errors(model, "remote", 1)
            log.warning("tier %s: block from %s failed its checksum; a miss", tier.name, loc.member)
            actor = tier.transports[FALLBACK].actor(loc.member)
            actor.drop_keys.remote(model, [want[i + got.count]])  # fire and forget
        if writer.filled < run:
            failed.add(loc.member)  # it lost (or corrupted) the rest: try the next copy


class _ArenaWriter:
    """Where a pull's rows go: in key order into the rows reserved for them (``res``; keys
    of entries stored already are skipped; ``write``), counted once verified (``commit``),
    and the ``finish_store`` calls that store the entries it filled and release the rest."""

    def __init__(self, mt: Any, want: list[bytes]) -> None:
        self.mt, self.want, self.res = mt, want, None
        self.factor, self.copies = mt.tier.factor, mt.tier.copies
        self.width = mt.widths[key_group(want[0])]
        self.entry_of: dict[bytes, int] = {}
        # per key: its arena row, or -1 (its entry is stored already: nothing to write); None
        # until ``reserved``: nothing lands and nothing is written before
        self.dest: list[int] | None = None
        self.todo = False
        self.ready = asyncio.Event()
        self.sums: list[list[int]] = [[] for _ in range(self.copies)]  # per copy, per row
        self.filled = 0  # leading keys written (or skipped) and verified
        # keys written (or skipped), verified or not: a fetch writes a chunk before the one
        # ahead of it is verified (``raykv.transport.receive``)
        self.written = 0
        self._moved = 0

    def reserved(self, res: Any) -> _ArenaWriter:
        """Take the pull's reservation ``res``: from now on rows land in and are written to
        the rows reserved for them."""
        want, f = self.want, self.factor
        block = res.block_of()
        self.entry_of = {e: i // f for i, e in enumerate(want) if i % f == f - 1}
        last = [want[(i // f + 1) * f - 1] for i in range(len(want))]
        dest = [self.mt.tier.row(block[e], i % f) if e in block else -1
                for i, e in enumerate(last)]  # fmt: skip
        self.res, self.todo = res, any(d >= 0 for d in dest)
        self.dest = dest  # last: ``land`` reads it on the transport's loop
        self.ready.set()
        return self

    def land(
        self, at: int, count: int, copies: int, width: int, seconds: float
    ) -> torch.Tensor | None:
        """Where rows ``at .. at + count`` of the pull may be received in place (a transport's
        ``Land``, asked on its loop): their reserved arena rows, when they are one run of whole
        rows of the one TP copy and the reservation outlasts the receive (``seconds``), so no
        byte ever lands in a row that is not this pull's; else None. Rows landed there are
        unverified until ``write`` sees them, and never readable before ``finish``. None while
        nothing is reserved yet."""
        if self.dest is None:
            return None
        dests = self.dest[at : at + count]
        if copies != 1 or self.copies != 1 or width != self.width or len(dests) != count:
            return None
        view = self.mt.tier.run_view(dests, width)
        if view is None or self.mt.tier.hold_left(self.res) <= seconds:
            return None
        return view

    def write(self, at: int, rows: BlockBatch, check: RowCheck, source: str) -> None:
        """Rows ``at .. at + rows.count`` of the pull, not verified yet, into their arena rows
        (rows received in place, ``land``, are there already), each span passed by ``check``
        on the copying thread right before it is written; the copy ends at the first row
        refused. None is readable before ``commit`` and ``finish``."""
        if at not in (self.written, self.filled):  # the next chunk, or a fetch (re)starting
            raise TransportError(f"{source} sent rows from {at}, expected {self.written}")
        if not self.mt.tier.current(self.res):  # a pull past the lease timeout: rows not ours
            raise TransportError(f"the pull from {source} outlived its reservation; a miss")
        shape = tuple(rows.rows.shape[::2])
        if shape != (self.copies, self.width):
            raise ValueError(f"{source} sent rows {list(rows.rows.shape)}, this plan's are "
                             f"[{self.copies}, n, {self.width}]")  # fmt: skip
        self.written = at + rows.count
        for first, dests in _runs(self.dest[at : at + rows.count]):
            ids, n = torch.tensor(dests, dtype=torch.long), len(dests)
            for c in range(self.copies):  # every copy of a row refused in one stays unwritten
                src = rows.rows[c, first : first + len(dests)]
                if _in_place(src, self.mt.tier.run_view(dests, self.width, c)):
                    continue
                arena = self.mt.tier.rows(c)[:, : self.width]
                n = ops.scatter_blocks(src[:n], [arena], ids[:n], check=check.span(c, first))
            if n < len(dests):
                return

    def commit(self, at: int, rows: BlockBatch) -> None:
        """Rows ``at .. at + rows.count`` of the pull, verified (``receive``): written, their
        checksums kept for the store."""
        if at != self.filled:
            raise TransportError(f"rows from {at} verified, expected {self.filled}")
        for mine, theirs in zip(self.sums, rows.checksums, strict=True):
            mine += theirs
        self.filled += rows.count
        self._moved += rows.nbytes

    def take_moved(self) -> int:
        moved, self._moved = self._moved, 0
        return moved

    def finish(self) -> list[tuple]:
        """``finish_store`` ops (one per TP copy): entries whose every row was written are
        stored with their verified checksums; the others are released (never readable)."""
        f, whole, entry_of = self.factor, self.filled // self.factor, self.entry_of
        done, rest = self.res.split(lambda k: entry_of[k] < whole)
        out: list[tuple] = []
        if done.keys:
            valid = [(True,) * f] * len(done.keys)
            firsts = [entry_of[k] * f for k in done.keys]
            for c, sums in enumerate(self.sums):
                out.append(("finish_store", done, True, valid,
                            [sums[r : r + f] for r in firsts], c))  # fmt: skip
        if rest.keys:
            out += [("finish_store", rest, False, None, None, c) for c in range(self.copies)]
        return out


def _held_run(where: list, start: int, end: int, member: str) -> int:
    """Where the run of keys from ``start`` (before ``end``) that ``member`` holds ends. Keys
    of one run share their list of copies (``_locate``; a guess is one list for all), so each
    list is looked through once (512 keys of one source: 0.04 ms against 0.57 looking through
    each key's, on the 2-core box; a guessed source's run is found before its request leaves)."""
    seen = None
    for i in range(start, end):
        locs = where[i]
        if locs is not seen:
            if all(c.member != member for c in locs):
                return i
            seen = locs
    return end


def _gave_up(name: str, e: TransportError, then: str) -> None:
    raise e  # a guessed source's route failed: the located copies are asked next


def _fell_back(tier: Any, source: str) -> Any:
    def fell_back(name: str, e: TransportError, then: str) -> None:
        log.warning("tier %s: %s from %s failed (%s); retrying over %s",
                    tier.name, name, source, e, then)  # fmt: skip
        tier.metrics.failed(f"transport_{name}")

    return fell_back


def _in_place(src: torch.Tensor, dest: torch.Tensor | None) -> bool:
    """Whether ``src`` is ``dest`` itself (rows received in place): nothing to copy."""
    return (
        dest is not None
        and src.data_ptr() == dest.data_ptr()
        and src.shape == dest.shape
        and src.is_contiguous()
    )


def _runs(dests: list[int]) -> list[tuple[int, list[int]]]:
    """``(first row, destinations)`` for each run of consecutive rows to write (``dests[j]``:
    row j's arena row, -1 for a row to skip), in order: one paged copy each."""
    out: list[tuple[int, list[int]]] = []
    prev: list[int] | None = None
    for j, d in enumerate(dests):
        if d < 0:
            prev = None
        elif prev is None:
            prev = [d]
            out.append((j, prev))
        else:
            prev.append(d)
    return out

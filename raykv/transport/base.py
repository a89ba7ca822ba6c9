"""The transport interface: a batch of blocks streamed in a few large chunks, each checked as
it arrives.

A fetch names a source member (a pool or a CPU tier, on any node) and the keys of one KV
group's blocks, in prefix order. The source answers with the leading blocks it still holds,
in order, as one or more chunks (``Transport.stream``): each chunk is a ``BlockBatch`` of the
next blocks, every block's bytes for every distinct TP copy in ONE contiguous uint8 buffer
``[copies, count, row_bytes]`` (never one message per block) plus the checksum each row had
when it was stored (the row sum, ``raykv.tiers.checksum``). The chunks are not verified yet.

A reader takes them through ``receive``: each chunk is verified (``RowCheck``, invariant 12)
while the transport brings in the next one (and while the chunk before it is handed on), and
only its verified leading rows reach the reader's ``sink`` (``sink(position of its first
row, rows)``), which writes them where they belong (a tier's reserved arena entries, a
pool's blocks) or makes them readable there. A reader whose rows land in host memory may
pass ``write`` too: it copies the chunk's rows to where they belong before they are
verified, each span checked on the copying thread right before it is written (one pass per
thread, not a round of hashing threads first); ``receive`` verifies whatever it did not, and
hands the sink only the rows that passed. The first bad row ends the fetch: it and everything
after it are misses, counted as an error by the reader, never wrong KV.
``collect`` is the buffer-returning fetch (the whole batch as one ``BlockBatch``, not
verified) built on the same stream.

How the chunks travel is the transport's business: ``ObjectStoreTransport`` returns one
chunk from the source's actor call (plasma on the source node, one pull to the receiver's
node, read in place); ``UcxTransport`` streams the chunks the source gathers one after the
other over its own channel (``raykv.transport.ucx``), the control messages carrying only
keys, counts and checksums. The source exports gathered buffers with ``export_rows``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from raykv.errors import TransportError
from raykv.ops.threads import in_parallel
from raykv.tiers.checksum import verified_prefix


@dataclass(frozen=True)
class BlockBatch:
    """``count`` consecutive blocks of a fetch: ``rows`` uint8 ``[copies, count, row_bytes]``
    (one buffer) and ``checksums`` uint64-valued ``[copies][count]`` as stored."""

    count: int
    rows: torch.Tensor
    checksums: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        return int(self.rows.numel())

    def head(self, n: int) -> BlockBatch:
        return BlockBatch(n, self.rows[:, :n], tuple(c[:n] for c in self.checksums))


Sink = Callable[[int, BlockBatch], Awaitable[None]]
# write(position, rows, check): a reader's copy of a chunk's rows (unverified) to where they
# belong, each span passed by ``check.span(c)`` (TP copy c) right before it is written
# (``raykv.ops.scatter_blocks(check=...)``): a row refused is never written; rows it skips
# (received in place already) ``receive`` verifies after. What it writes must stay unreadable
# until the sink is handed those rows (a tier's reserved entries, never readable before
# they are stored).
Write = Callable[[int, BlockBatch, "RowCheck"], Awaitable[None]]
# land(position, count, copies, width, seconds): where rows ``position .. position + count``
# of a fetch may be received in place: a contiguous uint8 CPU tensor of ``copies * count *
# width`` bytes (the sink's own destination rows, laid out as they travel), or None (they
# are received into a buffer of the transport's). ``seconds``: how long the transport may
# still write there (its receive ends or is aborted by then; and once the stream has ended,
# exhausted or closed, it writes nothing more there); the rows are handed to the sink
# unverified, as any chunk, viewing that buffer.
Land = Callable[[int, int, int, int, float], Any]
# asked(): the request is on its way to the source (called once, from any thread: a transport
# may run its own loop). A reader whose loop shares the GIL with that loop's thread waits for
# it before its own Python work, so the request is not held back behind that work.
Asked = Callable[[], None]


@dataclass(frozen=True)
class Lent:
    """An export served in place: ``rows`` (uint8 ``[copies, count, width]``) view the
    member's own storage, unchanged (leased) until ``release()`` is called (on the member's
    loop) once the bytes are out; ``sums`` as stored, ``[copies][count]``."""

    count: int
    rows: np.ndarray
    sums: list[list[int]]
    release: Callable[[], None]


class Transport(Protocol):
    name: str

    def stream(
        self,
        source: str,
        model: str,
        keys: Sequence[bytes],
        endpoint: Any = None,
        land: Land | None = None,
        asked: Asked | None = None,
    ) -> AsyncIterator[BlockBatch]:
        """The leading ``keys`` (one group, prefix order) that member ``source`` holds, as
        stored (not verified: read them through ``receive``), in one or more chunks in key
        order; ``endpoint`` is what the source advertised for this transport
        (``Membership.endpoints``); ``land``: where the rows may be received in place (``Land``;
        a transport that cannot ignores it); ``asked`` is called once the request is on its
        way (``Asked``; not if it never is). Raises ``TransportError`` (or Ray's actor error) if the
        source is gone or the transfer fails; closing the iterator early ends the transfer."""
        ...


class DirectTransport:
    """A ``Transport`` whose batches land straight in the reader's blocks (``direct``): the
    pool drives it rank to rank (``raykv.service.pool.pairs``), so it streams nothing; ``instead``
    says what it does, for the error a stream gets."""

    direct = True
    name: str
    instead: str

    async def stream(self, *_args: Any, **_kwargs: Any) -> AsyncIterator[BlockBatch]:
        """``Transport.stream``, refused whatever is asked."""
        raise TransportError(f"{self.instead}; use the object store for a streamed fetch")
        yield  # an async generator, like every transport's stream


@dataclass
class Fetched:
    """How a fetch went: ``count`` leading blocks reached the sink (verified), ``nbytes``
    their bytes; ``corrupt``: the block after them failed its checksum."""

    count: int = 0
    nbytes: int = 0
    corrupt: bool = False


async def receive(
    chunks: AsyncIterator[BlockBatch],
    sink: Sink,
    done: Fetched | None = None,
    write: Write | None = None,
) -> Fetched:
    """Verify each chunk of ``chunks`` as it arrives (as ``write`` copies it, where given, and
    the rows it did not check on the hashing threads, ``RowCheck.rest``: the loop stays free
    for the transport meanwhile) and hand its verified leading rows to ``sink(position,
    rows)``, in order (positions count from ``done.count``); stop at the first bad row
    (``corrupt``). A chunk is handed on by a task of its own: the next chunk is taken,
    written (at the position that follows, as if every row before it passes) and its
    verification started meanwhile, so the hashing threads go from one chunk to the next
    without waiting for the loop, and a sink's copy overlaps the next chunk's hashing (two
    chunks at most; one taken after a bad one is written but never handed to the sink).
    ``done`` is updated as rows reach the sink, so a caller that sees this raise knows how
    far it got: a chunk that came before a failure of the stream (or of ``write``) is handed
    on first. The stream is closed on the way out, whatever happens."""
    done = done if done is not None else Fetched()
    at = done.count  # where the next chunk's rows go, if every row before them passes
    handing: asyncio.Future[bool] | None = None  # the chunk before: verified, then handed on
    verifying: asyncio.Future[int] | None = None
    try:
        async with contextlib.aclosing(chunks) as it:  # type: ignore[type-var]
            while True:
                try:
                    chunk = await anext(it)
                    check = RowCheck(chunk)
                    if write is not None:
                        await write(at, chunk, check)
                except StopAsyncIteration:
                    break
                except Exception:  # what came before the failure is handed on first
                    if handing is not None and not await handing:
                        return done  # a bad row before it ended the fetch there
                    raise
                verifying = asyncio.ensure_future(check.rest())
                if handing is not None and not await handing:
                    verifying.cancel()  # after a bad row: never handed on
                    break
                handing = asyncio.ensure_future(_hand(chunk, verifying, sink, done))
                at += chunk.count
            if handing is not None:
                await handing
    finally:
        for task in (handing, verifying):  # cancelled (or an error): so are they
            if task is not None and not task.done():
                task.cancel()
            elif task is not None and not task.cancelled():
                task.exception()  # seen: the error that ended the fetch is the one raised
    return done


async def _hand(
    chunk: BlockBatch, verifying: asyncio.Future[int], sink: Sink, done: Fetched
) -> bool:
    """Hand ``chunk``'s verified leading rows to ``sink`` once its check (``verifying``) is
    done; False (and ``done.corrupt``) if a row of it failed."""
    good = await verifying
    if good:
        part = chunk if good == chunk.count else chunk.head(good)
        await sink(done.count, part)
        done.count += good
        done.nbytes += part.nbytes
    if good < chunk.count:
        done.corrupt = True
        return False
    return True


async def collect(chunks: AsyncIterator[BlockBatch]) -> BlockBatch:
    """Every chunk of ``chunks`` as one ``BlockBatch`` (not verified: call ``verify``).
    Chunks of one TP copy that lie one after another in one buffer are joined without a
    copy; TP copies arrive chunk-major and are joined copy-major."""
    parts: list[BlockBatch] = [c async for c in chunks if c.count]
    if not parts:
        return BlockBatch(0, torch.empty((1, 0, 0), dtype=torch.uint8), ())
    count = sum(p.count for p in parts)
    copies = range(len(parts[0].checksums))
    sums = tuple(tuple(x for p in parts for x in p.checksums[c]) for c in copies)
    if len(parts) == 1:
        return BlockBatch(count, parts[0].rows, sums)
    return BlockBatch(count, _join(parts), sums)


def _join(parts: list[BlockBatch]) -> torch.Tensor:
    first = parts[0].rows
    copies, width = first.shape[0], first.shape[2]
    adjacent = copies == 1 and all(
        p.rows.is_contiguous()
        and p.rows.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and p.rows.shape[2] == width
        for p in parts
    )
    if adjacent:
        at = first.storage_offset()
        for p in parts:
            if p.rows.storage_offset() != at:
                adjacent = False
                break
            at += p.nbytes
    if not adjacent:
        return torch.cat([p.rows for p in parts], dim=1)
    count = sum(p.count for p in parts)
    out = torch.empty(0, dtype=torch.uint8)
    out.set_(first.untyped_storage(), first.storage_offset(), (1, count, width))
    return out


def export_rows(rows: torch.Tensor) -> np.ndarray:
    """A gathered ``[copies, n, width]`` buffer as the numpy array the wire carries
    (zero-copy for a contiguous CPU tensor)."""
    return rows.detach().cpu().contiguous().numpy()


VERIFY_PIECE_BYTES = 4 << 20  # rows left to verify are hashed in pieces of about this size


class RowCheck:
    """Which rows of one received chunk match the checksums they were stored with, found as
    they are checked: by a reader's copy, span by span on its threads (``span(c)``: the
    ``check`` of ``raykv.ops.scatter_blocks`` for TP copy ``c``, thread-safe), then by
    ``rest`` for every row left. ``passed``: the leading rows that matched in every copy."""

    def __init__(self, batch: BlockBatch) -> None:
        self.batch = batch
        # numpy and lists, once: a check runs on many threads at once, span by span, and
        # does nothing but hash (torch indexing there cost more than the hashing, 16 cores)
        self._rows = batch.rows.numpy() if batch.count else None
        self._sums = [list(c) for c in batch.checksums]
        self._ok = np.zeros((len(batch.checksums), batch.count), dtype=bool)
        self._bad = batch.count  # the first row that failed, in any copy
        self._lock = threading.Lock()

    def span(self, c: int, first: int = 0) -> Callable[[int, int], int]:
        """``check(lo, hi)`` of TP copy ``c``'s rows from ``first`` on (a copy of some of the
        chunk's rows): how many leading rows of ``first + lo .. first + hi`` match."""
        return lambda lo, hi: self._check(c, first + lo, first + hi)

    def _check(self, c: int, lo: int, hi: int) -> int:
        n = verified_prefix(self._rows[c, lo:hi], self._sums[c][lo:hi]) if hi > lo else 0
        self._ok[c, lo : lo + n] = True
        if lo + n < hi:
            with self._lock:
                self._bad = min(self._bad, lo + n)
        return n

    @property
    def passed(self) -> int:
        every = self._ok.all(axis=0)
        return int(every.argmin()) if not every.all() else self.batch.count

    async def rest(self) -> int:
        """Check every row not checked yet before the first one that failed, on the process's
        hashing threads (``in_parallel``; the native row sum releases the GIL), in pieces of about
        ``VERIFY_PIECE_BYTES`` side by side, the awaiting loop free meanwhile; returns
        ``passed``. (Measured on a 16-core host: one thread on the reader's loop verified a
        16 MiB chunk in 2-5 ms while a UCX fetch ran, as long as the reader then took to
        write it.)"""
        width = max(1, self.batch.rows.shape[2] if self.batch.rows.dim() == 3 else 1)
        step = max(1, VERIFY_PIECE_BYTES // width)
        pieces = [(c, a, min(a + step, b))
                  for c in range(self._ok.shape[0])
                  for a0, b in _unset(self._ok[c, : self._bad])
                  for a in range(a0, b, step)]  # fmt: skip
        if pieces:
            await asyncio.gather(
                *(asyncio.wrap_future(in_parallel(self._check, c, a, b)) for c, a, b in pieces)
            )
        return self.passed


def _unset(ok: np.ndarray) -> list[tuple[int, int]]:
    """The runs ``[a, b)`` of False in a bool vector."""
    edges = np.flatnonzero(np.diff(np.concatenate(([True], ok, [True])).astype(np.int8)))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def verify(batch: BlockBatch) -> int:
    """How many leading blocks of ``batch`` match their checksums in every copy (the rest
    must not be used)."""
    good = batch.count
    for c, expected in enumerate(batch.checksums):
        if good == 0:
            break
        good = verified_prefix(batch.rows[c, :good], expected[:good])
    return good

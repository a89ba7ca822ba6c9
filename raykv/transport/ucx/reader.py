"""``UcxTransport``: fetch a batch of blocks from another member's UCX server (ucxx).

A member that serves UCX runs a ``UcxServer`` (``raykv.transport.ucx.server``) and advertises
``{"ucx": (host, [worker address hex, ...], hello tag)}`` in ``Membership.endpoints``; a reader
fetches from it here, connecting by worker address (no sockaddr listener anywhere:
``raykv.transport.ucx.wire``), stripe ``i`` from this process's worker ``i`` to the server's
worker ``i`` (each worker has its own progress thread, so the stripes move in parallel:
``raykv.transport.ucx.runtime``). Per peer the reader keeps ``stripes`` authenticated
connections (connected and authenticated once, reused by every later fetch;
``raykv.transport.auth``). A fetch is one request on stripe 0, then the batch in chunks
(``chunk_bytes``, the source gathering the next while this one travels): per chunk one
header on stripe 0 (count, shape and stored checksums), then its rows, cut into a few large
byte ranges sent on the stripes in parallel (on a tag of their own) and received straight
into the chunk's slice of one staging buffer (or, where the reader offers them through
``land``, straight into the rows they are for), posted before the header arrives
(``raykv.transport.ucx.wire``). No message per block, no round trip per block or chunk. The
UCX loop receives (``_fetch``) and hands each chunk to the reader's loop as soon as it is in
(``stream``), where the reader verifies it and writes it into its blocks
(``raykv.transport.base.receive``, invariant 12) while the next chunk is on the wire.

Every step is bounded (``UcxConfig``: connect, handshake and control messages by
``timeout_s``, the rows by ``transfer_timeout(bytes)``). A peer that dies, stalls or answers
nonsense ends the fetch with ``TransportError`` and its connections are dropped (the server
is told ``bye``; the next fetch reconnects); only chunks whose rows all arrived are handed
out, so nothing half-received is ever read.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import secrets
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from raykv.errors import TransportError
from raykv.transport.auth import AuthError, check_secret, client_handshake
from raykv.transport.base import Asked, BlockBatch, Land, collect
from raykv.transport.select import UCX
from raykv.transport.ucx.config import UcxConfig
from raykv.transport.ucx.runtime import UcxRuntime
from raykv.transport.ucx.wire import (
    Conn,
    check_header,
    cuts,
    hello_frame,
    new_tag,
    next_chunk,
    ranges,
    recv_frame,
    recv_msg,
    send_frame,
    send_msg,
)

log = logging.getLogger(__name__)
BYE_TIMEOUT_S = 0.5
_END = object()  # the last item a fetch hands its reader


class Where(NamedTuple):
    """A UCX server: its host (for logs), its workers' addresses and hello tag."""

    host: str
    addresses: tuple[bytes, ...]
    tag: int


@dataclass
class _Peer:
    """The connections to one server (stripe 0 carries the control messages)."""

    eps: list[Conn]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    staging: Any = None  # kept alive until the endpoints are gone (a receive may be posted)
    buf: torch.Tensor | None = None  # the last staging buffer, reused once nobody reads it

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat staging buffer of ``nbytes``: the last one when every batch handed out
        from it is gone (no tensor or view of it left), else a new one. A fresh buffer
        costs a page fault per 4 KiB as the rows land (~25 % of a tcp fetch here)."""
        if self.buf is not None and self.buf.numel() >= nbytes and _unshared(self.buf):
            return self.buf[:nbytes]
        self.buf = torch.empty(nbytes, dtype=torch.uint8)
        return self.buf

    def alive(self) -> bool:
        return all(not ep.closed for ep in self.eps)

    def abort(self) -> None:
        for ep in self.eps:
            ep.abort()


def _unshared(t: torch.Tensor) -> bool:
    """Whether only ``t`` itself holds its storage (no view, no batch, no numpy array)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    # the storage wrapper made for the call holds one reference, ``t`` the other
    return count is not None and count(t.untyped_storage()._cdata) <= 2


class UcxTransport:
    name = UCX

    def __init__(self, secret: bytes, config: UcxConfig | None = None) -> None:
        self._secret = check_secret(secret)
        self.config = config or UcxConfig.from_env()
        self.runtime = UcxRuntime.get(self.config.tls, self.config.net_devices)
        self.counts: Counter[str] = Counter()  # refused (servers that failed auth), batches
        self._peers: dict[Where, _Peer] = {}
        self._connecting: dict[Where, asyncio.Lock] = {}

    def stream(
        self,
        source: str,
        model: str,
        keys: Sequence[bytes],
        endpoint: Any = None,
        land: Land | None = None,
        asked: Asked | None = None,
    ) -> AsyncIterator[BlockBatch]:
        """The leading ``keys`` that ``source`` (serving at ``endpoint`` = (host, [worker
        address hex, ...], hello tag)) holds, chunk by chunk as they arrive (not verified); the next
        chunk is received (on the UCX loop) while the caller handles this one, in place where
        ``land`` offers the rows' destination (``raykv.transport.base.Land``; asked on the UCX
        loop). ``asked`` is called on the UCX loop once the request is sent. TransportError
        if it cannot be reached, refuses us or fails mid-transfer."""
        if not endpoint:
            raise TransportError(f"{source} advertised no UCX endpoint; it serves no UCX")
        try:
            addresses = endpoint[1]
            if isinstance(addresses, str | bytes) or not addresses:
                raise TypeError("not a list of worker addresses")
            where = Where(str(endpoint[0]), tuple(bytes.fromhex(str(a)) for a in addresses),
                          int(endpoint[2]))  # fmt: skip
        except (IndexError, TypeError, ValueError):
            raise TransportError(
                f"{source} advertised a UCX endpoint raykv cannot read ({str(endpoint)[:80]}); "
                "is it an older raykv? upgrade every node to the same version"
            ) from None
        return self._stream(source, where, model, list(keys), land, asked)

    async def fetch(
        self, source: str, model: str, keys: Sequence[bytes], endpoint: Any = None
    ) -> BlockBatch:
        """The whole batch as one buffer (``collect`` of ``stream``; not verified)."""
        return await collect(self.stream(source, model, keys, endpoint))

    def close(self) -> None:
        async def close() -> None:
            peers, self._peers = list(self._peers.values()), {}
            await asyncio.gather(*(self._bye(peer) for peer in peers))

        self.runtime.submit(close()).result(self.config.timeout_s)

    async def _stream(
        self,
        source: str,
        where: Where,
        model: str,
        keys: list[bytes],
        land: Land | None,
        asked: Asked | None,
    ) -> AsyncIterator[BlockBatch]:
        """The caller's side: chunks the UCX loop hands over, in order. Leaving early (the
        caller stopped, or was cancelled) cancels the transfer there, which drops the
        connections (the server is mid-batch); the next fetch reconnects. Where rows may land
        in the caller's own rows (``land``), leaving waits until the connections are gone
        (``timeout_s`` at most): a receive still posted could write there until then."""
        loop = asyncio.get_running_loop()
        handed: asyncio.Queue[Any] = asyncio.Queue()

        def hand(item: Any) -> None:
            with contextlib.suppress(RuntimeError):  # the reader's loop is gone: nobody reads
                loop.call_soon_threadsafe(handed.put_nowait, item)

        ended: concurrent.futures.Future[None] = concurrent.futures.Future()

        async def start() -> asyncio.Task:
            # the fetch's own task: leaving cancels it and waits for its real end (a cancelled
            # ``submit`` future is done at once, before the task it runs has ended)
            fetch = self._fetch(source, where, model, keys, hand, land, asked)
            task = asyncio.ensure_future(fetch)
            task.add_done_callback(lambda _: ended.done() or ended.set_result(None))
            return task

        task = await asyncio.wrap_future(self.runtime.submit(start()))
        try:
            while (item := await handed.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not ended.done():  # the reader left early: cut the transfer, wait for it
                self.runtime.loop.call_soon_threadsafe(task.cancel)
                limit = 2 * BYE_TIMEOUT_S if land is None else self.config.timeout_s
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(ended)), limit)

    # --- on the UCX loop -------------------------------------------------------------------

    async def _fetch(
        self,
        source: str,
        where: Where,
        model: str,
        keys: list[bytes],
        hand: Callable,
        land: Land | None = None,
        asked: Asked | None = None,
    ) -> None:
        """Receive the batch's chunks (into one staging buffer, or where ``land`` offers),
        ``hand`` each on (then ``_END``, or the error that ended the fetch)."""
        try:
            peer = await self._locked(source, where)
            try:
                nbytes = await self._request(peer, model, keys, hand, land, asked)
            except BaseException as e:  # failed, or the reader left: the stream is cut
                await asyncio.shield(self._drop(where, peer))
                if isinstance(e, TransportError | asyncio.CancelledError):
                    raise
                raise TransportError(
                    f"UCX fetch from {source} on {where.host} failed ({type(e).__name__}: "
                    f"{e}); its blocks are fetched elsewhere or missed"
                ) from None
            finally:
                peer.lock.release()
            self.counts["batches"] += 1
            self.counts["bytes"] += nbytes
            hand(_END)
        except asyncio.CancelledError:
            hand(_END)
            raise
        except BaseException as e:
            hand(e)

    async def _locked(self, source: str, where: Where) -> _Peer:
        """The connections to ``where``, locked for one fetch (one at a time per peer), made
        again if the fetch before dropped them while this one waited."""
        while True:
            peer = await self._peer(source, where)
            await peer.lock.acquire()
            if self._peers.get(where) is peer:
                return peer
            peer.lock.release()

    async def _request(
        self,
        peer: _Peer,
        model: str,
        keys: list[bytes],
        hand: Callable,
        land: Land | None,
        asked: Asked | None,
    ) -> int:
        """One fetch on ``peer``: the request, then per chunk its header and rows (in key
        order), each chunk handed on as soon as its rows are in; returns the bytes moved.

        Pipelined: once a header says ``more``, the next chunk's header receive and its row
        receives (its size and cuts follow from this chunk: ``wire.next_chunk``) are
        posted at once, so its rows land as soon as they are sent, whatever this loop is
        doing; only the first chunk's rows wait for its header (it tells the row size). Each
        chunk's rows are received where ``land`` offers, else into the staging buffer."""
        cfg, ep = self.config, peer.eps[0]
        stripes, min_part = len(peer.eps), cfg.stripe_min_bytes // max(1, len(peer.eps))
        req = {
            "op": "fetch",
            "model": model,
            "keys": [k.hex() for k in keys],
            "stripes": stripes,
            "min_part": min_part,
            "chunk_bytes": cfg.chunk_bytes,
        }
        await asyncio.wait_for(send_msg(ep, req), cfg.timeout_s)
        if asked is not None:
            asked()
        staging, at, got, row, copies, width = None, 0, 0, 0, 0, 0
        # rows posted ahead of their header: (landed, keys, parts, where they land)
        posted: tuple[asyncio.Future, int, int, torch.Tensor] | None = None
        flight: deque[tuple[asyncio.Future, BlockBatch | None]] = deque()  # rows, in order
        head: asyncio.Future | None = asyncio.ensure_future(recv_msg(ep))
        try:
            while head is not None or flight:
                if head is not None and (head.done() or not flight):
                    msg = await asyncio.wait_for(head, cfg.timeout_s)
                    n, shape, sums, parts = check_header(msg, len(keys) - got)
                    head = None
                    if posted is None:  # the first chunk: its rows are posted now
                        if not n:
                            continue
                        copies, width = shape[0], shape[2]
                        row = copies * width
                        # room for every key asked, at this row size; alive until the
                        # endpoints are gone (a receive may be posted)
                        staging = peer.take(len(keys) * row)
                        peer.staging = staging.numpy()
                        dest = self._into(land, staging, at, got, n, copies, width)
                        posted = (self._post_rows(peer, dest.numpy(), parts), n, parts, dest)
                    rows, want, cut, dest = posted
                    posted = None
                    if n > want or (n and shape[0] * shape[2] != row):
                        raise TransportError(
                            f"the UCX peer sent {n} rows of {shape[0] * shape[2]} bytes where "
                            f"{want} of {row} were expected (row size changed mid-batch?)"
                        )
                    if parts != cut:
                        raise TransportError(
                            f"the UCX peer cut a chunk in {parts} parts, not {cut}"
                        )
                    batch = None  # a short chunk of no rows: its padding only
                    if n:
                        chunk = dest[: n * row].view(shape)
                        batch = BlockBatch(n, chunk, tuple(tuple(c) for c in sums))
                    flight.append((rows, batch))
                    at, got = at + dest.numel(), got + n
                    if msg.get("more") and n == want:  # the next chunk's receives, now
                        head = asyncio.ensure_future(recv_msg(ep))
                        size = next_chunk(len(keys) - got, n, max(1, cfg.chunk_bytes // row))
                        if not 0 < size <= len(keys) - got:
                            raise TransportError("the UCX peer offered more rows than asked")
                        dest = self._into(land, staging, at, got, size, copies, width)
                        cut = len(cuts(dest.numel(), stripes, min_part))
                        posted = (self._post_rows(peer, dest.numpy(), cut), size, cut, dest)
                    continue
                rows, chunk = flight[0]  # the oldest chunk's rows, or the next header
                await asyncio.wait([rows] if head is None else [rows, head],
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if rows.done():
                    rows.result()  # TransportError if they did not all arrive in time
                    flight.popleft()
                    if chunk is not None:
                        hand(chunk)
        finally:
            late = [posted[0]] if posted is not None else []
            for f in [r for r, _ in flight] + late + ([head] if head is not None else []):
                f.cancel()
        peer.staging = None
        return at

    def _into(
        self,
        land: Land | None,
        staging: torch.Tensor,
        at: int,
        got: int,
        count: int,
        copies: int,
        width: int,
    ) -> torch.Tensor:
        """Where the rows of keys ``got .. got + count`` are received: the reader's own rows
        where ``land`` offers them (for as long as the receive may write: its transfer
        timeout, then the connections' bye and abort), else their slice of ``staging``
        (from ``at``)."""
        nbytes = count * copies * width
        if land is not None:
            seconds = self.config.transfer_timeout(nbytes) + self.config.timeout_s
            dest = land(got, count, copies, width, seconds)
            if dest is not None:
                if dest.dtype != torch.uint8 or dest.numel() != nbytes or not dest.is_contiguous():
                    raise ValueError(
                        f"land offered {dest.numel()} bytes ({dest.dtype}) for {count} rows of "
                        f"{copies} x {width} bytes; it must offer exactly that, contiguous uint8"
                    )
                return dest.view(-1)
        return staging[at : at + nbytes]

    def _post_rows(self, peer: _Peer, dest: Any, parts: int) -> asyncio.Future:
        """Post the receives of one chunk's rows (``parts`` byte ranges on as many stripes,
        into ``dest``) now, in order; returns what completes once they all arrived."""
        cfg = self.config
        spans = ranges(dest.nbytes, parts)
        if len(spans) > len(peer.eps) or (dest.nbytes and len(spans) != parts):
            raise TransportError(
                f"the UCX peer striped over {parts} endpoints, we have {len(peer.eps)}"
            )
        # a task's first step posts its receive; tasks start in the order they are created
        recvs = [asyncio.ensure_future(e.recv_rows(dest[a:b]))
                 for e, (a, b) in zip(peer.eps, spans, strict=False)]  # fmt: skip

        async def landed() -> None:
            limit = cfg.transfer_timeout(dest.nbytes)
            try:
                await asyncio.wait_for(asyncio.gather(*recvs), limit)
            except TimeoutError:
                raise TransportError(
                    f"{dest.nbytes} bytes did not arrive within {limit:.1f}s; the peer "
                    "stalled or died (RAYKV_UCX_MIN_GBPS sets the slowest rate allowed)"
                ) from None
            finally:
                for r in recvs:
                    r.cancel()

        return asyncio.ensure_future(landed())

    async def _peer(self, source: str, key: Where) -> _Peer:
        async with self._connecting.setdefault(key, asyncio.Lock()):
            peer = self._peers.get(key)
            if peer is not None and peer.alive():
                return peer
            if peer is not None:
                await self._drop(key, peer)
            client = secrets.token_hex(8)
            # stripe 0 first: a peer that refuses us is asked (and counts us) once
            first = await self._open(source, key, client, 0)
            opened = [first] + await asyncio.gather(
                *(self._open(source, key, client, i) for i in range(1, self.config.stripes)),
                return_exceptions=True,
            )
            errors = [e for e in opened if isinstance(e, BaseException)]
            if errors:
                for ep in opened:
                    if not isinstance(ep, BaseException):
                        ep.abort()
                raise errors[0]
            peer = self._peers[key] = _Peer(list(opened))
            return peer

    async def _open(self, source: str, where: Where, client: str, stripe: int) -> Conn:
        """One authenticated connection, from our worker ``stripe`` to the server's (of as many
        as it runs): hello (our worker's address, our receive tag), the server's receive tag
        back, the handshake, then this connection's stripe."""
        import ucxx

        t, ep = self.config.timeout_s, None
        try:
            worker = await self.runtime.worker(stripe)
            mine = await self.runtime.worker_address(stripe)
            address = ucxx.get_ucx_address_from_buffer(
                where.addresses[stripe % len(where.addresses)]
            )
            ep = await asyncio.wait_for(worker.create_endpoint_from_worker_address(address), t)
            conn = Conn(ep, send_tag=where.tag, recv_tag=new_tag())
            await asyncio.wait_for(send_frame(conn, hello_frame(mine, conn.recv_tag)), t)
            conn.send_tag = int.from_bytes(await asyncio.wait_for(recv_frame(conn, 8), t), "little")
        except Exception as e:
            if ep is not None:
                ep.abort()
            raise TransportError(
                f"cannot connect to {source}'s UCX worker on {where.host} ({type(e).__name__}:"
                f" {e}); is the node reachable over RAYKV_UCX_NET_DEVICES / RAYKV_UCX_TLS?"
            ) from None

        async def send(frame: bytes) -> None:
            await send_frame(conn, frame)

        async def recv(n: int) -> bytes:
            return await recv_frame(conn, n)

        try:
            await asyncio.wait_for(client_handshake(self._secret, send, recv), t)
            await asyncio.wait_for(send_msg(conn, {"client": client, "stripe": stripe}), t)
            if (await asyncio.wait_for(recv_msg(conn), t)).get("ok") is not True:
                raise TransportError(f"{source} did not accept UCX stripe {stripe}")
        except AuthError as e:
            conn.abort()
            if stripe == 0:
                self.counts["refused"] += 1
                log.warning("UCX peer %s on %s refused or failed auth: %s", source, where.host, e)
            raise
        except Exception as e:
            conn.abort()
            if isinstance(e, TransportError):
                raise
            raise TransportError(
                f"{source}'s UCX server on {where.host} closed the connection during the "
                f"handshake ({type(e).__name__}: {e}); it does not hold this node's transport "
                "secret or is not a raykv listener"
            ) from None
        return conn

    async def _drop(self, key: Where, peer: _Peer) -> None:
        if self._peers.get(key) is peer:
            del self._peers[key]
        await self._bye(peer)

    async def _bye(self, peer: _Peer) -> None:
        """Tell the server (best effort, briefly) to drop ``peer``'s connections; abort them."""
        byes = [send_msg(c, {"op": "bye"}) for c in peer.eps if not c.closed]
        await asyncio.gather(*(asyncio.wait_for(b, BYE_TIMEOUT_S) for b in byes),
                             return_exceptions=True)  # fmt: skip
        peer.abort()


def ucx_reader(config: UcxConfig | None = None) -> UcxTransport | None:
    """A ``UcxTransport`` when this process can read over UCX (ucxx installed, ``RAYKV_UCX``
    not 0, ``RAYKV_TRANSPORT_SECRET`` set); None (and why, in the log) otherwise: the reader
    then fetches over the object store."""
    from raykv.transport.auth import SECRET_ENV, secret_from_env
    from raykv.transport.ucx.runtime import available

    config = config or UcxConfig.from_env()
    secret = secret_from_env()
    if not config.enabled or not available() or secret is None:
        if config.enabled and available():
            log.info("no UCX: %s is not set on this node", SECRET_ENV)
        return None
    try:
        return UcxTransport(secret, config)
    except TransportError as e:
        log.warning("no UCX here: %s", e)
        return None

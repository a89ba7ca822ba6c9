"""``UcxServer``: a member's UCX endpoint, serving fetches of the blocks it holds.

The member hands in its ``export(model, keys)`` coroutine (the same one the object store
transport calls: the leading keys it holds as one gathered buffer plus their stored
checksums); the server runs it on the member's own event loop (``owner_loop``, a Ray actor's)
and moves the buffer over UCX as ``raykv.transport.ucx.wire`` describes. A member that
``lends`` (a CPU tier) may answer with a ``Lent`` instead: its own rows, where they lie one
after another, sent from where they are (no gather) and released once they are out.

Every connection is authenticated first (``raykv.transport.auth``, bounded by
``timeout_s``); a peer that fails (or whose hello is not raykv's) reads nothing, writes
nothing, is logged and counted (``refused``, and ``on_refused`` on the owner's loop for its
metrics).

No listener. ucxx 0.52's sockaddr listener takes a port but no address and binds the
wildcard address (every interface of the host). So the server listens on nothing: it
advertises the addresses of its UCX workers and a hello tag (``endpoint``: ``(host, [address
hex per worker], tag)``, ``host`` only for logs), and receives hellos on each worker (on that
tag); a reader connects by worker address, its stripe ``i`` to worker ``i`` (of as many as the
server runs: ``stripes``, each with its own progress thread, ``raykv.transport.ucx.runtime``),
and the server answers each connection from the worker its hello came to. The only sockets
are UCX's transport sockets, which bind the addresses of ``UCX_NET_DEVICES``
(``RAYKV_UCX_NET_DEVICES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from raykv.transport.auth import check_secret, serve_handshake
from raykv.transport.base import Lent
from raykv.transport.ucx.config import UcxConfig
from raykv.transport.ucx.runtime import UcxRuntime
from raykv.transport.ucx.wire import (
    FIRST_CHUNK_KEYS,
    MAX_HELLO,
    Conn,
    cuts,
    new_tag,
    next_chunk,
    parse_hello,
    post_msg,
    recv_frame,
    recv_msg,
    rows_tag,
    send_frame,
    send_msg,
    stripes_for,
)

# export(model, keys, out=buffer or None[, lend=seconds]): ``out`` (uint8, 1-D), when big
# enough, is where the member gathers the rows (a view of it comes back), so a server sends
# from buffers it reuses; a member that ``lends`` may answer with a ``Lent`` (its own rows,
# leased for longer than ``seconds``, the most its send may take, and released once they are
# out: no gather)
Export = Callable[..., Awaitable[tuple[int, np.ndarray, list[list[int]]] | Lent]]
SPARE_BYTES = 256 << 20  # gather buffers a server keeps for its next chunks (fresh pages
# cost ~40 ms per 128 MiB of page faults on the 2-core box: more than the gather itself)
log = logging.getLogger(__name__)
START_TIMEOUT_S = 30.0
# chunks whose rows may be on the wire while the next one is exported: with the stripes on
# workers of their own a 16 MiB chunk crosses in ~2 ms, about what a chunk's round of
# header, receives posted and send completion takes (16-core H100, tcp, 512 x 256 KiB,
# chunks whole to the end, ``next_chunk``: 3 in flight 0.82 x raw ucxx scattered and
# 1.13-1.23 x in place, 2 in flight 0.73-0.80 x and 1.00-1.19 x)
CHUNKS_IN_FLIGHT = 3


class UcxServer:
    def __init__(
        self,
        secret: bytes,
        export: Export,
        *,
        host: str,
        config: UcxConfig | None = None,
        owner_loop: asyncio.AbstractEventLoop | None = None,
        on_refused: Callable[[str], None] | None = None,
        lends: bool = False,
    ) -> None:
        self._secret = check_secret(secret)
        self.export = export
        self.lends = lends  # export takes ``lend=seconds`` and may answer with a ``Lent``
        self.host = host
        self.config = config or UcxConfig.from_env()
        self.owner_loop = owner_loop
        self.on_refused = on_refused
        self.runtime = UcxRuntime.get(self.config.tls, self.config.net_devices)
        self.addresses: list[bytes] = []  # this process's UCX workers' addresses, served
        self.tag = 0  # the tag hellos arrive on
        self.counts: Counter[str] = Counter()
        self._accepting: list[asyncio.Task] = []  # one hello receive per worker
        self._tasks: set[asyncio.Task] = set()
        self._eps: dict[tuple[str, int], Conn] = {}  # (client id, stripe) -> connection
        self._ids = itertools.count()
        self._spare: list[np.ndarray] = []  # gather buffers whose rows went out

    @property
    def endpoint(self) -> tuple[str, list[str], int]:
        """What a reader needs: (host, for logs; its workers' addresses, hex; hello tag)."""
        return (self.host, [a.hex() for a in self.addresses], self.tag)

    def start(self) -> tuple[str, list[str], int]:
        """Accept hellos (on every worker); returns the endpoint to advertise."""
        if not self._accepting:
            self.runtime.submit(self._listen()).result(START_TIMEOUT_S)
        return self.endpoint

    async def _listen(self) -> None:
        self.tag, self.addresses = new_tag(), []
        for i in range(self.config.stripes):
            self.addresses.append(await self.runtime.worker_address(i))
            worker = await self.runtime.worker(i)
            self._accepting.append(asyncio.ensure_future(self._accept(worker)))

    def stop(self) -> None:
        async def close() -> None:
            for task in self._accepting:
                task.cancel()
            self._accepting = []
            for task in list(self._tasks):
                task.cancel()
            for conn in list(self._eps.values()):
                conn.abort()
            self._eps.clear()

        self.runtime.submit(close()).result(START_TIMEOUT_S)

    def stats(self) -> dict[str, int]:
        """``refused``: peers that failed the handshake; ``batches`` / ``bytes`` served;
        ``errors``: connections this side ended by a fault of its own; ``connections``:
        connections open now."""
        return {**{k: self.counts[k] for k in ("refused", "batches", "bytes", "errors")},
                "connections": len(self._eps)}  # fmt: skip

    # --- one connection -------------------------------------------------------------------

    async def _accept(self, worker: Any) -> None:
        """Receive hellos on ``worker``, one connection each, until stopped."""
        while True:
            buf = np.empty(MAX_HELLO, np.uint8)
            try:
                await worker.recv(buf, self.tag)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a message larger than any hello: not a raykv peer
                self._refuse(next(self._ids), e)
                await asyncio.sleep(0.01)  # never a busy loop, whatever arrives
                continue
            task = asyncio.ensure_future(self._handle(buf.tobytes(), worker))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _connect(self, hello: bytes, worker: Any) -> Conn:
        """The reply connection to the client that sent ``hello`` (to ``worker``), from
        ``worker``: the client's sends on this connection arrive there."""
        import ucxx

        client_tag, address = parse_hello(hello)
        ep = await asyncio.wait_for(
            worker.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(address)),
            self.config.timeout_s,
        )
        recv_tag = new_tag()
        taken = {t for c in self._eps.values() for t in (c.recv_tag, rows_tag(c.recv_tag))}
        while recv_tag in taken or rows_tag(recv_tag) in taken:
            recv_tag = new_tag()
        return Conn(ep, send_tag=client_tag, recv_tag=recv_tag)

    async def _handle(self, hello: bytes, worker: Any) -> None:
        conn_id = next(self._ids)
        t = self.config.timeout_s
        conn: Conn | None = None

        async def send(frame: bytes) -> None:
            await send_frame(conn, frame)

        async def recv(n: int) -> bytes:
            return await recv_frame(conn, n)

        try:
            conn = await self._connect(hello, worker)
            await asyncio.wait_for(send_frame(conn, conn.recv_tag.to_bytes(8, "little")), t)
            await asyncio.wait_for(serve_handshake(self._secret, send, recv), t)
        except Exception as e:  # wrong secret, no secret (silence, garbage), a dead peer
            self._refuse(conn_id, e)
            if conn is not None:
                conn.abort()
            return
        me: tuple[str, int] | None = None
        try:
            hello_msg = await asyncio.wait_for(recv_msg(conn), t)
            me = (str(hello_msg["client"]), int(hello_msg["stripe"]))
            self._eps[me] = conn
            await asyncio.wait_for(send_msg(conn, {"ok": True}), t)
            while True:  # idle connections wait here until their peer says bye or dies
                req = await recv_msg(conn)
                if req.get("op") == "bye":
                    return
                if req.get("op") != "fetch":
                    raise ValueError(f"unknown request {str(req.get('op'))[:40]!r}")
                await self._fetch(conn, me[0], req)
        except Exception as e:  # the peer closed, died, or spoke nonsense: drop it
            if _peer_went(e):
                log.debug("ucx connection %d from %s closed: %r", conn_id, me, e)
            else:  # a fault of this side (its reader waits out its timeout): said, counted
                self.counts["errors"] += 1
                log.warning("ucx connection %d from %s failed here: %r", conn_id, me, e)
        finally:
            if me is not None and self._eps.get(me) is conn:
                del self._eps[me]
            conn.abort()

    def _refuse(self, conn: int, error: BaseException) -> None:
        self.counts["refused"] += 1
        reason = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        log.warning(
            "refused UCX connection %d on %s (tag %x): it did not authenticate (%s)",
            conn, self.host, self.tag, reason,
        )  # fmt: skip
        if self.on_refused is not None:
            if self.owner_loop is not None:
                self.owner_loop.call_soon_threadsafe(self.on_refused, reason)
            else:
                self.on_refused(reason)

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A gather buffer of at least ``nbytes``: the smallest spare that fits, else new."""
        fits = [i for i, b in enumerate(self._spare) if b.nbytes >= nbytes]
        if not fits:
            return np.empty(nbytes, np.uint8)
        return self._spare.pop(min(fits, key=lambda i: self._spare[i].nbytes))

    def _give_back(self, buf: np.ndarray | None) -> None:
        """``buf``'s rows are out: keep it for a later chunk (the largest, up to SPARE_BYTES)."""
        if buf is None:
            return
        self._spare.append(buf)
        self._spare.sort(key=lambda b: -b.nbytes)
        while sum(b.nbytes for b in self._spare) > SPARE_BYTES:
            self._spare.pop()

    async def _export(
        self, model: str, keys: list[bytes], out: np.ndarray | None, nbytes: int
    ) -> tuple[int, np.ndarray, list, Callable[[], None] | None]:
        """(count, rows, sums, release: None, or what ends the lend of rows sent in place)
        for a chunk of at most ``nbytes``."""
        # how long its send may read them: its timeout, then the connection's abort
        seconds = self.config.transfer_timeout(nbytes) + self.config.timeout_s
        got = await self._exported(model, keys, out, seconds)
        if isinstance(got, Lent):
            return got.count, got.rows, got.sums, self._on_owner(got.release)
        return (*got, None)

    def _on_owner(self, release: Callable[[], None]) -> Callable[[], None]:
        """``release``, run on the owner's loop (the member's state is its loop's) once."""
        done = []

        def run() -> None:
            if done:
                return
            done.append(True)
            if self.owner_loop is None:
                release()
            else:
                with contextlib.suppress(RuntimeError):  # the owner's loop is gone
                    self.owner_loop.call_soon_threadsafe(release)

        return run

    async def _exported(
        self, model: str, keys: list[bytes], out: np.ndarray | None, seconds: float
    ) -> Any:
        coro = self.export(model, keys, out=out, **({"lend": seconds} if self.lends else {}))
        if self.owner_loop is None or self.owner_loop is asyncio.get_running_loop():
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.owner_loop))

    async def _fetch(self, ep: Any, client: str, req: dict[str, Any]) -> None:
        """Export and send the batch in chunks (``next_chunk``), each one header plus its
        rows, striped. Once a chunk's header and rows are posted on the wire, the next chunk
        is gathered (on the owner's loop) while they travel, and its header and rows follow
        as soon as it is (``CHUNKS_IN_FLIGHT`` chunks on the wire at most). A chunk after
        the first is sent at the size the reader expects (``wire``: it posted its
        receives before the header); one that comes back short ends the batch (the holder's
        prefix ends there)."""
        t = self.config.timeout_s
        try:
            model, keys = str(req["model"]), [bytes.fromhex(k) for k in req["keys"]]
            chunk_bytes = max(1, int(req.get("chunk_bytes", 1 << 62)))
            stripes, min_part = int(req.get("stripes", 1)), int(req.get("min_part", 1))
        except (KeyError, TypeError, ValueError) as e:
            await asyncio.wait_for(send_msg(ep, {"error": f"bad request: {e}"}), t)
            return
        start, size = 0, min(len(keys), FIRST_CHUNK_KEYS)
        buf: np.ndarray | None = None  # the buffer the pending export gathers into
        pending: asyncio.Future | None = asyncio.ensure_future(
            self._export(model, keys[:size], None, chunk_bytes)
        )
        expect = 0  # bytes the reader posted for this chunk (0: the first, sized by its header)
        flight: deque[asyncio.Future] = deque()  # chunks' rows still going out, in order
        try:
            while pending is not None:
                try:
                    n, rows, sums, release = await pending
                except Exception as e:  # the member refused: the reader misses the rest
                    pending = None
                    self._give_back(buf)
                    await asyncio.wait_for(send_msg(ep, {"error": f"{type(e).__name__}: {e}"}), t)
                    break
                end = start + size
                more = n == size and end < len(keys)
                pending = None
                if release is not None:  # sent from the member's own rows: buf not used
                    self._give_back(buf)
                    buf = None
                flat = np.ascontiguousarray(rows).reshape(-1)
                if expect and flat.nbytes > expect:  # not the reader's row size: refuse
                    self._give_back(buf)
                    if release is not None:
                        release()
                    err = f"row size changed mid-batch ({flat.nbytes} > {expect} bytes)"
                    await asyncio.wait_for(send_msg(ep, {"error": err}), t)
                    break
                if expect and flat.nbytes < expect:  # short: sent at the size posted for it
                    flat = np.concatenate([flat, np.zeros(expect - flat.nbytes, np.uint8)])
                sent = asyncio.ensure_future(self._send(
                    ep, client, flat, list(rows.shape), sums, more, stripes, min_part))  # fmt: skip
                sent.add_done_callback(lambda f, b=buf: _reuse_if_sent(f, b, self._give_back))
                if release is not None:  # the lease ends once the rows are out (or failed)
                    sent.add_done_callback(lambda f, r=release: r())
                if more:  # gather the next chunk while this one travels
                    row = rows.shape[0] * rows.shape[2]
                    size = next_chunk(len(keys) - end, size, max(1, chunk_bytes // row))
                    expect = size * row
                    buf = self._buffer(expect)
                    pending = asyncio.ensure_future(
                        self._export(model, keys[end : end + size], buf, expect)
                    )
                flight.append(sent)
                start = end
                while len(flight) >= CHUNKS_IN_FLIGHT:  # the oldest chunk's rows are out
                    await flight.popleft()
            while flight:
                await flight.popleft()
        except BaseException:
            for f in (pending, *flight):
                if f is not None:
                    f.cancel()
            if pending is not None:  # an export that came back unsent: end its lend now
                pending.add_done_callback(_release_unsent)
            raise

    def _send(self, ep: Any, client: str, flat: np.ndarray, shape: list[int], sums: list,
              more: bool, stripes: int, min_part: int) -> Awaitable[None]:  # fmt: skip
        """Post a chunk's header (its rows' ``shape``) and its bytes ``flat`` on the stripes
        now (the bytes do not wait for the header: they match on their own tag); returns
        what completes once all of it is out (bounded by ``transfer_timeout``)."""
        eps = [ep]
        want = stripes_for(flat.nbytes, stripes, min_part)
        while len(eps) < want and (client, len(eps)) in self._eps:
            eps.append(self._eps[(client, len(eps))])
        parts = cuts(flat.nbytes, len(eps), min_part)
        head = {
            "count": shape[1],
            "shape": shape,
            "sums": [[int(x) for x in c] for c in sums],
            "parts": max(1, len(parts)),
            "more": more,
        }
        # each task's first step posts its send, in the order the tasks are created
        sends = [post_msg(ep, head)]
        sends += [asyncio.ensure_future(e.send_rows(flat[a:b]))
                  for e, (a, b) in zip(eps, parts, strict=False)]  # fmt: skip

        async def sent() -> None:
            together = asyncio.gather(*sends)
            together.add_done_callback(_retrieved)  # its error is the one raised here
            try:
                await asyncio.wait_for(together, self.config.transfer_timeout(flat.nbytes))
            except BaseException:
                for s in sends:
                    s.cancel()
                raise
            self.counts["batches"] += 1
            self.counts["bytes"] += flat.nbytes

        return sent()


def _peer_went(e: BaseException) -> bool:
    """Whether ``e`` ends a connection from the peer's side (it closed, died, timed out or
    spoke nonsense), not from a fault of this server."""
    peer = (ConnectionError, TimeoutError, EOFError, ValueError, KeyError, TypeError)
    return type(e).__module__.startswith("ucxx") or isinstance(e, peer)


def _retrieved(f: asyncio.Future) -> None:
    """Mark a future's outcome seen (the error it ended with is handled where awaited)."""
    if not f.cancelled():
        f.exception()


def _release_unsent(exported: asyncio.Future) -> None:
    """An export whose rows will not be sent: end its lend, if it lent any."""
    if not exported.cancelled() and exported.exception() is None:
        release = exported.result()[3]
        if release is not None:
            release()


def _reuse_if_sent(
    sent: asyncio.Future, buf: np.ndarray | None, give_back: Callable[[np.ndarray | None], None]
) -> None:
    """After a chunk's sends ended: its buffer is reused only if every send completed (a
    failed or cancelled one may still be reading it)."""
    if not sent.cancelled() and sent.exception() is None:
        give_back(buf)


def ucx_server(
    export: Export,
    *,
    host: str,
    owner_loop: asyncio.AbstractEventLoop | None = None,
    on_refused: Callable[[str], None] | None = None,
    config: UcxConfig | None = None,
    lends: bool = False,
) -> UcxServer | None:
    """A started ``UcxServer`` when this process can serve UCX (ucxx installed, ``RAYKV_UCX``
    not 0, ``RAYKV_TRANSPORT_SECRET`` set: never an unauthenticated listener); else None."""
    from raykv.errors import TransportError
    from raykv.transport.auth import SECRET_ENV, secret_from_env
    from raykv.transport.ucx.runtime import available

    config = config or UcxConfig.from_env()
    secret = secret_from_env()
    if not config.enabled or not available():
        return None
    if secret is None:
        log.warning(
            "no UCX listener: %s is not set on this node (blocks move over the object store); "
            "set it on every node to the same random string", SECRET_ENV,
        )  # fmt: skip
        return None
    try:
        server = UcxServer(secret, export, host=config.host or host, config=config,
                           owner_loop=owner_loop, on_refused=on_refused, lends=lends)  # fmt: skip
        server.start()
    except TransportError as e:
        log.warning("no UCX listener here: %s", e)
        return None
    return server

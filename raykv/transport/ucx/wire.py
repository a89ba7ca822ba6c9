"""What crosses a raykv UCX connection, message by message (tag send/recv, worker-address mode).

No sockaddr listener (ucxx's binds the wildcard address): a server advertises its UCX worker
address and a hello tag; a client creates an endpoint from that address and sends one hello
message on the hello tag (``hello_frame``: its own worker address and the tag it will receive
on). The server creates the reply endpoint from the client's address and picks the tag it
receives this connection on; its first frame (8 bytes, on the client's tag) names it. From
then on each side sends on the other's tag (``Conn``): tags are chosen by their receiver,
fresh and random per connection, and every receive is matched on its full tag. A hello
costs the server one endpoint to the address it names (how else to answer it) and nothing
more until the handshake passes; one that fails within ``timeout_s`` is aborted and counted.

Then, before anything else, the auth handshake (``raykv.transport.auth``: three fixed-size
frames, received into buffers of exactly that size, so a peer that sends anything else
fails the receive), then ``{"client": id, "stripe": i}`` from the client, acknowledged by
``{"ok": true}`` once the server has filed the connection as stripe ``i`` of that client.
``{"op": "bye"}`` from the client ends a connection (the server drops its endpoint).

A fetch, always on the client's stripe 0: the request ``{"op": "fetch", "model", "keys"
(hex), "stripes": k, "min_part": bytes, "chunk_bytes": bytes}``; then per chunk the header
``{"count": n, "shape": [copies, n, width], "sums": [[...] per copy], "parts": p, "more":
bool}`` (or ``{"error": text}``) and the rows, one contiguous buffer ``[copies, n, width]``
cut into ``p`` byte ranges (``cuts``), range ``i`` sent on stripe ``i`` of the same client,
all in parallel, each received straight into its slice of the reader's staging buffer.
Rows travel on a tag of their own (``rows_tag``: each side's receive tag with its top bit
flipped), so their receives match apart from the control messages: the reader posts a
chunk's row receives before its header arrives. Chunk sizes (``next_chunk``) follow from
the first chunk's row size and the request, so both sides know the next chunk's bytes and
cuts once a header says ``more``; a chunk that comes back short (the holder's prefix ended)
is still sent at that size (its count says how many rows are real, the rest is zeros), so
every posted receive is matched and none is left behind. Control messages are JSON (a
uint64 size, then the bytes, the size checked before anything is allocated); nothing
received is unpickled.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import struct
from collections.abc import Awaitable
from typing import Any

import numpy as np

from raykv.errors import TransportError

MAX_CONTROL_BYTES = 64 << 20  # a header of 512 keys x 8 copies is ~100 KiB
ALIGN = 4096
HELLO_MAGIC = b"RKVH"
_HELLO = struct.Struct("<4sQI")  # magic, the client's receive tag, its address's length
MAX_HELLO = 64 << 10  # a worker address is ~50 bytes over tcp, a few KiB with every transport
TAG_BYTES = 8
ROWS_BIT = 1 << 63  # rows_tag(tag): where a connection's rows travel
FIRST_CHUNK_KEYS = 8  # the first chunk is small: it tells the row size, and starts the wire


def new_tag() -> int:
    """A fresh random 64-bit tag (never 0)."""
    return secrets.randbits(64) or 1


def rows_tag(tag: int) -> int:
    """The tag a connection's rows travel on, beside its control messages on ``tag``."""
    return tag ^ ROWS_BIT


class Conn:
    """One raykv UCX connection: an endpoint to the peer's worker, the tag the peer receives
    on (``send_tag``) and the tag this side receives on (``recv_tag``). ``send`` / ``recv``
    are what ``send_msg`` / ``recv_msg`` call; receives post on the endpoint, so a peer
    that dies cancels them."""

    def __init__(self, ep: Any, send_tag: int, recv_tag: int) -> None:
        self.ep, self.send_tag, self.recv_tag = ep, send_tag, recv_tag

    async def send(self, buf: Any) -> None:
        await self.ep.send(buf, tag=self.send_tag, force_tag=True)

    async def recv(self, buf: Any) -> None:
        await self.ep.recv(buf, tag=self.recv_tag, force_tag=True)

    async def send_rows(self, buf: Any) -> None:
        await self.ep.send(buf, tag=rows_tag(self.send_tag), force_tag=True)

    async def recv_rows(self, buf: Any) -> None:
        await self.ep.recv(buf, tag=rows_tag(self.recv_tag), force_tag=True)

    @property
    def closed(self) -> bool:
        return bool(self.ep.closed)

    def abort(self) -> None:
        self.ep.abort()


def hello_frame(address: bytes, recv_tag: int) -> bytes:
    """The client's first message: its worker address and the tag it receives on."""
    return _HELLO.pack(HELLO_MAGIC, recv_tag, len(address)) + address


def parse_hello(raw: bytes) -> tuple[int, bytes]:
    """(the client's receive tag, its worker address) of a hello; TransportError if it is
    not one (``raw`` may be longer than the message: the rest is ignored)."""
    if len(raw) < _HELLO.size:
        raise TransportError("a UCX hello too short to be raykv's")
    magic, tag, n = _HELLO.unpack_from(raw)
    if magic != HELLO_MAGIC or not 0 < n <= len(raw) - _HELLO.size or not tag:
        raise TransportError("not a raykv UCX hello (bad magic, tag or address length)")
    return tag, bytes(raw[_HELLO.size : _HELLO.size + n])


async def send_frame(ep: Any, frame: bytes) -> None:
    await ep.send(np.frombuffer(frame, np.uint8))


async def recv_frame(ep: Any, n: int) -> bytes:
    buf = np.empty(n, np.uint8)
    await ep.recv(buf)
    return buf.tobytes()


def post_msg(ep: Any, msg: dict[str, Any]) -> Awaitable[Any]:
    """Post a control message's two sends (its size, its bytes) now, in order (so a message
    posted later cannot come between them); returns what completes once both are out."""
    raw = json.dumps(msg, separators=(",", ":")).encode()
    size = asyncio.ensure_future(ep.send(np.array([len(raw)], np.uint64)))
    return asyncio.gather(size, asyncio.ensure_future(send_frame(ep, raw)))


async def send_msg(ep: Any, msg: dict[str, Any]) -> None:
    await post_msg(ep, msg)


async def recv_msg(ep: Any) -> dict[str, Any]:
    size = np.empty(1, np.uint64)
    await ep.recv(size)
    if int(size[0]) > MAX_CONTROL_BYTES:
        raise TransportError(f"a UCX control message of {int(size[0])} bytes; the peer is broken")
    raw = await recv_frame(ep, int(size[0]))
    try:
        msg = json.loads(raw)
    except ValueError as e:
        raise TransportError(f"a UCX control message is not JSON ({e})") from None
    if not isinstance(msg, dict):
        raise TransportError("a UCX control message is not a JSON object")
    return msg


def ranges(nbytes: int, parts: int) -> list[tuple[int, int]]:
    """``nbytes`` cut into at most ``parts`` contiguous non-empty ranges, page-aligned."""
    if nbytes <= 0:
        return []
    parts = max(1, min(parts, -(-nbytes // ALIGN)))
    step = -(-nbytes // parts // ALIGN) * ALIGN
    return [(a, min(a + step, nbytes)) for a in range(0, nbytes, step)]


def stripes_for(nbytes: int, wanted: int, min_part: int) -> int:
    """How many stripes a buffer of ``nbytes`` uses: at most ``wanted``, each at least
    ``min_part`` bytes (at least one)."""
    return max(1, min(wanted, nbytes // max(1, min_part)))


def cuts(nbytes: int, stripes: int, min_part: int) -> list[tuple[int, int]]:
    """The byte ranges a chunk of ``nbytes`` travels in, one per stripe used (both sides
    compute them: the reader posts its receives before the header names ``parts``)."""
    return ranges(nbytes, stripes_for(nbytes, stripes, min_part))


def next_chunk(remaining: int, prev: int, most: int) -> int:
    """Keys in a batch's next chunk, after one of ``prev`` keys, ``remaining`` keys to go,
    at most ``most`` a chunk (``chunk_bytes`` over the row size). Chunks double from the
    first (the wire starts early, and each gather overlaps a chunk half its size on the
    wire) and stay at ``most`` to the end. Not halved towards the end: each chunk costs
    ~1-2 ms from post to done whatever its size (header, then its receives posted), and the
    reader verifies a chunk on its hashing threads in well under that. 512 x 256 KiB, 16-core
    H100, tcp, 4 workers each side, 2 chunks on the wire, halved (36, 18, 9, 9 keys at the
    end) against whole: in place 0.91-0.97 x raw ucxx against 1.00-1.19 x, scattered
    0.64-0.67 x against 0.73-0.80 x (3 on the wire and whole: 1.13-1.23 x and 0.82 x)."""
    if remaining <= 2 * FIRST_CHUNK_KEYS:
        return max(0, remaining)
    return max(1, min(2 * prev, most, remaining))


def check_header(head: dict[str, Any], asked: int) -> tuple[int, list[int], list[list[int]], int]:
    """(count, shape, sums, parts) of a fetch header; TransportError if it is malformed."""
    if "error" in head:
        raise TransportError(f"the UCX peer could not export the blocks: {head['error']}")
    try:
        n, shape, sums, parts = int(head["count"]), list(head["shape"]), head["sums"], head["parts"]
        ok = (
            0 <= n <= asked
            and len(shape) == 3
            and shape[1] == n
            and min(shape) >= 0
            and (n == 0 or (len(sums) == shape[0] and all(len(c) == n for c in sums)))
            and int(parts) >= 1
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise TransportError(f"a malformed UCX fetch header: {str(head)[:200]}")
    return n, [int(x) for x in shape], [[int(x) for x in c] for c in sums], int(parts)

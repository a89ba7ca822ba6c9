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
(hex), "stripes": k, "min_part": bytes}``; the header ``{"count": n, "shape": [copies, n,
width], "sums": [[...] per copy], "parts": p}`` (or ``{"error": text}``); then the rows,
one contiguous buffer ``[copies, n, width]`` cut into ``p`` byte ranges (``ranges``), range
``i`` sent on stripe ``i`` of the same client, all in parallel, each received straight into
its slice of the reader's staging buffer. Control messages are JSON (a uint64 size, then
the bytes, the size checked before anything is allocated); nothing received is unpickled.
"""

from __future__ import annotations

import json
import secrets
import struct
from typing import Any

import numpy as np

from raykv.errors import TransportError

MAX_CONTROL_BYTES = 64 << 20  # a header of 512 keys x 8 copies is ~100 KiB
ALIGN = 4096
HELLO_MAGIC = b"RKVH"
_HELLO = struct.Struct("<4sQI")  # magic, the client's receive tag, its address's length
MAX_HELLO = 64 << 10  # a worker address is ~50 bytes over tcp, a few KiB with every transport
TAG_BYTES = 8


def new_tag() -> int:
    """A fresh random 64-bit tag (never 0)."""
    return secrets.randbits(64) or 1


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


async def send_msg(ep: Any, msg: dict[str, Any]) -> None:
    raw = json.dumps(msg, separators=(",", ":")).encode()
    await ep.send(np.array([len(raw)], np.uint64))
    await send_frame(ep, raw)


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

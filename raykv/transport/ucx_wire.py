"""What crosses a raykv UCX connection, message by message (tag send/recv on one endpoint).

On every new endpoint: the auth handshake (``raykv.transport.auth``: three fixed-size
frames, received into buffers of exactly that size, so a peer that sends anything else
fails the receive), then ``{"client": id, "stripe": i}`` from the client, acknowledged by
``{"ok": true}`` once the server has filed the endpoint as stripe ``i`` of that client.

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
from typing import Any

import numpy as np

from raykv.errors import TransportError

MAX_CONTROL_BYTES = 64 << 20  # a header of 512 keys x 8 copies is ~100 KiB
ALIGN = 4096


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

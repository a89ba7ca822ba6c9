"""One fetch, over the transport chosen for the pair, with the object store as the fallback.

Every reader (a GPU pool loading blocks, a CPU tier pulling them into its arena) fetches
through ``fetch_over``: the transport the coordinator chose for the (holder, reader) pair
(``Location.transport``, ``raykv.transport.select``), its chunks verified as they arrive and
handed to the reader's sink (``raykv.transport.base.receive``); if that transport fails with
``TransportError``, the keys that had not reached the sink yet are fetched once more over
the object store (``FALLBACK``), the sink taking up where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raykv.errors import TransportError
from raykv.transport.base import Asked, Fetched, Land, Sink, Transport, Write, receive
from raykv.transport.select import FALLBACK


async def fetch_over(
    transports: Mapping[str, Transport],
    name: str,
    source: str,
    model: str,
    keys: Sequence[bytes],
    sink: Sink,
    endpoint: Any = None,
    on_fallback: Callable[[str, TransportError], None] | None = None,
    land: Land | None = None,
    write: Write | None = None,
    asked: Asked | None = None,
) -> Fetched:
    """The leading ``keys`` ``source`` holds, verified chunk by chunk into ``sink(position in
    keys, rows)``, over ``transports[name]`` (the fallback if this reader has no such
    transport); if it fails, the rest once more over the fallback (``on_fallback(name,
    error)`` is told, to log and count it). Raises what the last try raised; rows that
    reached the sink before stay there (verified). ``land`` (``Land``): where the first
    transport may receive rows in place; the fallback receives into its own buffers.
    ``write`` (``Write``): the reader's copy of each chunk, checked as it goes. ``asked``
    (``Asked``): told once the first transport's request is on its way."""
    fallback = transports[FALLBACK]
    t = transports.get(name, fallback)
    done = Fetched()
    try:
        chunks = t.stream(source, model, keys, endpoint, land, asked)
        return await receive(chunks, sink, done, write)
    except TransportError as e:
        if t is fallback:
            raise
        if on_fallback is not None:
            on_fallback(t.name, e)
    return await receive(fallback.stream(source, model, keys[done.count :]), sink, done, write)

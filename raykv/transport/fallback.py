"""One fetch, over the route chosen for the pair, with the next routes behind it.

Every reader (a GPU pool loading blocks, a CPU tier pulling them into its arena) fetches
through ``fetch_over``: the transport the coordinator chose for the (holder, reader) pair
(``Location.transport``, ``raykv.transport.select.route``). A direct route (peer reads, NCCL /
gloo pairs: the batch lands in the reader's blocks rank to rank) is run by the reader's
``Direct``; where it fails with ``TransportError`` the next route both ends offer is taken
(``select.after``: a failed peer read goes over NCCL, a failed pair over the object store).
A streamed route's chunks are verified as they arrive and handed to the reader's sink
(``raykv.transport.base.receive``); if it fails, the keys that had not reached the sink yet
are fetched once more over the object store (``FALLBACK``), the sink taking up where it
stopped. So the reader picks nothing: it names the route and how its blocks are written.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from raykv.errors import TransportError
from raykv.transport.base import Asked, Fetched, Land, Sink, Transport, Write, receive
from raykv.transport.select import FALLBACK, after

# a reader's direct route: (transport name, the holder's endpoint for it) -> how it went
# (the rows written and verified in the reader's blocks); TransportError where it failed
Direct = Callable[[str, Any], Awaitable[Fetched]]
# told of each route that failed: (its name, the error, the route taken next)
FellBack = Callable[[str, TransportError, str], None]
# told of the bytes each route delivered (verified, in the reader's blocks): (its name, bytes)
Carried = Callable[[str, int], None]


async def fetch_over(
    transports: Mapping[str, Transport],
    name: str,
    source: str,
    model: str,
    keys: Sequence[bytes],
    sink: Sink,
    endpoint: Any = None,
    on_fallback: FellBack | None = None,
    land: Land | None = None,
    write: Write | None = None,
    asked: Asked | None = None,
    direct: Direct | None = None,
    carried: Carried | None = None,
) -> Fetched:
    """The leading ``keys`` ``source`` holds, verified chunk by chunk into ``sink(position in
    keys, rows)``, over ``transports[name]`` (the fallback if this reader has no such
    transport); if it fails, the rest once more over the fallback (``on_fallback(name,
    error)`` is told, to log and count it). Raises what the last try raised; rows that
    reached the sink before stay there (verified). ``land`` (``Land``): where the first
    transport may receive rows in place; the fallback receives into its own buffers.
    ``write`` (``Write``): the reader's copy of each chunk, checked as it goes. ``asked``
    (``Asked``): told once the first transport's request is on its way. ``direct``: how
    this reader runs a direct route (a transport whose ``direct`` is set); without it such
    a route is refused and the fallback taken. ``carried`` (``Carried``): told the bytes
    each route delivered, whichever way the fetch ends (the reader's metrics per transport:
    only here is it known which route carried which rows)."""
    tell = carried or _ignore
    while direct is not None and getattr(transports.get(name), "direct", False):
        try:
            got = await direct(name, endpoint)
        except TransportError as e:
            then, endpoint = after(name, endpoint)
            if on_fallback is not None:
                on_fallback(name, e, then)
            name = then
            continue
        tell(name, got.nbytes)
        return got
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
            on_fallback(t.name, e, FALLBACK)
    finally:
        tell(t.name, done.nbytes)
    first = done.nbytes
    try:
        return await receive(fallback.stream(source, model, keys[done.count :]), sink, done, write)
    finally:
        tell(FALLBACK, done.nbytes - first)


def _ignore(name: str, nbytes: int) -> None:
    """``carried`` of a reader that counts nothing per route."""

"""One fetch, over the transport chosen for the pair, with the object store as the fallback.

Every reader (a GPU pool loading blocks, a CPU tier pulling them into its arena) fetches
through ``fetch_over``: the transport the coordinator chose for the (holder, reader) pair
(``Location.transport``, ``raykv.transport.select``); if that one fails with
``TransportError``, the same batch once more over the object store (``FALLBACK``). What
comes back is not verified yet: the caller runs ``verify`` before a byte is used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raykv.errors import TransportError
from raykv.transport.base import BlockBatch, Transport
from raykv.transport.select import FALLBACK


async def fetch_over(
    transports: Mapping[str, Transport],
    name: str,
    source: str,
    model: str,
    keys: Sequence[bytes],
    endpoint: Any = None,
    on_fallback: Callable[[str, TransportError], None] | None = None,
) -> BlockBatch:
    """The leading ``keys`` ``source`` holds, over ``transports[name]`` (the fallback if
    this reader has no such transport), retried once over the fallback if it fails;
    ``on_fallback(name, error)`` is told (to log and count it)."""
    fallback = transports[FALLBACK]
    t = transports.get(name, fallback)
    try:
        return await t.fetch(source, model, keys, endpoint)
    except TransportError as e:
        if t is fallback:
            raise
        if on_fallback is not None:
            on_fallback(t.name, e)
    return await fallback.fetch(source, model, keys)

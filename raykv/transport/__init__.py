"""Moving a batch of blocks between members (pool<->pool, tier<->pool, across nodes).

``Transport`` is the one interface; ``ObjectStoreTransport`` (Ray's object store) is the
first implementation and the fallback that works on any Ray cluster. NCCL (GPU<->GPU) and
UCX (host<->host, ``raykv.transport.ucx``: optional, needs ``raykv[ucx]`` and a transport
secret) plug in behind the same interface; every reader fetches through ``fetch_over``. See
``raykv.transport.base``.
"""

from raykv.transport.base import (
    Asked,
    BlockBatch,
    Fetched,
    Land,
    Lent,
    RowCheck,
    Sink,
    Transport,
    Write,
    collect,
    export_rows,
    receive,
    verify,
)
from raykv.transport.fallback import Direct, fetch_over
from raykv.transport.object_store import ObjectStoreTransport
from raykv.transport.select import FALLBACK, OBJECT_STORE, PREFERENCE, choose

__all__ = [
    "FALLBACK",
    "OBJECT_STORE",
    "PREFERENCE",
    "Asked",
    "BlockBatch",
    "Direct",
    "Fetched",
    "Land",
    "Lent",
    "ObjectStoreTransport",
    "RowCheck",
    "Sink",
    "Transport",
    "Write",
    "choose",
    "collect",
    "export_rows",
    "fetch_over",
    "receive",
    "verify",
]

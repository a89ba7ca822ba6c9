"""Moving a batch of blocks between members (pool<->pool, tier<->pool, across nodes).

``Transport`` is the one interface; ``ObjectStoreTransport`` (Ray's object store) is the
first implementation and the fallback that works on any Ray cluster. NCCL (GPU<->GPU) and
UCX (host<->host) plug in behind the same interface. See ``raykv.transport.base``.
"""

from raykv.transport.base import BlockBatch, Transport, export_rows, verify
from raykv.transport.object_store import ObjectStoreTransport
from raykv.transport.select import FALLBACK, OBJECT_STORE, PREFERENCE, choose

__all__ = [
    "FALLBACK",
    "OBJECT_STORE",
    "PREFERENCE",
    "BlockBatch",
    "ObjectStoreTransport",
    "Transport",
    "choose",
    "export_rows",
    "verify",
]

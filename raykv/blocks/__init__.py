"""Blocks: who holds which GPU block. Pure Python (imports only ``raykv.layout``).

``BlockManager`` is the entry point; ``BlockPool`` the shared pool with its prefix cache;
``BlockHasher`` the reproducible chained block hashes (``tenant_key``: a request's tenant,
which enters them); ``PrefixIndex`` the one prefix index, fed by KV events: a pool's map
in-process, the service's cluster-wide index in the coordinator.
"""

from raykv.blocks.events import BlockRemoved, BlockStored, KVEvent, PrefixIndex
from raykv.blocks.hashing import DEFAULT_HASH_SEED, BlockHash, BlockHasher, Tenant, tenant_key
from raykv.blocks.manager import BlockManager, check_plan
from raykv.blocks.pool import NULL_BLOCK, BlockPool
from raykv.blocks.step import StepPlan

__all__ = [
    "DEFAULT_HASH_SEED",
    "NULL_BLOCK",
    "BlockHash",
    "BlockHasher",
    "BlockManager",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "PrefixIndex",
    "StepPlan",
    "Tenant",
    "check_plan",
    "tenant_key",
]

"""Blocks: who holds which GPU block. Pure Python (imports only ``raykv.layout``).

``BlockManager`` is the entry point; ``BlockPool`` the shared pool with its prefix cache;
``BlockHasher`` the reproducible chained block hashes; ``PrefixIndex`` the one prefix index,
fed by KV events: a pool's map in-process, the service's cluster-wide index in the
coordinator.
"""

from raykv.blocks.events import BlockRemoved, BlockStored, KVEvent, PrefixIndex
from raykv.blocks.hashing import DEFAULT_HASH_SEED, BlockHash, BlockHasher
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
    "check_plan",
]

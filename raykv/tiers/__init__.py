"""Tiers: paged GPU KV tensors, the CPU tier (its arena in shared memory, ``shm``), offload
jobs with fence and checksums, eviction policies, and the lower tiers' admission filter."""

from raykv.tiers.admission import TinyLFU, make_admission
from raykv.tiers.checksum import row_checksums
from raykv.tiers.cpu_tier import (
    ArenaRows,
    BlockState,
    CpuTier,
    CpuTierView,
    LoadLease,
    StoreReservation,
    TierStats,
)
from raykv.tiers.fence import StoreFence
from raykv.tiers.gpu_kv import GpuKV
from raykv.tiers.jobs import (
    NULL_BLOCK,
    BlockJob,
    LoadJob,
    StoreJob,
    group_block_hashes,
    group_factor,
)
from raykv.tiers.offload import JobResult, OffloadEngine
from raykv.tiers.policies import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy

__all__ = [
    "NULL_BLOCK",
    "ARCPolicy",
    "ArenaRows",
    "BlockJob",
    "BlockState",
    "CpuTier",
    "CpuTierView",
    "EvictionPolicy",
    "GpuKV",
    "JobResult",
    "LRUPolicy",
    "LoadJob",
    "LoadLease",
    "OffloadEngine",
    "StoreFence",
    "StoreJob",
    "StoreReservation",
    "TierStats",
    "TinyLFU",
    "group_block_hashes",
    "group_factor",
    "make_admission",
    "make_policy",
    "row_checksums",
]

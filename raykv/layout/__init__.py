"""Layout: KV specs, hybrid grouping, page-size unification and pool sizing (stdlib only)."""

from raykv.layout.kernel_blocks import (
    KernelBlockId,
    KernelBlockIds,
    LogicalBlockId,
    kernel_block_ids,
    logical_block_id,
    require_logical,
)
from raykv.layout.plan import KVGroup, Plan
from raykv.layout.sizing import cpu_tier_size, plan
from raykv.layout.specs import (
    MLA,
    ChunkedLocal,
    CrossAttention,
    FullAttention,
    KVSpec,
    Mamba,
    SlidingWindow,
)

__all__ = [
    "MLA",
    "ChunkedLocal",
    "CrossAttention",
    "FullAttention",
    "KVGroup",
    "KVSpec",
    "KernelBlockId",
    "KernelBlockIds",
    "LogicalBlockId",
    "Mamba",
    "Plan",
    "SlidingWindow",
    "cpu_tier_size",
    "kernel_block_ids",
    "logical_block_id",
    "plan",
    "require_logical",
]

"""Layout: KV specs, hybrid grouping, page-size unification and pool sizing (stdlib only)."""

from raykv.layout.plan import KVGroup, Plan
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
    "Mamba",
    "Plan",
    "SlidingWindow",
]

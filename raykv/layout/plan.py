"""The plan: how a model's layers are grouped, how big a block is and how many fit.

``plan()`` is the only place that sizes pools. The GPU pool, the CPU tier and the
admission gate all read their numbers from a ``Plan`` (invariants 2, 5, 6).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from raykv.layout.specs import KVSpec


@dataclass(frozen=True)
class KVGroup:
    """Layers that share one block table per request (same spec type and block size)."""

    group_id: int
    spec: KVSpec  # the group's type representative; per-layer specs live in Plan.layer_specs
    layer_names: tuple[str, ...]
    block_size: int  # tokens per logical block
    kernel_block_size: int  # tokens per block as the attention kernel sees it
    layer_page_bytes: tuple[int, ...]  # per layer, one rank, after page-size unification

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.kernel_block_size

    def max_blocks(self, num_tokens: int) -> int:
        """Admission formula for this group (invariant 2); see ``KVSpec.max_blocks``."""
        return self.spec.max_blocks(num_tokens, self.block_size)


@dataclass(frozen=True)
class Plan:
    groups: tuple[KVGroup, ...]
    num_gpu_blocks: int  # blocks per GPU (one rank), the null block 0 included
    hash_block_size: int  # tokens per hash block; every group block size is a multiple
    gpu_bytes_per_block: int  # one rank: real allocated tensor bytes / num_gpu_blocks
    tp_size: int
    max_model_len: int
    max_num_batched_tokens: int
    offload_block_size: int  # tokens per CPU-tier block
    block_size_factor: int  # GPU blocks per CPU-tier block
    cpu_num_blocks: int
    cpu_bytes_per_block: int  # one CPU-tier block: every distinct TP copy x block_size_factor
    layer_specs: Mapping[str, KVSpec] = field(default_factory=dict)
    num_tensors: int = 1  # tensors per GPU that the groups share (hybrid layout)
    padding_waste: float = 0.0  # share of GPU KV bytes lost to page padding

    @property
    def usable_gpu_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    def admission_blocks(self, num_tokens: int) -> tuple[int, ...]:
        """Blocks per group a request of ``num_tokens`` needs at the admission gate."""
        return tuple(g.max_blocks(num_tokens) for g in self.groups)

    def group_of(self, layer_name: str) -> KVGroup:
        for g in self.groups:
            if layer_name in g.layer_names:
                return g
        raise KeyError(layer_name)

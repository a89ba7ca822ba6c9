"""The plan: how a model's layers are grouped, how big a block is and how many fit.

``plan()`` (raykv.layout.sizing) is the only place that sizes pools. The GPU pool, the CPU
tier and the admission gate all read their numbers from a ``Plan`` (invariants 2, 5, 6).

GPU memory layout a ``Plan`` describes (what GpuKV allocates, per rank):

* ``num_tensors`` byte tensors, tensor ``t`` shaped ``(num_gpu_blocks, tensor_page_bytes[t])``.
  A block id ``b`` is one row in every tensor, so one block costs
  ``gpu_bytes_per_block == sum(tensor_page_bytes)`` and the real allocated bytes are exactly
  ``num_gpu_blocks * gpu_bytes_per_block``.
* Layer ``group.layer_names[i]`` lives in tensor ``i`` (``Plan.tensor_of``). Its row is cut
  into ``kernel_blocks_per_block`` equal slices, kernel block ``j`` of the logical block at
  byte ``j * row / k``, each slice holding that kernel block's K then V (or latent, or
  state); padding, where pages were unified by padding, sits at the end of each slice.
  Copies move whole rows, padding included.
* One group (a uniform-type model): one tensor per layer, each exactly the layer's page,
  so layers with different head sizes waste nothing.
* Several groups (hybrid): every group has the same number of layers (the last group of a
  type may have fewer) and every tensor has the same unified page; tensor ``t`` is shared by
  layer ``t`` of each group. A block id belongs to one group at a time, so the groups draw
  from ONE pool and a request needs the sum of its per-group blocks.
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
    layer_page_bytes: tuple[int, ...]  # per layer, one rank, at this group's block size

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.kernel_block_size

    def max_blocks(self, num_tokens: int, max_num_batched_tokens: int) -> int:
        """Admission formula for this group (invariant 2); see ``KVSpec.max_blocks``."""
        return self.spec.max_blocks(num_tokens, self.block_size, max_num_batched_tokens)


@dataclass(frozen=True)
class Plan:
    groups: tuple[KVGroup, ...]
    num_gpu_blocks: int  # blocks per GPU (one rank), the null block 0 included
    hash_block_size: int  # tokens per hash block; every group block size is a multiple
    gpu_bytes_per_block: int  # one rank: real allocated tensor bytes / num_gpu_blocks
    tp_size: int
    max_model_len: int
    max_num_batched_tokens: int
    offload_block_size: int  # tokens per CPU-tier block (at Plan.block_size)
    block_size_factor: int  # GPU blocks per CPU-tier block
    cpu_num_blocks: int
    cpu_bytes_per_block: int  # one CPU-tier block: every distinct TP copy x block_size_factor
    layer_specs: Mapping[str, KVSpec] = field(default_factory=dict)
    num_tensors: int = 1  # tensors per GPU that the groups share (hybrid layout)
    padding_waste: float = 0.0  # share of GPU KV bytes lost to page padding and empty slots
    tensor_page_bytes: tuple[int, ...] = ()  # per tensor, one rank: bytes of one block's row
    distinct_copies: int = 1  # different copies of one block across the TP group (inv. 5)

    @property
    def usable_gpu_blocks(self) -> int:
        return max(self.num_gpu_blocks - 1, 0)

    @property
    def block_size(self) -> int:
        """The base block size: the smallest group block size (groups may be k times it)."""
        return min(g.block_size for g in self.groups)

    @property
    def gpu_tensor_bytes(self) -> int:
        """Real bytes of every KV tensor on one rank."""
        return self.num_gpu_blocks * self.gpu_bytes_per_block

    @property
    def tp_group_bytes_per_block(self) -> int:
        """Distinct bytes one GPU block id holds across the whole TP group."""
        return self.gpu_bytes_per_block * self.distinct_copies

    @property
    def _token_groups(self) -> int:
        """Groups whose blocks grow with the token count (Mamba and cross attention don't)."""
        return sum(g.spec.kind not in ("mamba", "cross") for g in self.groups) or 1

    @property
    def tokens_per_gpu(self) -> int:
        """Tokens the usable blocks hold if every token-growing group holds as many blocks."""
        return self.usable_gpu_blocks // self._token_groups * self.block_size

    @property
    def cpu_tokens(self) -> int:
        blocks = self.cpu_num_blocks * self.block_size_factor
        return blocks // self._token_groups * self.block_size

    def admission_blocks(self, num_tokens: int) -> tuple[int, ...]:
        """Blocks per group a request of ``num_tokens`` needs at the admission gate, with
        chunks of up to ``max_num_batched_tokens`` in flight (invariant 2)."""
        m = self.max_num_batched_tokens
        return tuple(g.max_blocks(num_tokens, m) for g in self.groups)

    def max_concurrent_requests(self, num_tokens: int | None = None) -> int:
        """Requests of ``num_tokens`` (default max_model_len) that fit the empty pool at once."""
        need = sum(self.admission_blocks(num_tokens or self.max_model_len))
        return self.usable_gpu_blocks // need if need else 0

    def group_of(self, layer_name: str) -> KVGroup:
        for g in self.groups:
            if layer_name in g.layer_names:
                return g
        raise KeyError(layer_name)

    def tensor_of(self, layer_name: str) -> int:
        """Index of the tensor that holds ``layer_name`` (its position in its group)."""
        return self.group_of(layer_name).layer_names.index(layer_name)

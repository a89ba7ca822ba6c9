"""What the service serves: one ``ServedModel`` per model name, planned once per model.

A model's plan is the same for every pool (one TP rank of one GPU, or a CPU-device pool),
so every pool's block ids, row bytes and block keys agree and blocks move between them as
plain rows of bytes. ``tp_size`` ranks of one engine instance form one TP group: a
``GpuPool`` (rank 0) plus ``tp_size - 1`` ``RankPool`` actors in one placement group.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from raykv.errors import ConfigError, InvalidInput
from raykv.layout.specs import KVSpec

NAMESPACE = "raykv"
COORDINATOR = "raykv-coordinator"
DEFAULT_POOL_BYTES = 2 << 30  # KV bytes of a CPU-device pool (dev and CI)
DEFAULT_TIER_BYTES = 512 << 20  # CPU-tier bytes per node and model


def pool_name(model: str, node_id: str, index: int) -> str:
    return f"raykv-pool-{model}-{node_id[:12]}-{index}"


def tier_name(node_id: str) -> str:
    return f"raykv-tier-{node_id[:12]}"


def rank_name(pool: str, rank: int) -> str:
    """Rank ``rank`` (>= 1) of the TP group whose rank 0 is the pool ``pool``."""
    return "raykv-rank-" + pool.removeprefix("raykv-pool-") + f"-r{rank}"


def group_name(pool: str) -> str:
    """The placement group of the TP group whose rank 0 is the pool ``pool``."""
    return "raykv-tp-" + pool.removeprefix("raykv-pool-")


@dataclass(frozen=True)
class ServedModel:
    """A model the service holds KV for. ``pool_bytes`` 0: ``gpu_mem_fraction`` of the GPU's
    memory on GPU pools, ``DEFAULT_POOL_BYTES`` on CPU-device pools. Any layer mix the
    layout plans is served as long as every group is prefix-cacheable (no Mamba / cross
    attention); ``offload_block_size`` a multiple of the block size makes CPU-tier entries
    of several GPU blocks."""

    name: str
    layers: Mapping[str, KVSpec] = field(hash=False)
    max_model_len: int
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    tp_size: int = 1  # ranks per engine instance: per-rank pool bytes, one pool actor each
    gpu_mem_fraction: float = 0.9
    pool_bytes: int = 0  # KV bytes per rank
    cpu_bytes: int = DEFAULT_TIER_BYTES
    offload_block_size: int | None = None  # tokens per CPU-tier entry (default block_size)

    def __post_init__(self) -> None:
        if (
            not self.name
            or not self.name.replace("-", "").replace("_", "").replace(".", "").isalnum()
        ):
            raise ConfigError(
                f"model name {self.name!r} must be letters, digits, '-', '_' or '.'; rename it"
            )
        if not self.layers:
            raise ConfigError(f"model {self.name!r} has no KV layers; pass layer name -> spec")
        if not 0 < self.gpu_mem_fraction <= 1:
            raise ConfigError(f"gpu_mem_fraction must be in (0, 1], got {self.gpu_mem_fraction}")

    def plan(self, gpu_bytes: int):
        from raykv.layout import plan

        return plan(
            dict(self.layers),
            gpu_bytes=gpu_bytes,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            tp_size=self.tp_size,
            cpu_bytes=self.cpu_bytes,
            block_size=self.block_size,
            offload_block_size=self.offload_block_size,
        )


def check_token_ids(token_ids: Sequence[int], max_model_len: int, model: str) -> list[int]:
    """Token ids as a list of ints; raises InvalidInput (changing nothing) on bad input.
    Floats are refused, not truncated: 1.5 is no token id."""
    dtype = getattr(token_ids, "dtype", None)
    if dtype is not None and "int" not in str(dtype):
        raise InvalidInput(f"token ids must have an integer dtype, got {dtype}")
    if dtype is not None and hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()  # a tensor or array: one conversion, not one per id
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError:
        raise InvalidInput(
            f"token ids must be a sequence of integers, got {type(token_ids).__name__}"
        ) from None
    if len(ids) > max_model_len:
        raise InvalidInput(
            f"{len(ids)} token ids exceed model {model!r}'s max_model_len={max_model_len}; "
            "truncate the prompt or serve the model with a larger max_model_len"
        )
    if ids and min(ids) < 0:
        raise InvalidInput(f"token ids must be >= 0, got {min(ids)}")
    return ids

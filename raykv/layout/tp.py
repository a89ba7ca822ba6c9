"""Tensor-parallel world-size scaling, in one place (invariant 5). The planner, the tiers and
the service all use these functions; nothing else computes them.

A TP group of ``tp_size`` ranks serves one engine instance. Each rank holds its own slice of
every layer's page (``split_heads``: KV heads per rank). Ranks whose slices are the same
bytes hold one *copy* of a block:

* copies per TP group (``page_copies`` for one layer, ``model_copies`` for a model):
  ``tp_size`` when KV heads split across the ranks; ``num_kv_heads`` when there are fewer
  heads than ranks (each head replicated on ``tp_size // num_kv_heads`` consecutive ranks);
  1 for MLA (every rank holds the same latent). A model's copies are the most of its
  layers' (each divides ``tp_size``, so the most is a multiple of every other).
* rank ``r`` holds copy ``r * copies // tp_size`` (``copy_of_rank``; a plan's ranks:
  ``copy_ranks``): a copy's ranks are consecutive, ``tp_size // copies`` of them.
* the first rank of each copy writes it to the CPU tier (``writer_of_copy``, ``writes``);
  every rank of it reads it back (a plan's writers: ``writer_ranks``).
* a CPU-tier block holds every copy of ``block_size_factor`` GPU blocks, each worth the real
  tensor bytes per GPU block (``cpu_bytes_per_block``); ``plan_copies`` reads the copies
  back from a plan's bytes.

The specs (``raykv.layout.specs``) and the plan (``raykv.layout.plan``) build on these
functions; what the functions read of a spec or a plan is spelled out here (``LayerCopies``,
``PlanBytes``), so this module imports neither.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from raykv.errors import ConfigError


class LayerCopies(Protocol):
    """What the TP arithmetic reads of a layer's spec (a ``raykv.layout.specs.KVSpec``)."""

    def distinct_copies(self, tp_size: int) -> int: ...


class PlanBytes(Protocol):
    """What the TP arithmetic reads of a plan (a ``raykv.layout.plan.Plan``)."""

    @property
    def tp_size(self) -> int: ...

    @property
    def gpu_bytes_per_block(self) -> int: ...

    @property
    def block_size_factor(self) -> int: ...

    @property
    def cpu_bytes_per_block(self) -> int: ...


def check_tp_size(tp_size: int) -> int:
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    return tp_size


def split_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads held by one rank. Fewer heads than ranks: each rank keeps one replica."""
    check_tp_size(tp_size)
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ConfigError(
                f"{num_kv_heads} KV heads do not split evenly across tp_size={tp_size}; "
                f"use a tp_size that divides {num_kv_heads}"
            )
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ConfigError(
            f"tp_size={tp_size} is not a multiple of {num_kv_heads} KV heads; "
            "use a tp_size that is a multiple or a divisor of the KV head count"
        )
    return 1


def head_copies(num_kv_heads: int, tp_size: int) -> int:
    """Distinct copies of a page whose KV heads split across the ranks: one per rank, or one
    per head when heads are fewer than ranks (the rest are replicas)."""
    return min(tp_size, num_kv_heads)


def page_copies(spec: LayerCopies, tp_size: int) -> int:
    """Distinct copies of one layer's page across the TP group (the spec's kind decides:
    ``KVSpec.distinct_copies``)."""
    return spec.distinct_copies(check_tp_size(tp_size))


def model_copies(layers: Iterable[LayerCopies], tp_size: int) -> int:
    """Distinct copies of one block of a model across the TP group: its layers' most."""
    return max(page_copies(s, tp_size) for s in layers)


def _check(tp_size: int, copies: int) -> None:
    check_tp_size(tp_size)
    if not 1 <= copies <= tp_size or tp_size % copies:
        raise ConfigError(
            f"{copies} distinct copies do not divide tp_size={tp_size} into equal rank "
            "groups; rebuild the plan with plan() (copies divide tp_size)"
        )


def copy_of_rank(rank: int, tp_size: int, copies: int) -> int:
    """The distinct copy rank ``rank`` holds (MLA: every rank holds copy 0)."""
    _check(tp_size, copies)
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank {rank} is outside tp_size={tp_size}; pass 0..{tp_size - 1}")
    return rank * copies // tp_size


def writer_of_copy(copy: int, tp_size: int, copies: int) -> int:
    """The rank whose rows the CPU tier stores for ``copy``: the copy's first rank."""
    _check(tp_size, copies)
    return copy * tp_size // copies


def copy_ranks(plan: PlanBytes) -> tuple[int, ...]:
    """Per rank of ``plan``'s TP group: the copy it holds."""
    copies = plan_copies(plan)
    return tuple(copy_of_rank(r, plan.tp_size, copies) for r in range(plan.tp_size))


def writer_ranks(plan: PlanBytes) -> tuple[int, ...]:
    """Per copy of ``plan``'s blocks: the rank that writes it to the CPU tier."""
    copies = plan_copies(plan)
    return tuple(writer_of_copy(c, plan.tp_size, copies) for c in range(copies))


def writes(rank: int, tp_size: int, copies: int) -> bool:
    """Whether ``rank`` writes its copy to the CPU tier (every other rank of it reads)."""
    return writer_of_copy(copy_of_rank(rank, tp_size, copies), tp_size, copies) == rank


def cpu_bytes_per_block(
    gpu_tensor_bytes: int, num_gpu_blocks: int, copies: int, block_size_factor: int
) -> int:
    """Bytes of one CPU-tier block: the REAL allocated tensor bytes per GPU block (never a
    page size that already sums all layers times the tensor count) x every distinct copy x
    the GPU blocks one CPU-tier block holds. 0 without GPU blocks."""
    if num_gpu_blocks <= 0 or gpu_tensor_bytes <= 0:
        return 0
    return gpu_tensor_bytes // num_gpu_blocks * copies * block_size_factor


def plan_copies(plan: PlanBytes) -> int:
    """Distinct TP copies one CPU-tier block of ``plan`` holds, read back from its bytes."""
    per_copy = plan.gpu_bytes_per_block * plan.block_size_factor
    if per_copy <= 0:
        return 1
    if plan.cpu_bytes_per_block % per_copy:
        raise ConfigError(
            f"cpu_bytes_per_block={plan.cpu_bytes_per_block} is not a whole number of "
            f"copies of gpu_bytes_per_block={plan.gpu_bytes_per_block} x "
            f"block_size_factor={plan.block_size_factor}; rebuild the plan with plan()"
        )
    return max(1, plan.cpu_bytes_per_block // per_copy)

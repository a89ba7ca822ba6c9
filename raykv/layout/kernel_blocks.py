"""Logical vs kernel block ids (invariant 7).

The block manager hands out logical blocks of ``block_size`` tokens. An attention kernel
may only support smaller blocks, so one logical block ``b`` is seen by the kernel as
``block_size // kernel_block_size`` consecutive kernel blocks ``b * k + j``. The two id
kinds are distinct types so that a kernel id never leaks above the kernel.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NewType

from raykv.errors import BlockSizeError, InvalidInput
from raykv.layout.specs import KVSpec

LogicalBlockId = NewType("LogicalBlockId", int)
KernelBlockId = NewType("KernelBlockId", int)

KernelBlockSizes = Sequence[int] | Mapping[str, Sequence[int]] | None


class KernelBlockIds(list[KernelBlockId]):
    """A list of kernel block ids that remembers it is one: every interface that takes
    logical ids refuses it at run time (``require_logical``), so the two kinds cannot be
    mixed up even where the static types are erased (invariant 7)."""

    def __init__(self, ids: Iterable[KernelBlockId], blocks_per_block: int):
        super().__init__(ids)
        self.blocks_per_block = blocks_per_block


def kernel_block_ids(
    logical_ids: Iterable[LogicalBlockId | int], blocks_per_block: int
) -> KernelBlockIds:
    """Kernel block ids of logical blocks, in order: ``b * blocks_per_block + j``."""
    require_logical(logical_ids, "kernel_block_ids")
    k = blocks_per_block
    return KernelBlockIds((KernelBlockId(b * k + j) for b in logical_ids for j in range(k)), k)


def require_logical(ids: object, where: str) -> None:
    """Refuse kernel block ids where logical ids are expected (invariant 7)."""
    if isinstance(ids, KernelBlockIds):
        raise InvalidInput(
            f"{where} takes logical block ids but got {len(ids)} kernel block ids "
            f"({ids.blocks_per_block} per logical block); pass the ids of block_table(), "
            "not kernel_block_table()"
        )


def logical_block_id(kernel_id: KernelBlockId | int, blocks_per_block: int) -> LogicalBlockId:
    """The logical block that holds a kernel block."""
    return LogicalBlockId(kernel_id // blocks_per_block)


def supported_kernel_block_sizes(
    layer_names: Iterable[str], kernel_block_sizes: KernelBlockSizes
) -> list[Sequence[int]]:
    """The size lists that constrain ``layer_names``. ``kernel_block_sizes``: None (kernel
    block = block, no list), one list for all attention layers, or a mapping layer name ->
    supported sizes (layers not named accept any size)."""
    if kernel_block_sizes is None:
        return []
    if isinstance(kernel_block_sizes, Mapping):
        return [kernel_block_sizes[n] for n in layer_names if n in kernel_block_sizes]
    return [kernel_block_sizes]


def pick_kernel_block_size(
    layer_names: Sequence[str],
    specs: Mapping[str, KVSpec],
    block_size: int,
    kernel_block_sizes: KernelBlockSizes,
) -> int:
    """Largest size every layer's backend supports that divides ``block_size`` (see
    ``supported_kernel_block_sizes``). Mamba groups are never split."""
    if specs[layer_names[0]].kind == "mamba":
        return block_size
    per_layer = supported_kernel_block_sizes(layer_names, kernel_block_sizes)
    if not per_layer:
        return block_size
    common = set(per_layer[0]).intersection(*per_layer[1:])
    fits = [s for s in common if s > 0 and block_size % s == 0]
    if not fits:
        sets = sorted({tuple(sorted(p)) for p in per_layer})
        raise BlockSizeError(
            f"no kernel block size fits block size {block_size} for layers "
            f"{layer_names[0]}..{layer_names[-1]}: supported sizes {sets} (common: "
            f"{sorted(common)}); use a block size that is a multiple of a size every backend "
            "supports"
        )
    return max(fits)

"""One TP rank's KV bytes: ``RankKV`` (the tensors and their row copies) and ``RankPool``,
the actor that holds ranks 1..tp-1 of a TP group.

A model served with tp_size=N gets N actors per engine instance, placed together on one node
(a STRICT_PACK placement group): the ``GpuPool`` (rank 0, the group's leader: the one
``BlockManager``, since every rank uses the same block ids) and N-1 ``RankPool`` actors, each
holding only its rank's slice of every block (the plan's per-rank page bytes). The leader
drives them; they are not members of the coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from raykv import ops
from raykv.service.groups import row_widths


class RankKV:
    """The paged KV tensors of one rank, addressed by group index and logical block id."""

    def __init__(self, plan: Any, device: str = "cpu") -> None:
        from raykv.tiers.gpu_kv import GpuKV

        self.plan = plan
        self.kv = GpuKV.allocate(plan, device)
        self.entries = [self.kv.entries(g.group_id) for g in plan.groups]
        self.widths = row_widths(plan)

    def gather(self, gi: int, block_ids: Sequence[int]) -> torch.Tensor:
        dst = torch.empty((len(block_ids), self.widths[gi]), dtype=torch.uint8)
        if block_ids:
            ops.gather_blocks(self.entries[gi], torch.tensor(block_ids, dtype=torch.long), dst)
        return dst

    def scatter(self, gi: int, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        if block_ids:
            ids = torch.tensor(block_ids, dtype=torch.long)
            ops.scatter_blocks(rows, self.entries[gi], ids)

    def copy(self, gi: int, src: Sequence[int], dst: Sequence[int]) -> None:
        """Block ``dst[i]`` gets the bytes of block ``src[i]`` (same group)."""
        self.scatter(gi, self.gather(gi, src), dst)


class RankPool:
    """Ranks 1..tp-1 of a TP group: the bytes only, driven by the group's ``GpuPool``."""

    def __init__(self, name: str, plan: Any, rank: int, device: str = "cpu") -> None:
        self.name, self.rank, self.device = name, rank, device
        self.kv = RankKV(plan, device)

    def gather(self, gi: int, block_ids: list[int]) -> np.ndarray:
        return self.kv.gather(gi, block_ids).numpy()

    def scatter(self, gi: int, rows: np.ndarray, block_ids: list[int]) -> None:
        from raykv.service.rows import as_tensor

        self.kv.scatter(gi, as_tensor(rows), block_ids)

    def copy(self, gi: int, src: list[int], dst: list[int]) -> None:
        self.kv.copy(gi, src, dst)

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "name": self.name,
            "rank": self.rank,
            "device": self.device,
            "node_id": ray.get_runtime_context().get_node_id(),
            "bytes": self.kv.kv.total_bytes,
        }

"""CpuTierActor: the CPU tier of one node (pinned to it), one ``raykv.tiers.CpuTier`` arena
per served model, keyed by block hash.

The node's pools offload cached GPU blocks here before the GPU pool evicts them, and read
them back (local CPU hits); other nodes' pools fetch from it through a ``BlockMover``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from raykv.errors import ConfigError, InvalidInput
from raykv.service.index import CPU
from raykv.service.member import Member
from raykv.service.metrics import ServiceMetrics
from raykv.service.mover import as_tensor
from raykv.service.spec import tier_name


class CpuTierActor(Member):
    kind = "tier"

    def __init__(self, node_id: str) -> None:
        super().__init__(tier_name(node_id), node_id)
        self.tiers: dict[str, Any] = {}  # model -> CpuTier
        self.metrics = ServiceMetrics("tier")

    async def add_model(self, model: str, plan: Any) -> int:
        """Make room for ``model`` (idempotent); returns its CPU-tier block count."""
        from raykv.tiers.cpu_tier import CpuTier

        if model not in self.tiers:
            if plan.block_size_factor != 1:
                raise ConfigError(
                    f"the service offloads one GPU block per CPU block; model {model!r} has "
                    f"block_size_factor={plan.block_size_factor}: leave offload_block_size unset"
                )
            self.tiers[model] = CpuTier(plan, "lru")
        return self.tiers[model].num_blocks

    def _tier(self, model: str):
        tier = self.tiers.get(model)
        if tier is None:
            raise InvalidInput(f"the CPU tier on node {self.node_id[:12]} holds no model {model!r}")
        return tier

    async def put(self, model: str, block_hashes: list[Hashable], rows: np.ndarray) -> int:
        """Store rows under their hashes (all or nothing; LRU evicts to make room).
        Returns the blocks newly stored (0 when no room could be made)."""
        tier = self._tier(model)
        src = as_tensor(rows)
        if src.dtype != torch.uint8 or src.shape != (len(block_hashes), tier.slot_bytes):
            raise InvalidInput(
                f"CPU tier rows must be uint8 [{len(block_hashes)}, {tier.slot_bytes}], got "
                f"{src.dtype} {list(src.shape)}"
            )
        res = tier.prepare_store(block_hashes)
        if res is None:
            return 0
        at = res.block_of()
        try:
            dst = tier.rows(0)
            for i, h in enumerate(block_hashes):
                if h in at:
                    dst[at[h]].copy_(src[i])
        except Exception:
            tier.finish_store(res, ok=False)
            raise
        tier.finish_store(res, ok=True)
        self.metrics.evicted(model, CPU, len(res.evicted))
        self.metrics.used(model, CPU, tier.num_blocks - tier.num_free)
        await self.publish(model, [(h, -1) for h in res.keys], list(res.evicted))
        return len(res.keys)

    async def read_hashes(
        self, model: str, block_hashes: list[Hashable], block_ids: list[int] | None = None
    ) -> tuple[int, np.ndarray]:
        """Rows of the leading ``block_hashes`` held here: (count, uint8 [count, row])."""
        tier = self.tiers.get(model)
        if tier is None:
            return 0, np.empty((0, 0), np.uint8)
        n = tier.lookup(block_hashes)
        lease = tier.prepare_load(block_hashes[:n]) if n else None
        if lease is None:
            self.metrics.miss(model, CPU, len(block_hashes))
            return 0, np.empty((0, tier.slot_bytes), np.uint8)
        try:
            rows = tier.rows(0)[torch.tensor(lease.blocks, dtype=torch.long)].numpy()
        finally:
            tier.finish_load(lease)
        self.metrics.hit(model, CPU, n)
        self.metrics.moved(model, CPU, rows.nbytes)
        return n, rows

    def blocks(self) -> dict[str, list[tuple[Hashable, int]]]:
        return {m: [(h, -1) for h in t.stored_keys() if h in t] for m, t in self.tiers.items()}

    def stats(self) -> dict[str, Any]:
        used = sum(t.num_blocks - t.num_free for t in self.tiers.values())
        total = sum(t.num_blocks for t in self.tiers.values())
        s = {
            "blocks_used": used,
            "blocks_total": total,
            "bytes": sum(t.total_bytes for t in self.tiers.values()),
        }
        return s | dict(self.metrics.tally)

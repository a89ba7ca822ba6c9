"""One TP rank's KV bytes: ``RankKV`` (the tensors, their row copies and the rank's
``OffloadEngine`` on the node's shared CPU-tier arena) and ``RankPool``, the actor that holds
ranks 1..tp-1 of a TP group.

A model served with tp_size=N gets N actors per engine instance, placed together on one node
(a STRICT_PACK placement group): the ``GpuPool`` (rank 0, the group's leader: the one
``BlockManager``, since every rank uses the same block ids) and N-1 ``RankPool`` actors, each
holding only its rank's slice of every block (the plan's per-rank page bytes). The leader
drives them; they are not members of the coordinator.

Each rank moves its own bytes to and from the CPU tier: ``store_job`` / ``load_job`` run a
``raykv.tiers`` StoreJob / LoadJob on the rank's ``GpuKV`` and a ``CpuTierView`` of the
arena (the one offload path; checksums computed on store, verified on load) and return the
engine's queued tier calls for the leader to apply on the tier actor.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from raykv import ops
from raykv.service.groups import row_widths
from raykv.tiers.checksum import row_checksums, verified_prefix
from raykv.transport.collective import Pair, RankLinks

log = logging.getLogger(__name__)


class RankKV:
    """The paged KV tensors of one rank, addressed by group index and logical block id.
    On CPU they live in shared memory (``GpuKV.allocate(shared=True)``). Its ``links``
    (``RankLinks``) move its share of a batch between pools: NCCL / gloo pairs, peer reads."""

    def __init__(self, plan: Any, device: str = "cpu", rank: int = 0) -> None:
        from raykv.tiers.gpu_kv import GpuKV

        self.plan, self.rank = plan, rank
        # exportable (CUDA): one allocation other pools of the node read in place, through
        # their NCCL pairs' windows (``raykv.transport.collective.window``) or as peer reads
        self.kv = GpuKV.allocate(plan, device, shared=True, exportable=True)
        self.entries = [self.kv.entries(g.group_id) for g in plan.groups]
        self.widths = row_widths(plan)
        self.links = RankLinks(plan, self.kv, self.entries, self.widths)
        self._engine: Any = None
        self._arena: Any = None  # the SharedSpec the engine's view maps

    def gather(self, gi: int, block_ids: Sequence[int]) -> torch.Tensor:
        dst = torch.empty((len(block_ids), self.widths[gi]), dtype=torch.uint8)
        if block_ids:
            ops.gather_blocks(self.entries[gi], torch.tensor(block_ids, dtype=torch.long), dst)
        return dst

    def gather_into(self, gi: int, block_ids: Sequence[int], dst: torch.Tensor) -> None:
        if block_ids:
            ops.gather_blocks(self.entries[gi], torch.tensor(block_ids, dtype=torch.long), dst)

    def scatter(self, gi: int, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        if block_ids:
            ids = torch.tensor(block_ids, dtype=torch.long)
            ops.scatter_blocks(rows, self.entries[gi], ids)

    def copy(
        self, gi: int, src: Sequence[int], dst: Sequence[int], expected: Sequence[int] | None
    ) -> int:
        """Block ``dst[i]`` gets the bytes of block ``src[i]`` (same group) for the leading
        blocks whose bytes match ``expected`` (their checksums; None: unchecked). Returns
        how many were copied (invariant 12: a corrupt source is never copied)."""
        rows = self.gather(gi, src)
        n = len(src) if expected is None else verified_prefix(rows, expected)
        self.scatter(gi, rows[:n], list(dst[:n]))
        return n

    # --- the CPU tier, through raykv.tiers ------------------------------------------------

    def engine(self, arena: Any) -> Any:
        """This rank's ``OffloadEngine`` on the arena ``arena`` (a ``SharedSpec``), mapped
        once per arena (a re-placed tier has a new one)."""
        from raykv.tiers.cpu_tier import CpuTierView
        from raykv.tiers.offload import OffloadEngine

        if self._engine is None or self._arena != arena:
            view = CpuTierView(self.plan, arena)
            self._engine = OffloadEngine(self.kv, view, rank=self.rank, checksums=True)
            self._arena = arena
        return self._engine

    def store_job(self, arena: Any, job: Any, reservation: Any) -> list[tuple]:
        """Copy this rank's blocks of ``job`` into the reserved arena rows (a replica rank
        copies nothing); returns the tier calls to apply."""
        eng = self.engine(arena)
        if eng.submit_store(job, reservation) is None:
            return []
        for res in eng.wait_all():
            if not res.ok:  # the tier frees the entries (nothing half-readable): a miss later
                log.warning("rank %d: store to the CPU tier failed: %s", self.rank, res.error)
        return eng.tier.take()

    def load_job(self, arena: Any, job: Any, lease: Any) -> tuple[tuple[bytes, ...], list]:
        """Verify and copy the leased arena rows of ``job`` into this rank's blocks; returns
        (keys not loaded, tier calls to apply)."""
        eng = self.engine(arena)
        if eng.submit_load(job, lease) is None:
            return tuple(job.keys), eng.tier.take()
        (res,) = eng.wait_all()
        if not res.ok:  # nothing counts as loaded: the blocks are misses
            log.warning("rank %d: load from the CPU tier failed: %s", self.rank, res.error)
        missed = res.missed if res.ok else tuple(job.keys)
        return missed, eng.tier.take()


class RankPool:
    """Ranks 1..tp-1 of a TP group: the bytes only, driven by the group's ``GpuPool``."""

    def __init__(self, name: str, plan: Any, rank: int, device: str = "cpu") -> None:
        self.name, self.rank, self.device = name, rank, device
        self.kv = RankKV(plan, device, rank)

    def gather(self, gi: int, block_ids: list[int]) -> np.ndarray:
        return self.kv.gather(gi, block_ids).numpy()

    def scatter(self, gi: int, rows: np.ndarray, block_ids: list[int]) -> None:
        from raykv.service.pool.rows import as_tensor

        self.kv.scatter(gi, as_tensor(rows), block_ids)

    def copy(self, gi: int, src: list[int], dst: list[int], expected=None) -> int:
        return self.kv.copy(gi, src, dst, expected)

    # --- NCCL / gloo batches (``raykv.service.pool.pairs``, through ``RankLinks``) ---

    async def coll_ident(self) -> str:
        return self.kv.links.collective(self.name).ident

    async def coll_send(self, pair: Pair, gi: int, block_ids: list[int]) -> None:
        await self.kv.links.start_send(self.name, pair, gi, block_ids)

    async def coll_recv(
        self, pair: Pair, gi: int, block_ids: list[int], expected: Any, replicas: Any = ()
    ) -> int:
        return await self.kv.links.recv(self.name, pair, gi, block_ids, expected, replicas)

    async def coll_has_window(self, pair: Pair) -> bool:
        return self.kv.links.has_window(pair)

    def checksums(self, gi: int, block_ids: list[int]) -> tuple[int, ...]:
        return row_checksums(self.kv.gather(gi, block_ids))

    # --- peer reads (``raykv.service.pool.pairs``) ---

    def peer_handle(self) -> Any:
        return self.kv.links.peer_handle()

    def peer_sums(self, gi: int, block_ids: list[int]) -> np.ndarray:
        return self.kv.links.peer_sums(gi, block_ids)

    async def peer_read(
        self, gi: int, handle: Any, src_ids: list[int], dst_ids: list[int], sums: np.ndarray
    ) -> int:
        return await self.kv.links.peer_read(gi, handle, src_ids, dst_ids, sums)

    def store_job(self, arena: Any, job: Any, reservation: Any) -> list[tuple]:
        return self.kv.store_job(arena, job, reservation)

    def load_job(self, arena: Any, job: Any, lease: Any) -> tuple:
        return self.kv.load_job(arena, job, lease)

    def info(self) -> dict[str, Any]:
        import ray

        return {
            "name": self.name,
            "rank": self.rank,
            "device": self.device,
            "node_id": ray.get_runtime_context().get_node_id(),
            "bytes": self.kv.kv.total_bytes,
        }

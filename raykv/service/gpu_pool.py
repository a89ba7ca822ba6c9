"""GpuPool: the paged KV of one GPU (one TP rank) as a Ray actor, for one served model.

It owns a ``GpuKV`` (the tensors) and a ``BlockManager`` (who holds which block). A block
becomes *valid* — published to the coordinator's index, servable to other nodes — only once
its bytes were written by ``store`` or ``load`` and the block manager caches it under the
same hash. Under memory pressure the block manager evicts cached blocks; the pool copies an
evicted valid block's bytes to the node's CPU tier before handing the block out (nothing can
overwrite it in between: the actor runs one call at a time between awaits). On a node
without GPUs the same actor runs with ``device="cpu"`` (development and CI).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import ray
import torch

from raykv.errors import ConfigError, InvalidInput
from raykv.service.index import GPU
from raykv.service.member import Member
from raykv.service.metrics import ServiceMetrics
from raykv.service.mover import ObjectStoreMover, as_tensor
from raykv.service.spec import (
    COORDINATOR,
    NAMESPACE,
    ServedModel,
    check_token_ids,
    tier_name,
)


def rows_tensor(rows: Any, num_blocks: int, row_bytes: int) -> torch.Tensor:
    """Caller rows as uint8 [num_blocks, row_bytes]; InvalidInput (nothing changed) else."""
    if isinstance(rows, np.ndarray):
        rows = as_tensor(rows)
    if not isinstance(rows, torch.Tensor):
        raise InvalidInput(f"KV rows must be a torch.Tensor or numpy array, got {type(rows)}")
    if rows.dtype != torch.uint8:
        raise InvalidInput(
            f"KV rows must be uint8 bytes (one row per block), got dtype {rows.dtype}; "
            "gather the blocks with raykv.ops.gather_blocks into a uint8 buffer"
        )
    if tuple(rows.shape) != (num_blocks, row_bytes):
        raise InvalidInput(
            f"KV rows must have shape [{num_blocks}, {row_bytes}] ({num_blocks} blocks x "
            f"{row_bytes} bytes per block of this plan), got {list(rows.shape)}"
        )
    return rows.contiguous()


class GpuPool(Member):
    kind = "pool"

    def __init__(
        self, name: str, model: ServedModel, plan: Any, node_id: str, device: str = "cpu"
    ) -> None:
        from raykv.blocks import BlockManager
        from raykv.tiers.gpu_kv import GpuKV

        super().__init__(name, node_id)
        if len(plan.groups) != 1 or plan.groups[0].spec.kind not in ("full", "mla"):
            kinds = [g.spec.kind for g in plan.groups]
            raise ConfigError(
                f"model {model.name!r} has KV groups {kinds}; the service moves models with "
                "one full-attention or MLA group for now (hybrid models: use raykv.blocks "
                "and raykv.tiers in-process)"
            )
        self.model, self.plan, self.device = model, plan, device
        self.bm = BlockManager(plan, enable_prefix_caching=True)
        self.kv = GpuKV.allocate(plan, device)
        self.group = plan.groups[0]
        self.entries = self.kv.entries(self.group.group_id)
        self.row_bytes = self.kv.row_bytes(self.group.group_id)
        self.k = self.group.block_size // plan.hash_block_size  # hash blocks per block
        self.tokens: dict[Hashable, list[int]] = {}
        self._hashes: dict[Hashable, list[bytes]] = {}
        self.valid: dict[bytes, int] = {}  # hash -> block holding its bytes
        self.hash_of: dict[int, bytes] = {}
        self.mover = ObjectStoreMover()
        self.metrics = ServiceMetrics("pool")

    async def start(self) -> str:
        tier = ray.get_actor(tier_name(self.node_id), namespace=NAMESPACE)
        await tier.add_model.remote(self.model.name, self.plan)
        return await super().start()

    # --- helpers ------------------------------------------------------------------------

    def _ids(self, token_ids: Sequence[int] | None) -> list[int] | None:
        if token_ids is None:
            return None
        return check_token_ids(token_ids, self.plan.max_model_len, self.model.name)

    def _block_hashes(self, rid: Hashable) -> list[bytes]:
        """Hash of each full block of the request's known tokens (block j: its last
        hash block's chained hash)."""
        tokens = self.tokens.get(rid, [])
        hashes = self._hashes.setdefault(rid, [])
        hbs = self.bm.hasher.hash_block_size
        if len(tokens) // hbs > len(hashes):
            hashes += self.bm.hasher.hash_blocks(
                tokens, first_block=len(hashes), parent=hashes[-1] if hashes else None
            )
        return hashes[self.k - 1 :: self.k]

    def _cached_as(self, block: int, h: bytes) -> bool:
        return self.bm.pool.block_keys[block] == (self.group.group_id, h)

    def _gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        from raykv import ops

        dst = torch.empty((len(block_ids), self.row_bytes), dtype=torch.uint8)
        ops.gather_blocks(self.entries, torch.tensor(block_ids, dtype=torch.long), dst)
        return dst

    def _scatter(self, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        from raykv import ops

        ops.scatter_blocks(rows, self.entries, torch.tensor(block_ids, dtype=torch.long))

    def _invalidate(self, block: int) -> bytes | None:
        h = self.hash_of.pop(block, None)
        if h is not None and self.valid.get(h) == block:
            del self.valid[h]
        return h

    def _validate(self, rid: Hashable, block_ids: Sequence[int]) -> list[tuple[bytes, int]]:
        """Mark written blocks valid where the block manager caches them under their
        position's hash. Returns the newly valid (hash, block) pairs."""
        table = self.bm.block_table(rid)[0]
        pos = {b: j for j, b in enumerate(table)}
        hashes = self._block_hashes(rid)
        out = []
        for b in block_ids:
            j = pos[b]
            if (
                j < len(hashes)
                and self._cached_as(b, hashes[j])
                and self.hash_of.get(b) != hashes[j]
            ):
                self._invalidate(b)
                self.valid[hashes[j]], self.hash_of[b] = b, hashes[j]
                out.append((hashes[j], b))
        return out

    def _own_blocks(self, rid: Hashable, block_ids: Sequence[int]) -> None:
        table = set(self.bm.block_table(rid)[0])
        bad = [b for b in block_ids if b not in table or b == 0]
        if bad:
            raise InvalidInput(
                f"blocks {bad[:8]} are not in request {rid!r}'s block table (it holds "
                f"{len(table)} blocks); pass ids that allocate returned for this request"
            )
        if len(set(block_ids)) != len(block_ids):
            raise InvalidInput(f"block ids {list(block_ids)[:8]}... hold duplicates")

    # --- engine-facing ------------------------------------------------------------------

    async def admit(self, rid: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None):
        ids = self._ids(token_ids)
        ok = self.bm.admit(rid, num_tokens, ids)
        if ok and ids is not None:
            self.tokens[rid] = ids
        return ok

    async def blocks_needed(self, rid: Hashable, num_new_tokens: int, token_ids=None) -> int:
        return self.bm.blocks_needed(rid, num_new_tokens, self._ids(token_ids))

    async def allocate(
        self, rid: Hashable, num_new_tokens: int, token_ids: Sequence[int] | None = None
    ) -> list[list[int]] | None:
        ids = self._ids(token_ids)
        new = self.bm.allocate(rid, num_new_tokens, ids)
        if new is None:
            return None
        if ids is not None:
            self.tokens[rid] = ids
        self.bm.drain_events()  # our index is ``valid``: only written blocks count
        # Blocks whose cached prefix the manager evicted to make this step fit: their bytes
        # are still intact (nobody wrote them yet), so offload them before returning.
        evicted = [
            b for b in new[0] if b in self.hash_of and not self._cached_as(b, self.hash_of[b])
        ]
        if evicted:
            rows = self._gather(evicted)
            hashes = [self._invalidate(b) for b in evicted]
            self.metrics.evicted(self.model.name, GPU, len(evicted))
            await self._offload(hashes, rows)
            await self.publish(self.model.name, [], hashes)
        self.metrics.used(self.model.name, GPU, self.bm.pool.num_used_blocks)
        return new

    async def _offload(self, hashes: list[bytes], rows: torch.Tensor) -> None:
        try:
            tier = ray.get_actor(tier_name(self.node_id), namespace=NAMESPACE)
            n = await tier.put.remote(self.model.name, hashes, rows.numpy())
            self.metrics.offloaded(self.model.name, n)
        except Exception:  # no tier: the blocks are simply gone (a miss later, never wrong)
            pass

    async def store(self, rid: Hashable, block_ids: Sequence[int], rows: Any) -> int:
        """Write the KV bytes of ``block_ids`` (this request's blocks); full blocks become
        hits for everyone. Returns the blocks newly published."""
        block_ids = [int(b) for b in block_ids]
        self._own_blocks(rid, block_ids)
        src = rows_tensor(rows, len(block_ids), self.row_bytes)
        self._scatter(src, block_ids)
        stored = self._validate(rid, block_ids)
        await self.publish(self.model.name, stored, [])
        return len(stored)

    async def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """The bytes of ``block_ids`` as uint8 [n, row_bytes] (the engine's view on CPU)."""
        block_ids = [int(b) for b in block_ids]
        bad = [b for b in block_ids if not 0 < b < self.plan.num_gpu_blocks]
        if bad:
            raise InvalidInput(
                f"block ids {bad[:8]} out of range 1..{self.plan.num_gpu_blocks - 1}"
            )
        return self._gather(block_ids).numpy()

    async def read_hashes(
        self, model: str, block_hashes: list[bytes], block_ids: list[int] | None = None
    ) -> tuple[int, np.ndarray]:
        """Rows of the leading ``block_hashes`` still valid here (for other pools)."""
        blocks = []
        for h in block_hashes:
            b = self.valid.get(h)
            if b is None or model != self.model.name:
                break
            blocks.append(b)
        rows = self._gather(blocks).numpy()
        self.metrics.hit(model, GPU, len(blocks))
        self.metrics.moved(model, GPU, rows.nbytes)
        return len(blocks), rows

    async def load(
        self, rid: Hashable, token_ids: Sequence[int], into: Sequence[int]
    ) -> dict[str, Any]:
        """Fill ``into`` (blocks of this request's table) with the KV of their prefix
        positions from the best copies in the cluster. Copies that vanished are misses.
        Returns the request's tokens now backed by written KV, from its start."""
        t0 = time.perf_counter()
        ids = self._ids(token_ids)
        into = [int(b) for b in into]
        self._own_blocks(rid, into)
        if ids is not None and len(ids) > len(self.tokens.get(rid, [])):
            self.tokens[rid] = ids
        table = self.bm.block_table(rid)[0]
        hashes = self._block_hashes(rid)
        pos = {b: j for j, b in enumerate(table)}
        late = [b for b in into if pos[b] >= len(hashes)]
        if late:
            raise InvalidInput(
                f"blocks {late[:8]} hold positions past the request's known full blocks "
                f"({len(hashes)}); pass the request's token_ids"
            )
        todo = sorted((pos[b], b) for b in into if self.hash_of.get(b) != hashes[pos[b]])
        filled: set[int] = set()
        moved = 0
        # 1) another block of this pool already holds the bytes
        local = [(j, b) for j, b in todo if hashes[j] in self.valid]
        if local:
            self._scatter(
                self._gather([self.valid[hashes[j]] for j, _ in local]), [b for _, b in local]
            )
            filled.update(b for _, b in local)
        todo = [(j, b) for j, b in todo if b not in filled]
        # 2) the node's CPU tier or another node, best copy first
        if todo:
            moved = await self._fetch(rid, [(hashes[j], b) for j, b in todo], filled)
        if rid not in self.bm:  # freed while we were fetching: nothing to publish
            return {"num_tokens": 0, "loaded_blocks": 0, "bytes": moved}
        written = [b for b in into if b in filled]
        await self.publish(self.model.name, self._validate(rid, written), [])
        n = 0
        for j, b in enumerate(table):
            if j >= len(hashes) or (b not in filled and self.hash_of.get(b) != hashes[j]):
                break
            n += 1
        self.metrics.moved(self.model.name, "load", moved)
        return {
            "num_tokens": n * self.group.block_size,
            "loaded_blocks": len(written),
            "bytes": moved,
            "seconds": time.perf_counter() - t0,
        }

    async def _fetch(self, rid: Hashable, want: list[tuple[bytes, int]], filled: set[int]) -> int:
        try:
            coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
            where = await coord.locate.remote(self.model.name, [h for h, _ in want], self.node_id)
        except Exception:  # coordinator restarting: nothing is known to be elsewhere, a miss
            return 0
        failed: set[str] = {self.name}
        moved, i = 0, 0
        while i < len(want):
            source = next((c.member for c in where[i] if c.member not in failed), None)
            if source is None:
                break  # nobody else holds it: a miss, and the prefix ends here
            run = i
            while run < len(want) and any(c.member == source for c in where[run]):
                run += 1
            batch = want[i:run]
            try:
                n, rows = await self.mover.fetch(
                    source, self.model.name, [h for h, _ in batch], [-1] * len(batch)
                )
            except Exception:  # the source died or left: its copies are misses
                failed.add(source)
                with contextlib.suppress(Exception):
                    await coord.member_failed.remote(source)
                continue
            if rid not in self.bm:
                return moved
            if n:
                self._scatter(rows[:n], [b for _, b in batch[:n]])
                filled.update(b for _, b in batch[:n])
                moved += int(rows[:n].numel())
            if n < len(batch):
                failed.add(source)  # it lost the rest meanwhile; try the next copy
            i += n
        return moved

    async def free(self, rid: Hashable) -> None:
        self.bm.free(rid)
        self.tokens.pop(rid, None)
        self._hashes.pop(rid, None)

    # --- membership ---------------------------------------------------------------------

    def blocks(self) -> dict[str, list[tuple[Hashable, int]]]:
        return {self.model.name: [(h, b) for h, b in self.valid.items()]}

    def extra_snapshot(self) -> dict[str, Any]:
        return {"model": self.model.name, "models": {self.model.name: (self.model, self.plan)}}

    def stats(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "blocks_total": self.bm.pool.num_usable_blocks,
            "blocks_used": self.bm.pool.num_used_blocks,
            "blocks_valid": len(self.valid),
            "requests": len(self.tokens),
            **self.metrics.tally,
        }

    async def get_stats(self) -> dict[str, Any]:
        return self.stats()

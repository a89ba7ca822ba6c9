"""TP fan-out of a GPU pool: one call on the group's leader (rank 0) reaches every rank.

Rank 0 reads and writes its own ``RankKV`` in process; ranks 1..tp-1 are ``RankPool`` actors
sent the same call, and a dead rank retires the whole group (the coordinator places a fresh
one: an incomplete TP group's KV is never served).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import ray
import torch

from raykv.errors import ServiceError
from raykv.service.pool.rows import as_tensor
from raykv.service.served import NAMESPACE


class TpFanOut:
    """Mixed into ``GpuPool``: needs its ``name``, ``rank_names``, ``_rank_handles``,
    ``local``, ``widths``, ``copy_of``, ``writers``, ``sums``, ``_pending_sums``,
    ``_leaving``, ``_beat``, ``_call``, ``_corrupt``, ``key_of``, ``_invalidate``,
    ``_gone``, ``publish`` and ``model``."""

    def _ranks(self) -> list[Any]:
        if self._rank_handles is None:
            self._rank_handles = [ray.get_actor(n, namespace=NAMESPACE) for n in self.rank_names]
        return self._rank_handles

    async def _remote(self, refs: list) -> list:
        try:
            return list(await asyncio.gather(*refs))
        except ray.exceptions.RayActorError as e:
            self._rank_handles = None
            self._retire()
            raise ServiceError(
                f"a TP rank of pool {self.name!r} is gone ({type(e).__name__}); the "
                "coordinator places the group again within a few seconds (its blocks are "
                "misses), retry then"
            ) from e

    def _retire(self) -> None:
        """A rank died: the group's KV is incomplete. Leave the index and exit, so the
        coordinator places a fresh group (the live ranks are reused, their bytes unpublished)."""
        if self._leaving is not None:
            return
        if self._beat is not None:
            self._beat.cancel()

        async def leave() -> None:
            await self._call("member_failed", self.name)
            ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

        self._leaving = asyncio.get_running_loop().create_task(leave())

    def _start_gather(self, gi: int, block_ids: list[int], ranks: Sequence[int]) -> tuple:
        """Read rank 0's rows and send the other ranks their reads, without yielding: the
        bytes are read before any later call can write them (a rank runs its calls in the
        order they were sent). The rows land in one ``[len(ranks), n, width]`` buffer (the
        transport's wire buffer; rank 0's part gathered straight into it)."""
        handles = self._ranks()
        refs = [handles[r - 1].gather.remote(gi, block_ids) for r in ranks if r]
        out = torch.empty((len(ranks), len(block_ids), self.widths[gi]), dtype=torch.uint8)
        if 0 in ranks:
            self.local.gather_into(gi, block_ids, out[list(ranks).index(0)])
        return ranks, out, refs

    async def _finish_gather(self, started: tuple) -> torch.Tensor:
        """``[len(ranks), n, width]``: the rows of each rank of a started gather."""
        ranks, out, refs = started
        remote = iter(await self._remote(refs))
        for i, r in enumerate(ranks):
            if r:
                out[i].copy_(as_tensor(next(remote)))
        return out

    async def _gather(self, gi: int, block_ids: list[int], ranks: Sequence[int]) -> torch.Tensor:
        return await self._finish_gather(self._start_gather(gi, block_ids, ranks))

    async def _scatter(self, gi: int, rows: Sequence[torch.Tensor], block_ids: list[int]) -> None:
        """Rank ``r`` gets ``rows[r]``."""
        if not block_ids:
            return
        handles = self._ranks()
        refs = [h.scatter.remote(gi, rows[r + 1].numpy(), block_ids) for r, h in enumerate(handles)]
        self.local.scatter(gi, rows[0], block_ids)
        await self._remote(refs)

    async def _scatter_copies(self, gi: int, copies: torch.Tensor, block_ids: list[int]) -> None:
        """Every rank gets the rows of the distinct copy it holds."""
        await self._scatter(gi, [copies[c] for c in self.copy_of], block_ids)

    async def _copy_blocks(self, gi: int, src: list[int], dst: list[int]) -> int:
        """Block ``dst[i]`` gets block ``src[i]``'s bytes on every rank, for the leading
        blocks whose bytes still match their checksums on every copy's writer (invariant
        12); returns how many. The first corrupt source is dropped (a miss)."""

        def expected(r: int) -> list[int] | None:
            if r not in self.writers:
                return None
            c = self.copy_of[r]
            return [self.sums[b][c] if b in self.sums else -1 for b in src]

        sums = [self.sums.get(b) for b in src]  # the bytes' checksums, read before any await
        refs = [h.copy.remote(gi, src, dst, expected(r + 1)) for r, h in enumerate(self._ranks())]
        counts = [self.local.copy(gi, src, dst, expected(0)), *await self._remote(refs)]
        n = min(counts)
        for s_, d in zip(sums[:n], dst[:n], strict=True):
            self._pending_sums[d] = s_
        if n < len(src):
            self._corrupt([src[n]])
            if self.key_of.get(src[n]) is not None and self.sums.get(src[n]) == sums[n]:
                await self.publish(self.model.name, [], self._gone([self._invalidate(src[n])]))
        return n

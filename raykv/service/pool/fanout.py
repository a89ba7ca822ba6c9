"""TP fan-out of a GPU pool: one call on the group's leader (rank 0) reaches every rank.

Rank 0 reads and writes its own ``RankKV`` in process; ranks 1..tp-1 are ``RankPool`` actors
sent the same call, and a dead rank retires the whole group (the coordinator places a fresh
one: an incomplete TP group's KV is never served).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import ray
import torch

from raykv.errors import ServiceError
from raykv.layout import tp
from raykv.service.groups import row_widths
from raykv.service.pool.rows import as_tensor
from raykv.service.served import NAMESPACE


class LocalRank(Protocol):
    """What the fan-out does on rank 0, in process (``raykv.service.pool.rank.RankKV``)."""

    def gather_into(self, gi: int, block_ids: Sequence[int], dst: torch.Tensor) -> None: ...

    def scatter(self, gi: int, rows: torch.Tensor, block_ids: Sequence[int]) -> None: ...

    def copy(
        self, gi: int, src: Sequence[int], dst: Sequence[int], expected: Sequence[int] | None
    ) -> int: ...


class Ranks:
    """The TP ranks of pool ``name``: rank 0 (``local``, in this process) and the actors
    ``rank_names`` of ranks 1..tp-1. ``on_gone`` runs once a rank is found dead (the pool
    leaves: its KV is incomplete)."""

    def __init__(
        self,
        name: str,
        plan: Any,
        local: LocalRank,
        rank_names: Sequence[str],
        on_gone: Callable[[], None],
    ) -> None:
        self.name, self.local, self.on_gone = name, local, on_gone
        self.names = list(rank_names)
        self.widths = row_widths(plan)
        self.copy_of = tp.copy_ranks(plan)  # rank -> the distinct copy it holds
        self.writers = tp.writer_ranks(plan)  # the first rank of each distinct copy
        self._handles: list[Any] | None = None

    def handles(self) -> list[Any]:
        """The actors of ranks 1..tp-1."""
        if self._handles is None:
            self._handles = [ray.get_actor(n, namespace=NAMESPACE) for n in self.names]
        return self._handles

    async def remote(self, refs: list) -> list:
        """The answers of calls sent to the ranks; ServiceError (and the pool leaves) if a
        rank is gone."""
        try:
            return list(await asyncio.gather(*refs))
        except ray.exceptions.RayActorError as e:
            self._handles = None
            self.on_gone()
            raise ServiceError(
                f"a TP rank of pool {self.name!r} is gone ({type(e).__name__}); the "
                "coordinator places the group again within a few seconds (its blocks are "
                "misses), retry then"
            ) from e

    def replicas(self, r: int) -> list[int]:
        """The ranks holding rank ``r``'s copy, in order."""
        return [x for x in range(len(self.copy_of)) if self.copy_of[x] == self.copy_of[r]]

    def start_gather(self, gi: int, block_ids: list[int], ranks: Sequence[int]) -> tuple:
        """Read rank 0's rows and send the other ranks their reads, without yielding: the
        bytes are read before any later call can write them (a rank runs its calls in the
        order they were sent). The rows land in one ``[len(ranks), n, width]`` buffer (the
        transport's wire buffer; rank 0's part gathered straight into it)."""
        handles = self.handles()
        refs = [handles[r - 1].gather.remote(gi, block_ids) for r in ranks if r]
        out = torch.empty((len(ranks), len(block_ids), self.widths[gi]), dtype=torch.uint8)
        if 0 in ranks:
            self.local.gather_into(gi, block_ids, out[list(ranks).index(0)])
        return ranks, out, refs

    async def finish_gather(self, started: tuple) -> torch.Tensor:
        """``[len(ranks), n, width]``: the rows of each rank of a started gather."""
        ranks, out, refs = started
        remote = iter(await self.remote(refs))
        for i, r in enumerate(ranks):
            if r:
                out[i].copy_(as_tensor(next(remote)))
        return out

    async def gather(self, gi: int, block_ids: list[int], ranks: Sequence[int]) -> torch.Tensor:
        return await self.finish_gather(self.start_gather(gi, block_ids, ranks))

    async def scatter(self, gi: int, rows: Sequence[torch.Tensor], block_ids: list[int]) -> None:
        """Rank ``r`` gets ``rows[r]``."""
        if not block_ids:
            return
        handles = self.handles()
        refs = [h.scatter.remote(gi, rows[r + 1].numpy(), block_ids) for r, h in enumerate(handles)]
        self.local.scatter(gi, rows[0], block_ids)
        await self.remote(refs)

    async def scatter_copies(self, gi: int, copies: torch.Tensor, block_ids: list[int]) -> None:
        """Every rank gets the rows of the distinct copy it holds."""
        await self.scatter(gi, [copies[c] for c in self.copy_of], block_ids)

    async def copy(
        self,
        gi: int,
        src: list[int],
        dst: list[int],
        expected: Callable[[int], list[int] | None],
    ) -> int:
        """Block ``dst[i]`` gets block ``src[i]``'s bytes on every rank, for the leading
        blocks whose bytes match ``expected(rank)`` (their checksums on that rank; None:
        unchecked) on every rank; returns how many (invariant 12)."""
        refs = [h.copy.remote(gi, src, dst, expected(r + 1)) for r, h in enumerate(self.handles())]
        counts = [self.local.copy(gi, src, dst, expected(0)), *await self.remote(refs)]
        return min(counts)

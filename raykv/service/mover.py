"""Moving block rows between members of the service.

``BlockMover`` is the one interface the pools use to fetch blocks from another pool or tier,
wherever it runs. ``ObjectStoreMover`` is the SLOW FALLBACK: the rows travel as one numpy
array through Ray's object store (serialize, plasma put, pull to the reader's node, read).
It works on any Ray cluster, GPU or not, and stays the path of last resort once the NCCL
and UCX transports of ``raykv.transport`` exist.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import ray
import torch

from raykv.service.rows import as_tensor
from raykv.service.spec import NAMESPACE

__all__ = ["BlockMover", "ObjectStoreMover", "as_tensor"]


class BlockMover(Protocol):
    name: str

    async def fetch(
        self, source: str, model: str, block_hashes: Sequence[Hashable], block_ids: Sequence[int]
    ) -> tuple[int, torch.Tensor]:
        """Rows of the leading blocks ``source`` still holds (block keys of one group):
        (count, uint8 [distinct TP copies, count, row_bytes])."""
        ...


class ObjectStoreMover:
    """Fetch rows with one actor call whose result (a numpy array) goes through plasma."""

    name = "object-store"

    async def fetch(
        self, source: str, model: str, block_hashes: Sequence[Hashable], block_ids: Sequence[int]
    ) -> tuple[int, torch.Tensor]:
        actor = ray.get_actor(source, namespace=NAMESPACE)
        n, rows = await actor.read_hashes.remote(model, list(block_hashes), list(block_ids))
        return n, as_tensor(rows)

"""Moving block rows between members of the service.

``BlockMover`` is the one interface the pools use to fetch blocks from another pool or tier,
wherever it runs. ``ObjectStoreMover`` is the SLOW FALLBACK: the rows travel as one numpy
array through Ray's object store (serialize, plasma put, pull to the reader's node, read).
It works on any Ray cluster, GPU or not, and stays the path of last resort once the NCCL
and UCX transports of ``raykv.transport`` exist.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np
import ray
import torch

from raykv.service.spec import NAMESPACE


class BlockMover(Protocol):
    name: str

    async def fetch(
        self, source: str, model: str, block_hashes: Sequence[Hashable], block_ids: Sequence[int]
    ) -> tuple[int, torch.Tensor]:
        """Rows of the leading blocks ``source`` still holds: (count, uint8 [count, row])."""
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


def as_tensor(rows: np.ndarray) -> torch.Tensor:
    """Zero-copy view of rows read from the object store (read-only: we only copy from it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array"
        return torch.from_numpy(rows)

"""``ObjectStoreTransport``: blocks travel through Ray's object store (the fallback).

One actor call to the source (``export_blocks``) returns ``(count, rows, checksums)``, the
stream's one chunk:
``rows`` is one contiguous numpy array, which Ray stores once in the source node's plasma
and the receiver's raylet pulls in large chunks; the receiver reads it in place
(``torch.from_numpy`` of the read-only buffer, no copy) and scatters it into its blocks
with one paged copy. Nothing per block crosses the wire except the checksums.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
import torch

from raykv.transport.base import Asked, BlockBatch, Land, collect
from raykv.transport.select import OBJECT_STORE


def as_tensor(rows: np.ndarray) -> torch.Tensor:
    """Zero-copy view of rows read from the object store (read-only: we only copy from it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "non-writable array"
        return torch.from_numpy(rows)


class ObjectStoreTransport:
    name = OBJECT_STORE

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._handles: dict[str, object] = {}

    def actor(self, source: str) -> Any:
        """Member ``source``'s actor handle, looked up once (its readers call it too: to tell
        it to drop a block that failed its check)."""
        import ray  # here, not at import: the transports load on hosts without Ray too

        h = self._handles.get(source)
        if h is None:
            h = self._handles[source] = ray.get_actor(source, namespace=self.namespace)
        return h

    async def stream(
        self,
        source: str,
        model: str,
        keys: Sequence[bytes],
        endpoint: Any = None,
        land: Land | None = None,  # the rows arrive in plasma, read in place: not used
        asked: Asked | None = None,
    ) -> AsyncIterator[BlockBatch]:
        import ray

        try:
            exported = self.actor(source).export_blocks.remote(model, list(keys))
            if asked is not None:
                asked()
            n, rows, sums = await exported
        except ray.exceptions.RayActorError:
            self._handles.pop(source, None)  # a re-placed member is a new actor
            raise
        if n:
            yield BlockBatch(n, as_tensor(rows), tuple(tuple(c) for c in sums))

    async def fetch(
        self, source: str, model: str, keys: Sequence[bytes], endpoint: Any = None
    ) -> BlockBatch:
        """The whole batch as one buffer (``collect``; not verified)."""
        return await collect(self.stream(source, model, keys, endpoint))

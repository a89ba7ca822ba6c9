"""The transport interface: a batch of blocks, gathered into one buffer, checked on arrival.

A fetch names a source member (a pool or a CPU tier, on any node) and the keys of one KV
group's blocks, in prefix order. The source answers with the leading blocks it still holds
as one ``BlockBatch``: every block's bytes for every distinct TP copy in ONE contiguous
uint8 buffer ``[copies, count, row_bytes]`` (never one message per block) plus the
checksum each row had when it was stored (xxh3-64, ``raykv.tiers.checksum``). The receiver
verifies the rows against those checksums before a byte is scattered into a block
(``verify``, invariant 12): a batch is cut at its first bad row, which is then a miss and a
counted error, never wrong KV.

How the buffer travels is the transport's business: ``ObjectStoreTransport`` returns it from
the source's actor call (plasma on the source node, one pull to the receiver's node, read
in place). An NCCL or UCX transport implements the same ``fetch``: the source exports the
same gathered buffer (``export_rows``), the control call carries only keys, counts and
checksums, and the buffer goes over the transport's own channel (one ``send``/``recv`` per
batch, straight into the receiver's staging buffer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from raykv.tiers.checksum import row_checksums


@dataclass(frozen=True)
class BlockBatch:
    """``count`` leading blocks of a fetch: ``rows`` uint8 ``[copies, count, row_bytes]``
    (one buffer) and ``checksums`` uint64-valued ``[copies][count]`` as stored."""

    count: int
    rows: torch.Tensor
    checksums: tuple[tuple[int, ...], ...]

    @property
    def nbytes(self) -> int:
        return int(self.rows.numel())

    def head(self, n: int) -> BlockBatch:
        return BlockBatch(n, self.rows[:, :n], tuple(c[:n] for c in self.checksums))


class Transport(Protocol):
    name: str

    async def fetch(
        self, source: str, model: str, keys: Sequence[bytes], endpoint: Any = None
    ) -> BlockBatch:
        """The leading ``keys`` (one group, prefix order) that member ``source`` holds, as
        stored (not yet verified: call ``verify``); ``endpoint`` is what the source
        advertised for this transport (``Member.endpoints``). Raises ``TransportError``
        (or Ray's actor error) if the source is gone or the transfer fails."""
        ...


def export_rows(rows: torch.Tensor) -> np.ndarray:
    """A gathered ``[copies, n, width]`` buffer as the numpy array the wire carries
    (zero-copy for a contiguous CPU tensor)."""
    return rows.detach().cpu().contiguous().numpy()


def verify(batch: BlockBatch) -> int:
    """How many leading blocks of ``batch`` match their checksums in every copy (the rest
    must not be used)."""
    good = batch.count
    for c, expected in enumerate(batch.checksums):
        if good == 0:
            break
        got = row_checksums(batch.rows[c, :good])
        for i, (a, b) in enumerate(zip(got, expected[:good], strict=True)):
            if a != b:
                good = i
                break
    return good

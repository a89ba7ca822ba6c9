"""One collective batch on the wire: ``[rows | one int64 wire sum per row]``, as a few messages.

A batch of ``n`` rows of ``width`` bytes crosses as a few large messages of consecutive
rows; the last one also carries every row's wire sum (``raykv.ops.row_sums``: taken by the
paged-copy kernel while it gathers, recomputed by the kernel while the receiver scatters,
compared once the last message is in). The buffer is ``[rows | sums]``, so the sums are simply
the tail of the last message: they are complete once its rows are gathered, and a separate
message would cost each host one more NCCL call. A batch under twice ``FIRST_CHUNK_BYTES``
is one message; a larger one starts with that, doubles up to ``MAX_CHUNK_BYTES`` and ends
the same way in reverse, so the sender's first gather and the receiver's last scatter (the
copies the wire cannot hide) stay ``FIRST_CHUNK_BYTES`` whatever the batch (below twice
that, the batch is one message anyway). Not smaller: on NVLink (2 x H100, NCCL 2.28) a
message costs ~13 us on the GPU before its bytes move (8 MiB took 35 us, 16 MiB 57 us,
32 MiB 104 us) plus an NCCL call, a launch and an event on each host, so a 32 MiB batch as
8 + 16 + 8 MiB moved slower than as one message, one batch at a time and in flight alike.
Not capped lower: a 32k-token Llama-3-8B prefix per TP-2 rank pair (2 GiB) moved
0.77-0.79 x one contiguous send in 64 MiB messages and 0.82-0.83 x in up to 256 MiB
(4 x H200, one batch at a time; the extra messages' fixed costs). Both ends derive the same
plan from ``(n, width)``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from raykv.tiers.checksum import verified_prefix

SUM_BYTES = 8  # one int64 wire sum per row
FIRST_CHUNK_BYTES = 32 << 20  # 32 MiB: one message; 256 MiB: 32 + 64 x 3 + 32
MAX_CHUNK_BYTES = 256 << 20
SHARE_MIN_BYTES = 2 * FIRST_CHUNK_BYTES  # a replicated copy crosses in shares of at least this


@dataclass(frozen=True)
class WirePlan:
    """How ``n`` rows of ``width`` bytes are cut into row messages (counts, in order)."""

    width: int
    counts: tuple[int, ...]

    @classmethod
    def of(
        cls, n: int, width: int, first: int = FIRST_CHUNK_BYTES, cap: int = MAX_CHUNK_BYTES
    ) -> WirePlan:
        return _plan(cls, n, width, first, cap)

    @property
    def n(self) -> int:
        return sum(self.counts)

    @property
    def nbytes(self) -> int:
        return wire_bytes(self.n, self.width)

    def split(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows uint8 ``[n, width]``, sums int64 ``[n]``) views of a ``nbytes`` buffer."""
        size = self.n * self.width
        return buf[:size].view(self.n, self.width), buf[size : self.nbytes].view(torch.int64)

    def messages(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """The buffer's messages, in order (1-D views): each row chunk, the last one with
        the sums behind its rows."""
        out, at = [], 0
        for count in self.counts:
            out.append(buf[at : at + count * self.width])
            at += count * self.width
        out[-1] = buf[at - self.counts[-1] * self.width : self.nbytes]
        return out


@functools.lru_cache(maxsize=1024)
def _plan(cls: type[WirePlan], n: int, width: int, first: int, cap: int) -> WirePlan:
    """``WirePlan.of``, remembered: a pool moves batches of a few sizes over and over."""
    size = max(1, first // width)
    top, head, left = max(size, cap // width), [], n
    while size < top and left >= 2 * size:  # the same sizes up at the start, down at the end
        head.append(size)
        left, size = left - 2 * size, 2 * size
    k = -(-left // top)  # the middle: as few messages as the cap allows, of even sizes
    middle = [left // k + (i < left % k) for i in range(k)]
    return cls(width, tuple(head + middle + head[::-1]))


def shares(n: int, parts: int, width: int, min_bytes: int | None = None) -> list[range]:
    """``n`` rows of ``width`` bytes cut into ``parts`` consecutive shares (row ranges, in
    order; some empty). Share ``j`` of a copy that ``parts`` ranks of a TP group replicate
    (an MLA latent) crosses from the holder's replica ``j`` to the reader's replica ``j``,
    which passes it on to its group as it arrives (``Collective.recv_shares``): one copy
    crosses between the groups, each of the ``parts`` links carrying a share. Only where
    every share is at least ``min_bytes`` (``SHARE_MIN_BYTES``: two first messages, so a
    share crosses as two or more and is passed on behind its first); a smaller batch
    crosses whole from replica 0 (share 0 is everything), as a share of one message is
    passed on only once all of it is in. 4 x H200, DeepSeek-V3 MLA TP-2, one batch at a time
    / in flight against one contiguous send of the copy: 137 MiB in shares 0.65 / 0.85 x,
    whole 0.56 / 0.64; 549 MiB 0.80 / 0.89 against 0.58 / 0.75; 2196 MiB 0.84 / 0.95 against
    0.72 / 0.81; but 32 MiB in two one-message shares 0.22 / 0.21 against 0.37 / 0.54 whole.
    Both ends derive the same cut from ``(n, parts, width)``."""
    least = SHARE_MIN_BYTES if min_bytes is None else min_bytes
    if parts > 1 and n * width < parts * least:
        return [range(n)] + [range(n, n)] * (parts - 1)
    return [range(j * n // parts, (j + 1) * n // parts) for j in range(parts)]


def wire_bytes(n: int, width: int) -> int:
    return n * (width + SUM_BYTES)


def leading_matches(got: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """How many leading rows' recomputed sums ``got`` equal the ``sent`` ones: an int64
    ``[1]`` on their device (no host sync, no per-row Python)."""
    ok = got == sent
    first_bad = (~ok).to(torch.uint8).argmax()
    return torch.where(ok.all(), torch.full_like(first_bad, ok.numel()), first_bad).view(1)


def count_intact(good: int, rows: torch.Tensor, expected: Sequence[int] | None) -> int:
    """How many leading rows arrived intact: the first ``good`` rows' wire sums matched
    (``leading_matches``) and, where the rows are in host memory, their checksums (row sums)
    equal ``expected`` (the ones they were stored with; None: unchecked). On a GPU they are
    not recomputed on the host (a 2 GiB batch would cross PCIe twice); the stored checksums
    travel with the blocks."""
    if expected is None or not good or rows.device.type != "cpu":
        return good
    return verified_prefix(rows[:good], expected[:good])

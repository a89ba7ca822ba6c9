"""Local attention (sliding window, chunked local): only a moving tail of tokens is read.

Slots before the first token any future query reads are replaced by the null block (and
their blocks go back to the pool) as soon as the computed tokens allow it.
"""

from __future__ import annotations

from raykv.blocks.managers.base import GroupManager, Lookup


class LocalAttentionManager(GroupManager):
    def first_needed_token(self, num_computed: int) -> int:
        """First position the query at ``num_computed`` (and every later one) reads."""
        raise NotImplementedError

    def num_skipped(self, num_computed: int) -> int:
        return self.first_needed_token(num_computed) // self.block_size

    def longest_hit(self, lookup: Lookup, limit: int) -> int:
        """Scans down from the longest candidate. A miss at slot i rules out every
        candidate whose needed slots contain i, so the next candidate is i: each slot is
        looked up at most once."""
        j = limit // self.block_size
        while j > 0:
            i = j - 1
            start = self.num_skipped(j * self.block_size)
            while i >= start and lookup(i) is not None:
                i -= 1
            if i < start:
                return j * self.block_size
            j = i
        return 0


class SlidingWindowManager(LocalAttentionManager):
    """Keeps: the slots of the last ``window`` tokens before the next query, and all newer
    ones, hold real blocks; older slots hold the null block."""

    kinds = ("sliding_window",)

    def __init__(self, group):
        super().__init__(group)
        self.window = group.spec.window

    def first_needed_token(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1)


class ChunkedLocalManager(LocalAttentionManager):
    """Keeps: the slots of the next query's chunk hold real blocks; slots of earlier chunks
    hold the null block."""

    kinds = ("chunked_local",)

    def __init__(self, group):
        super().__init__(group)
        self.chunk = group.spec.chunk

    def first_needed_token(self, num_computed: int) -> int:
        return num_computed // self.chunk * self.chunk

"""The interface every per-spec manager implements.

A manager is stateless: it knows one group's spec and block size and answers three
questions about a request's block table; the BlockManager keeps the tables and applies the
answers through the one step planner (invariant 1).
"""

from __future__ import annotations

from collections.abc import Callable

from raykv.layout import KVGroup
from raykv.layout.specs import cdiv

Lookup = Callable[[int], "int | None"]  # table slot j -> cached block id for it, or None


class GroupManager:
    """Base: attention over every token so far (full attention, MLA)."""

    kinds: tuple[str, ...] = ()

    def __init__(self, group: KVGroup):
        self.group = group
        self.group_id = group.group_id
        self.block_size = group.block_size
        self.cacheable = group.spec.cacheable

    def num_slots(self, num_tokens: int) -> int:
        """Table length once positions ``0 .. num_tokens - 1`` have slots."""
        return cdiv(num_tokens, self.block_size)

    def num_skipped(self, num_computed: int) -> int:
        """Leading slots no future token reads once ``num_computed`` tokens are computed.

        Keeps: those slots may hold the null block; the slots after them never do. The
        result never decreases as ``num_computed`` grows.
        """
        return 0

    def longest_hit(self, lookup: Lookup, limit: int) -> int:
        """The longest prefix (a multiple of the block size, <= ``limit`` tokens) whose
        needed slots ``num_skipped(L) .. L // block_size - 1`` are all cached."""
        n = 0
        for j in range(limit // self.block_size):
            if lookup(j) is None:
                break
            n = j + 1
        return n * self.block_size

"""Full attention and MLA: every token keeps its slot until the request is freed."""

from __future__ import annotations

from raykv.blocks.managers.base import GroupManager


class FullAttentionManager(GroupManager):
    """Keeps: table length == cdiv(tokens, block_size), no null slots, prefix hits from
    block 0 on (the base behaviour)."""

    kinds = ("full", "mla")

"""Managers whose blocks do not grow with the decoder's tokens: Mamba and cross attention.

Neither is prefix-cacheable (their content is not a function of the token prefix), so a
request with such a group never gets prefix hits.
"""

from __future__ import annotations

from raykv.blocks.managers.base import GroupManager, Lookup
from raykv.layout.specs import cdiv


class MambaManager(GroupManager):
    """Keeps: exactly one state block per request from its first slot until it is freed."""

    kinds = ("mamba",)

    def num_slots(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0

    def longest_hit(self, lookup: Lookup, limit: int) -> int:
        return 0


class CrossAttentionManager(GroupManager):
    """Keeps: cdiv(max_encoder_len, block_size) blocks, taken once at the first step."""

    kinds = ("cross",)

    def __init__(self, group):
        super().__init__(group)
        self.encoder_blocks = cdiv(group.spec.max_encoder_len, self.block_size)

    def num_slots(self, num_tokens: int) -> int:
        return self.encoder_blocks if num_tokens > 0 else 0

    def longest_hit(self, lookup: Lookup, limit: int) -> int:
        return 0

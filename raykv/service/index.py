"""The cluster-wide prefix index: block hash -> which pools and tiers hold a valid copy.

Pure Python, owned by the coordinator and fed by the members' KV events. Only blocks whose
bytes were written are published (a block that is merely allocated is never a hit).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

GPU, CPU = "gpu", "cpu"


@dataclass(frozen=True)
class Location:
    """One copy of one block: the member (actor name) holding it, its node and tier."""

    member: str
    node_id: str
    tier: str  # GPU or CPU
    block_id: int = -1  # the member's own slot (GPU block id); -1 for a CPU tier

    def rank(self, node_id: str) -> int:
        """Lower is better: local GPU, local CPU, then another node's GPU, then its CPU."""
        return (0 if self.node_id == node_id else 2) + (0 if self.tier == GPU else 1)


class PrefixIndex:
    def __init__(self) -> None:
        self._where: dict[tuple[str, Hashable], dict[str, Location]] = {}
        self._by_member: dict[str, set[tuple[str, Hashable]]] = {}

    def __len__(self) -> int:
        return len(self._where)

    def add(self, model: str, loc: Location, block_hash: Hashable) -> None:
        key = (model, block_hash)
        self._where.setdefault(key, {})[loc.member] = loc
        self._by_member.setdefault(loc.member, set()).add(key)

    def remove(self, model: str, member: str, block_hash: Hashable) -> None:
        key = (model, block_hash)
        copies = self._where.get(key)
        if copies is not None and copies.pop(member, None) is not None and not copies:
            del self._where[key]
        self._by_member.get(member, set()).discard(key)

    def drop_member(self, member: str) -> int:
        """Forget every copy ``member`` holds (it died or left); returns how many."""
        keys = self._by_member.pop(member, set())
        for key in keys:
            copies = self._where.get(key)
            if copies is not None:
                copies.pop(member, None)
                if not copies:
                    del self._where[key]
        return len(keys)

    def blocks_of(self, member: str) -> int:
        return len(self._by_member.get(member, ()))

    def copies(self, model: str, block_hash: Hashable) -> list[Location]:
        return list(self._where.get((model, block_hash), {}).values())

    def longest_prefix(
        self, model: str, block_hashes: Iterable[Hashable], node_id: str
    ) -> list[Location]:
        """Best copy of each leading block, stopping at the first block nobody holds."""
        best: list[Location] = []
        for h in block_hashes:
            copies = self._where.get((model, h))
            if not copies:
                break
            best.append(min(copies.values(), key=lambda loc: loc.rank(node_id)))
        return best

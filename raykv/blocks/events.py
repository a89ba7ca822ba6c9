"""KV events: what a block pool tells the outside world about its prefix cache.

A pool emits ``BlockStored`` when full blocks enter its prefix-hash map and
``BlockRemoved`` when eviction takes them out. Replaying the events in order through a
``PrefixIndex`` rebuilds exactly the pool's map; a cluster-wide index consumes the same
events, tagged with the pool they came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from raykv.blocks.hashing import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Blocks ``block_ids`` of group ``group_id`` now hold the prefixes ``block_hashes``."""

    group_id: int
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    parent_block_hash: BlockHash | None  # hash of the block before the first one, if any
    block_size: int  # tokens per block of this group


@dataclass(frozen=True)
class BlockRemoved:
    """The prefixes ``block_hashes`` of group ``group_id`` left the pool (evicted)."""

    group_id: int
    block_hashes: tuple[BlockHash, ...]


KVEvent = BlockStored | BlockRemoved


class PrefixIndex:
    """(group_id, block hash) -> block id, rebuilt from KV events alone."""

    def __init__(self) -> None:
        self.locations: dict[tuple[int, BlockHash], int] = {}

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            for h, b in zip(event.block_hashes, event.block_ids, strict=True):
                self.locations[(event.group_id, h)] = b
        else:
            for h in event.block_hashes:
                self.locations.pop((event.group_id, h), None)

    def replay(self, events: Iterable[KVEvent]) -> PrefixIndex:
        for e in events:
            self.apply(e)
        return self

    def longest_prefix(self, group_id: int, block_hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``block_hashes`` present in the index."""
        n = 0
        for h in block_hashes:
            if (group_id, h) not in self.locations:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return len(self.locations)

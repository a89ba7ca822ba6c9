"""KV events and the one prefix index they feed.

A pool emits ``BlockStored`` when full blocks enter its prefix-hash map and
``BlockRemoved`` when eviction takes them out. Replaying the events in order through a
``PrefixIndex`` rebuilds exactly the pool's map. The same index, with the events tagged by
who sent them (a *holder*: the service's pools and tiers) and the model they belong to (a
*scope*), is the service's cluster-wide index: the coordinator feeds it and looks prefixes
up in it. There is no other prefix index.

A lookup asks, for one group and one request, "is slot ``j`` held?" as
``GroupManager.longest_hit`` walks the slots. ``GroupProbe`` answers that with one dict probe
per slot, and runs the forward scan of a manager that keeps every slot (full attention, MLA)
in C, so a 2048-block prompt costs no per-block Python call.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import Any

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

Copies = dict[Hashable, int]  # holder -> its block id of one prefix
_EMPTY: Mapping[BlockHash, Copies] = {}


class PrefixIndex:
    """(scope, group id, block hash) -> every holder of a copy, with its block id.

    In-process the scope and the holder are None (one pool: ``locations`` is its map). In
    the service the scope is the model and the holder the member (pool or tier) that sent
    the events; ``drop_member`` forgets everything one holder held (it died or left).
    """

    def __init__(self, journal: bool = False) -> None:
        self._tables: dict[tuple[Hashable, int], dict[BlockHash, Copies]] = {}
        self._held: dict[Hashable, set[tuple[Hashable, int, BlockHash]]] = {}
        # ``journal``: every (scope, group id, hash) whose holders changed, in order, until
        # its reader clears it (the service's change feed to the nodes' replicas)
        self.journal: list[tuple[Hashable, int, BlockHash]] | None = [] if journal else None

    # --- feeding it ---------------------------------------------------------------------

    def add(
        self,
        group_id: int,
        block_hash: BlockHash,
        block_id: int,
        holder: Hashable = None,
        scope: Hashable = None,
    ) -> None:
        self._add_many(group_id, (block_hash,), (block_id,), holder, scope)

    def _add_many(
        self,
        group_id: int,
        hashes: Sequence[BlockHash],
        block_ids: Sequence[int],
        holder: Hashable,
        scope: Hashable,
    ) -> None:
        """``add`` of each (hash, block id) pair, the group's table and the holder's set
        looked up once (a stored event names up to thousands of blocks). Nothing changes
        when the two do not pair up."""
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} block hashes for {len(block_ids)} block ids")
        table = self._tables.get((scope, group_id))
        if table is None:
            table = self._tables[scope, group_id] = {}
        held = self._held.get(holder)
        if held is None:
            held = self._held[holder] = set()
        for h, b in zip(hashes, block_ids, strict=True):
            copies = table.get(h)
            if copies is None:
                table[h] = {holder: b}
            else:
                copies[holder] = b
        held.update((scope, group_id, h) for h in hashes)
        if self.journal is not None:
            self.journal.extend((scope, group_id, h) for h in hashes)

    def remove(
        self, group_id: int, block_hash: BlockHash, holder: Hashable = None, scope: Hashable = None
    ) -> None:
        table = self._tables.get((scope, group_id))
        copies = None if table is None else table.get(block_hash)
        if copies is not None and copies.pop(holder, None) is not None and not copies:
            del table[block_hash]
        held = self._held.get(holder)
        if held is not None:
            held.discard((scope, group_id, block_hash))
        if self.journal is not None:
            self.journal.append((scope, group_id, block_hash))

    def apply(self, event: KVEvent, holder: Hashable = None, scope: Hashable = None) -> None:
        gid = event.group_id
        if isinstance(event, BlockStored):
            self._add_many(gid, event.block_hashes, event.block_ids, holder, scope)
        else:
            for h in event.block_hashes:
                self.remove(gid, h, holder, scope)

    def replay(
        self, events: Iterable[KVEvent], holder: Hashable = None, scope: Hashable = None
    ) -> PrefixIndex:
        for e in events:
            self.apply(e, holder, scope)
        return self

    def drop_member(self, holder: Hashable) -> int:
        """Forget every copy ``holder`` holds; returns how many."""
        keys = self._held.pop(holder, set())
        for scope, gid, h in keys:
            table = self._tables.get((scope, gid))
            copies = None if table is None else table.get(h)
            if copies is not None:
                copies.pop(holder, None)
                if not copies:
                    del table[h]
        if self.journal is not None:
            self.journal.extend(keys)
        return len(keys)

    # --- reading it ---------------------------------------------------------------------

    def scopes(self) -> list[tuple[Hashable, int]]:
        """Every (scope, group id) with a table."""
        return list(self._tables)

    def __len__(self) -> int:
        """Distinct prefixes held by anyone."""
        return sum(len(t) for t in self._tables.values())

    def blocks_of(self, holder: Hashable) -> int:
        return len(self._held.get(holder, ()))

    def table(self, group_id: int, scope: Hashable = None) -> Mapping[BlockHash, Copies]:
        """The group's map (block hash -> holders); read only."""
        return self._tables.get((scope, group_id), _EMPTY)

    def copies(self, group_id: int, block_hash: BlockHash, scope: Hashable = None) -> Copies:
        return dict(self.table(group_id, scope).get(block_hash, _EMPTY))

    @property
    def locations(self) -> dict[tuple[int, BlockHash], int]:
        """The in-process view: (group id, hash) -> block id of the unnamed holder (None)."""
        return {
            (gid, h): copies[None]
            for (scope, gid), table in self._tables.items()
            if scope is None
            for h, copies in table.items()
            if None in copies
        }

    def longest_prefix(
        self, group_id: int, block_hashes: Iterable[BlockHash], scope: Hashable = None
    ) -> int:
        """Leading blocks of ``block_hashes`` somebody holds."""
        table = self.table(group_id, scope)
        return len(list(takewhile(table.__contains__, block_hashes)))

    def probe(self, group_id: int, keys: Sequence[BlockHash], manager: Any, scope=None):
        """``keys`` (one group's, of one request) against this index: see ``GroupProbe``."""
        return GroupProbe(self.table(group_id, scope), keys, manager)


class GroupProbe:
    """One group's keys of one request against the index, answering what the group's
    ``GroupManager`` asks: ``probe(j)`` is the holders of slot ``j`` (None: nobody), and
    ``probe.longest_hit(lookup, limit)`` is ``manager.longest_hit`` over the index (so a
    list of probes goes where a list of managers goes, e.g. ``common_hit``)."""

    __slots__ = ("_run", "keys", "manager", "table")

    def __init__(
        self, table: Mapping[BlockHash, Copies], keys: Sequence[BlockHash], manager: Any
    ) -> None:
        self.table, self.keys, self.manager = table, keys, manager
        self._run: int | None = None

    def __call__(self, j: int) -> Copies | None:
        return self.table.get(self.keys[j]) if j < len(self.keys) else None

    def run(self) -> int:
        """Leading slots held, scanned in C."""
        if self._run is None:
            self._run = len(list(takewhile(self.table.__contains__, self.keys)))
        return self._run

    def longest_hit(self, lookup: Any, limit: int) -> int:
        """``manager.longest_hit`` answered from the index (``lookup`` is this probe's own
        question). The base rule (scan forward to the first miss) is ``run``."""
        from raykv.blocks.managers.base import GroupManager

        m = self.manager
        if type(m).longest_hit is GroupManager.longest_hit:
            return min(self.run(), limit // m.block_size) * m.block_size
        return m.longest_hit(self, limit)

"""BlockPool: the fixed set of GPU block ids, who holds them and which prefixes they cache.

- Block 0 is the null block: it marks skipped (out-of-window) slots of a block table and is
  never handed out, freed, cached, ref-counted or counted as free (invariant 3).
- A block is *used* (ref count > 0) or *free*. Free blocks wait in one of two queues:
  uncached ones are handed out first; cached ones keep their prefix until they are
  evicted, least recently freed first. Evicting a block emits ``BlockRemoved``.
- Every full block with known tokens is findable while it is used or cached, duplicates
  included (invariant 8): ``cached`` maps a prefix to the block that serves it, and the
  other blocks holding the same prefix wait in ``_copies``; when the serving block is
  evicted a copy takes its place. ``lookup`` prefers a copy that is in use, so a hit never
  revives a free block while an identical one is held; where every copy is free it revives
  the one freed last, so the copies left in the free queue are the first to be evicted.
- ``uncache`` takes blocks whose bytes are not their prefix's (a load that failed its checks
  wrote part of them) out of the map: the one exception to findability; a pool that later
  writes them whole caches them again (``cache``).
- A prefix hit on a free cached block (``touch``) takes it out of the free queue.
- Anything that must keep a block from being reused (a store in flight, invariant 9) holds
  a reference with ``touch`` and drops it with ``free``: the free count stays exact.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable

from raykv.blocks.events import BlockRemoved, BlockStored, KVEvent
from raykv.blocks.hashing import BlockHash
from raykv.errors import InvalidInput

NULL_BLOCK = 0

CacheKey = tuple[int, BlockHash]  # (group_id, block hash)


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise InvalidInput(f"a block pool needs >= 1 block (the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[CacheKey | None] = [None] * num_blocks
        self.cached: dict[CacheKey, int] = {}  # the prefix-hash map: the serving block
        # prefixes held by more than one block: key -> (parent hash, the other blocks)
        self._copies: dict[CacheKey, tuple[BlockHash | None, list[int]]] = {}
        self._block_sizes: dict[int, int] = {}  # group id -> block size, for copies' events
        self._free_uncached: deque[int] = deque(range(1, num_blocks))
        # LRU order, oldest first: block -> when it was freed (``_num_freed`` then)
        self._free_cached: OrderedDict[int, int] = OrderedDict()
        self._num_freed = 0  # cached blocks that ever joined the free queue
        self._events: list[KVEvent] = []
        self.num_taken = 0  # blocks that ever left the free queues (allocated or revived)
        self.num_evicted = 0

    # --- counts -----------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def has_copies(self) -> bool:
        """True while some prefix is held by more than one block."""
        return bool(self._copies)

    def is_free(self, block_id: int) -> bool:
        return block_id != NULL_BLOCK and self.ref_counts[block_id] == 0

    def is_cached(self, block_id: int) -> bool:
        return self.block_keys[block_id] is not None

    # --- prefix-hash map --------------------------------------------------------------

    def lookup(self, key: CacheKey) -> int | None:
        """A block holding prefix ``key``: one in use if any copy is, else the copy freed
        last.

        Reviving the copy freed last leaves the other copies (spares while the hit holds
        the prefix) at their older places in the free queue, so they are evicted before
        anything freed after them. vLLM revives the copy cached first, here the serving
        block; after a hit that took a held copy (where vLLM revived the free one) that can
        be the older free copy, and reviving it would leave the newer one as the spare,
        behind blocks that vLLM's spare goes before: a later prompt would hit less than in
        vLLM."""
        b = self.cached.get(key)
        if b is not None and self._copies and not self.ref_counts[b]:
            entry = self._copies.get(key)
            if entry is not None:
                rc, freed = self.ref_counts, self._free_cached
                last = b
                for c in entry[1]:
                    if rc[c]:
                        return c
                    if freed.get(c, 0) > freed.get(last, 0):
                        last = c
                return last
        return b

    def cache(
        self,
        group_id: int,
        block_hashes: list[BlockHash],
        block_ids: list[int],
        parent: BlockHash | None,
        block_size: int,
    ) -> None:
        """Enter full, used blocks into the map and emit one ``BlockStored`` for the
        prefixes that were not mapped yet. A prefix already mapped (another request
        computed it too) keeps its serving block and the new block becomes a findable
        copy (invariant 8)."""
        if not self.enable_caching:
            return
        hashes, ids = [], []
        cached, keys = self.cached, self.block_keys
        prev = parent
        for h, b in zip(block_hashes, block_ids, strict=True):
            key = (group_id, h)
            if b == NULL_BLOCK or keys[b] is not None:
                prev = h
                continue
            keys[b] = key
            if key in cached:
                self._block_sizes[group_id] = block_size
                entry = self._copies.get(key)
                if entry is None:
                    self._copies[key] = (prev, [b])
                else:
                    entry[1].append(b)
            else:
                cached[key] = b
                hashes.append(h)
                ids.append(b)
            prev = h
        if ids:
            self._events.append(
                BlockStored(group_id, tuple(hashes), tuple(ids), parent, block_size)
            )

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Take blocks out of the prefix-hash map: their bytes are not what their prefix
        says (a load that failed its checks wrote part of them), so no lookup may find them
        from now on. A prefix other blocks also hold stays findable through one of them; a
        free block among them moves to the uncached free queue. Null and uncached blocks
        are skipped; ref counts do not change (a holder keeps its block, unfindable)."""
        removed: dict[int, list[BlockHash]] = {}
        for b in block_ids:
            if b == NULL_BLOCK or self.block_keys[b] is None:
                continue
            self._evict(b, removed)
            if not self.ref_counts[b]:
                del self._free_cached[b]
                self._free_uncached.append(b)
        for gid, hashes in removed.items():
            self._events.append(BlockRemoved(gid, tuple(hashes)))

    # --- taking and returning blocks ----------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref count 1): uncached first, then evict cached LRU-first."""
        if n > self.num_free_blocks:
            raise InvalidInput(f"asked for {n} blocks but only {self.num_free_blocks} are free")
        out: list[int] = []
        take = min(n, len(self._free_uncached))
        popleft = self._free_uncached.popleft
        for _ in range(take):
            out.append(popleft())
        if take < n:
            removed: dict[int, list[BlockHash]] = {}
            for _ in range(n - take):
                b, _ = self._free_cached.popitem(last=False)
                self._evict(b, removed)
                out.append(b)
            self.num_evicted += n - take
            for gid, hashes in removed.items():
                self._events.append(BlockRemoved(gid, tuple(hashes)))
        rc = self.ref_counts
        for b in out:
            rc[b] = 1
        self.num_taken += n
        return out

    def _evict(self, b: int, removed: dict[int, list[BlockHash]]) -> None:
        """Drop free block ``b`` from the map. A prefix with other copies stays findable:
        one of them serves it from now on (announced with a ``BlockStored``)."""
        key = self.block_keys[b]
        self.block_keys[b] = None
        entry = self._copies.get(key) if self._copies else None
        if entry is None:
            if self.cached.get(key) == b:
                del self.cached[key]
                removed.setdefault(key[0], []).append(key[1])
            return
        parent, others = entry
        if self.cached.get(key) == b:
            self.cached[key] = nb = others.pop(0)
            self._events.append(
                BlockStored(key[0], (key[1],), (nb,), parent, self._block_sizes[key[0]])
            )
        else:
            others.remove(b)
        if not others:
            del self._copies[key]

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; a free (cached) block leaves the free queue."""
        rc = self.ref_counts
        for b in block_ids:
            if b == NULL_BLOCK:
                continue
            if rc[b] == 0:
                if b in self._free_cached:
                    del self._free_cached[b]
                else:
                    self._free_uncached.remove(b)  # rare: pinning an uncached free block
                self.num_taken += 1
            rc[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block; at zero it joins the free queue's tail (so blocks
        freed first are evicted first)."""
        rc = self.ref_counts
        ids = [b for b in block_ids if b != NULL_BLOCK]
        # Check every id before changing any count: a bad call leaves the pool as it was.
        for b, n in Counter(ids).items():
            held = rc[b] if 0 < b < self.num_blocks else 0
            if held < n:
                raise InvalidInput(
                    f"block {b} freed {n} time(s) but holds {held} reference(s); free only "
                    "blocks this pool handed out, once per reference"
                )
        for b in ids:
            rc[b] -= 1
            if rc[b] == 0:
                if self.block_keys[b] is not None:
                    self._num_freed += 1
                    self._free_cached[b] = self._num_freed
                else:
                    self._free_uncached.append(b)

    def release(self, block_ids: Iterable[int]) -> None:
        """``free`` without the argument check, for the block manager's own tables, whose
        ids hold one reference per slot by construction (invariant 3: null slots skipped)."""
        rc = self.ref_counts
        keys = self.block_keys
        for b in block_ids:
            if b:
                n = rc[b] - 1
                rc[b] = n
                if not n:
                    if keys[b] is not None:
                        self._num_freed += 1
                        self._free_cached[b] = self._num_freed
                    else:
                        self._free_uncached.append(b)

    def drain_events(self) -> list[KVEvent]:
        out, self._events = self._events, []
        return out

    def free_block_ids(self) -> list[int]:
        """Free blocks in hand-out order (for tests and debugging)."""
        return [*self._free_uncached, *self._free_cached]

"""BlockPool: the fixed set of GPU block ids, who holds them and which prefixes they cache.

- Block 0 is the null block: it marks skipped (out-of-window) slots of a block table and is
  never handed out, freed, cached, ref-counted or counted as free (invariant 3).
- A block is *used* (ref count > 0) or *free*. Free blocks wait in one of two queues:
  uncached ones are handed out first; cached ones keep their prefix until they are
  evicted, least recently freed first. Evicting a block emits ``BlockRemoved``.
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
        self.cached: dict[CacheKey, int] = {}  # the prefix-hash map
        self._free_uncached: deque[int] = deque(range(1, num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
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

    def is_free(self, block_id: int) -> bool:
        return block_id != NULL_BLOCK and self.ref_counts[block_id] == 0

    def is_cached(self, block_id: int) -> bool:
        return self.block_keys[block_id] is not None

    # --- prefix-hash map --------------------------------------------------------------

    def lookup(self, key: CacheKey) -> int | None:
        return self.cached.get(key)

    def cache(
        self,
        group_id: int,
        block_hashes: list[BlockHash],
        block_ids: list[int],
        parent: BlockHash | None,
        block_size: int,
    ) -> None:
        """Enter full, used blocks into the map and emit one ``BlockStored``. A prefix
        already mapped (another request computed it too) keeps its first block; the
        duplicate stays uncached and is simply freed later."""
        if not self.enable_caching:
            return
        hashes, ids = [], []
        for h, b in zip(block_hashes, block_ids, strict=True):
            key = (group_id, h)
            if b == NULL_BLOCK or key in self.cached or self.block_keys[b] is not None:
                continue
            self.cached[key] = b
            self.block_keys[b] = key
            hashes.append(h)
            ids.append(b)
        if ids:
            self._events.append(
                BlockStored(group_id, tuple(hashes), tuple(ids), parent, block_size)
            )

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
                key = self.block_keys[b]
                del self.cached[key]
                self.block_keys[b] = None
                removed.setdefault(key[0], []).append(key[1])
                out.append(b)
            self.num_evicted += n - take
            for gid, hashes in removed.items():
                self._events.append(BlockRemoved(gid, tuple(hashes)))
        rc = self.ref_counts
        for b in out:
            rc[b] = 1
        self.num_taken += n
        return out

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
                    self._free_cached[b] = None
                else:
                    self._free_uncached.append(b)

    def drain_events(self) -> list[KVEvent]:
        out, self._events = self._events, []
        return out

    def free_block_ids(self) -> list[int]:
        """Free blocks in hand-out order (for tests and debugging)."""
        return [*self._free_uncached, *self._free_cached]

"""BlockPool: null block, free-queue order, LRU eviction, touch, events."""

from __future__ import annotations

import pytest

from raykv.blocks import BlockPool, BlockRemoved, BlockStored, PrefixIndex
from raykv.errors import InvalidInput


def test_null_block_is_never_handed_out_or_freed():
    pool = BlockPool(4)
    assert pool.num_free_blocks == 3
    assert sorted(pool.allocate(3)) == [1, 2, 3]
    pool.free([0, 0])  # null slots in a table are skipped, not counted
    pool.touch([0])
    assert pool.ref_counts[0] == 0 and pool.num_free_blocks == 0
    with pytest.raises(InvalidInput):
        pool.allocate(1)


def test_uncached_blocks_first_then_cached_lru():
    pool = BlockPool(6)
    a, b, c, *_ = pool.allocate(5)
    pool.cache(0, [b"a", b"b"], [a, b], None, 16)
    pool.free([b, a])  # freed: b first, then a -> b is evicted first
    pool.free([c])
    assert pool.allocate(1) == [c]  # uncached before any cached one
    assert pool.drain_events() == [BlockStored(0, (b"a", b"b"), (a, b), None, 16)]
    assert pool.allocate(1) == [b]
    assert pool.drain_events() == [BlockRemoved(0, (b"b",))]
    assert pool.lookup((0, b"b")) is None and pool.lookup((0, b"a")) == a


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache(1, [b"x"], [a], None, 4)
    pool.free([a, b])
    assert pool.num_free_blocks == 2
    taken = pool.num_taken
    pool.touch([pool.lookup((1, b"x"))])
    assert pool.num_free_blocks == 1 and pool.ref_counts[a] == 1
    assert pool.num_taken == taken + 1
    assert pool.allocate(1) == [b]  # the revived block cannot be evicted


def test_duplicate_prefix_is_a_findable_copy():
    """Invariant 8: every full block with known tokens is findable while it exists. A
    second block with an already mapped prefix becomes a copy; when the serving block is
    evicted the copy serves the prefix (one BlockStored, no BlockRemoved)."""
    pool = BlockPool(5)
    a, b, c = pool.allocate(3)
    pool.cache(0, [b"h"], [a], None, 4)
    pool.cache(0, [b"h"], [b], None, 4)
    pool.cache(1, [b"h"], [c], None, 4)  # same hash in another group is another prefix
    assert pool.cached == {(0, b"h"): a, (1, b"h"): c}
    index = PrefixIndex().replay(pool.drain_events())
    pool.free([a])
    assert pool.lookup((0, b"h")) == b  # a held copy beats a free one
    pool.free([b])
    assert pool.lookup((0, b"h")) == b  # every copy free: the one freed last
    assert pool.allocate(1) == [4]  # the uncached block goes first
    assert pool.allocate(1) == [a]  # then LRU: a, the serving block, is evicted ...
    assert pool.cached == {(0, b"h"): b, (1, b"h"): c}  # ... and its copy takes over
    assert index.replay(pool.drain_events()).locations == pool.cached
    assert pool.allocate(1) == [b]
    assert pool.cached == {(1, b"h"): c}
    assert pool.drain_events() == [BlockRemoved(0, (b"h",))]


def test_a_hit_on_free_copies_revives_the_one_freed_last():
    """Where every copy of a prefix is free, a hit revives the copy freed last, so the
    spares it leaves keep their older places in the free queue and go before anything freed
    after them (vLLM revives the copy cached first; a held-copy hit here can make that the
    older one, and reviving it would leave the newer spare behind blocks vLLM evicts first)."""
    pool = BlockPool(5)
    a, b, c, d = pool.allocate(4)
    for x in (a, b, c):
        pool.cache(0, [b"h"], [x], None, 4)
    assert pool.cached == {(0, b"h"): a}
    pool.free([b])
    pool.free([d])  # uncached: not a copy
    pool.free([a])
    assert pool.lookup((0, b"h")) == c  # c is held: no free copy is revived
    pool.free([c])
    assert pool.lookup((0, b"h")) == c
    pool.touch([c])
    assert pool.lookup((0, b"h")) == c
    assert pool.allocate(1) == [d]  # the uncached block first
    assert pool.allocate(1) == [b]  # then the spares, oldest first: b, then a
    assert pool.lookup((0, b"h")) == c
    pool.free([c])
    pool.touch([a])  # a held copy again
    assert pool.lookup((0, b"h")) == a
    pool.free([a])  # a joins the queue after c: a is the one freed last now
    assert pool.lookup((0, b"h")) == a
    assert pool.free_block_ids() == [c, a]


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(InvalidInput):
        pool.free([a])


def test_over_free_is_refused_and_changes_nothing():
    pool = BlockPool(8)
    a, b = pool.allocate(2)
    before = (list(pool.ref_counts), pool.free_block_ids())
    with pytest.raises(InvalidInput, match=f"block {b} freed 2 time"):
        pool.free([a, b, b])
    assert (list(pool.ref_counts), pool.free_block_ids()) == before

"""StoreJob / LoadJob: null blocks skipped and counted (invariant 4), also at the window edge."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.errors import InvalidInput
from raykv.layout import SlidingWindow
from raykv.tiers import NULL_BLOCK, LoadJob, StoreJob, group_block_hashes, group_factor
from raykv.tiers.jobs import BlockJob, slots_of

from .helpers import make_plan


def window_table(num_tokens: int, block_size: int, window: int, ids: list[int]) -> list[int]:
    """A sliding-window block table: blocks wholly before the window are null."""
    n = -(-num_tokens // block_size)
    first_live = max(0, num_tokens - window) // block_size
    return [NULL_BLOCK if i < first_live else ids[i] for i in range(n)]


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([2, 4, 8]),
    factor=st.sampled_from([1, 2, 3, 4]),
    window=st.integers(1, 40),
    num_tokens=st.integers(0, 120),
    cap=st.none() | st.integers(0, 10),
    kind=st.sampled_from([StoreJob, LoadJob]),
)
def test_window_tables_count_only_carried_blocks(block_size, factor, window, num_tokens, cap, kind):
    p = make_plan("sliding", block_size=block_size, factor=factor, window=window)
    (g,) = p.groups
    ids = list(range(1, 1 + -(-num_tokens // block_size)))
    table = window_table(num_tokens, block_size, window, [0, *ids])
    full_blocks = num_tokens // block_size
    hashes = [[b"h%d" % i for i in range(full_blocks)]]
    job = kind.build(p, "r", [table], hashes, None if cap is None else [cap])
    f = group_factor(p, g)
    # invariant 4, whatever the window / factor / cap
    assert sum(job.group_sizes) == len(job.block_ids)
    assert NULL_BLOCK not in job.block_ids
    assert sum(job.key_widths) == len(job.block_ids) + job.num_skipped
    # exactly the real blocks of complete offload blocks that are not all null
    chunks = full_blocks // f if cap is None else min(full_blocks // f, cap)
    expect_ids, expect_keys, expect_slots = [], [], []
    for c in range(chunks):
        chunk = table[c * f : (c + 1) * f]
        if any(chunk):
            expect_keys.append(hashes[0][(c + 1) * f - 1])
            for sub, b in enumerate(chunk):
                if b:
                    expect_ids.append(b)
                    expect_slots.append((len(expect_keys) - 1, sub))
    assert list(job.block_ids) == expect_ids
    assert list(job.keys) == expect_keys
    assert list(job.slots) == expect_slots
    masks = job.valid_masks()
    assert sum(map(sum, masks)) == len(job.block_ids)


def test_offload_block_straddling_the_window_edge():
    """block size 4, window 6, 20 tokens, factor 4: GPU blocks 0-2 fell out of the window;
    the first CPU block covers null blocks 0-2 and the real block 3."""
    p = make_plan("sliding", block_size=4, factor=4, window=6, num_gpu_blocks=64)
    assert isinstance(p.groups[0].spec, SlidingWindow)
    table = [0, 0, 0, 13, 14]  # 20 tokens -> 5 blocks, positions 0..13 out of the window
    hashes = [[b"h%d" % i for i in range(5)]]
    job = StoreJob.build(p, "r", [table], hashes)
    assert job.keys == (b"h3",)  # one complete offload block (blocks 0-3)
    assert job.block_ids == (13,)
    assert job.group_sizes == (1,)
    assert job.slots == ((0, 3),)
    assert job.num_skipped == 3
    assert job.valid_masks() == ((False, False, False, True),)


def test_hybrid_groups_are_grouped_in_plan_order():
    p = make_plan("hybrid", block_size=4, factor=2)
    assert len(p.groups) == 2
    tables = [[5, 6, 7, 8], [0, 0, 9, 10]]
    hashes = [[b"a0", b"a1", b"a2", b"a3"], [b"s0", b"s1", b"s2", b"s3"]]
    job = StoreJob.build(p, "r", tables, hashes)
    assert job.keys == (b"a1", b"a3", b"s3")  # the all-null offload block of group 1 is skipped
    assert job.key_groups == (0, 0, 1)
    assert job.block_ids == (5, 6, 7, 8, 9, 10)
    assert job.group_sizes == (4, 2)
    sub = job.select({b"a3", b"s3"})
    assert sub.block_ids == (7, 8, 9, 10) and sub.group_sizes == (2, 2)
    assert sub.slots == ((0, 0), (0, 1), (1, 0), (1, 1))
    assert sum(sub.group_sizes) == len(sub.block_ids)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_select_keeps_invariant_4(data):
    p = make_plan("hybrid", block_size=4, factor=data.draw(st.sampled_from([1, 2, 4])))
    n = data.draw(st.integers(0, 12))
    tables = [
        [data.draw(st.sampled_from([0, 1 + i + 100 * g])) for i in range(n)] for g in range(2)
    ]
    hashes = [[b"%d-%d" % (g, i) for i in range(n)] for g in range(2)]
    job = StoreJob.build(p, "r", tables, hashes)
    keep = data.draw(st.sets(st.sampled_from(job.keys))) if job.keys else set()
    sub = job.select(keep)
    assert set(sub.keys) == keep
    assert sum(sub.group_sizes) == len(sub.block_ids) == len(sub.slots)
    assert sum(sub.key_widths) == len(sub.block_ids) + sub.num_skipped


def test_group_block_hashes_take_the_hash_at_each_block_end():
    p = make_plan("ratio_hybrid", block_size=4)  # group 0 block 8 (2 hash blocks), group 1 block 4
    hashes = [b"h%d" % i for i in range(5)]
    per = group_block_hashes(p, hashes)
    g0, g1 = p.groups
    assert g0.block_size == 8 and g1.block_size == 4
    assert per[0] == [b"\0\0\0\0h1", b"\0\0\0\0h3"]
    assert per[1] == [b"\1\0\0\0h%d" % i for i in range(5)]


def test_job_rejects_bad_counts():
    with pytest.raises(InvalidInput, match="invariant 4"):
        BlockJob("r", (b"k",), (0,), (1,), (5,), (2,), ((0, 0),))
    with pytest.raises(InvalidInput, match="null block"):
        BlockJob("r", (b"k",), (0,), (1,), (0,), (1,), ((0, 0),))
    p = make_plan("hybrid")
    with pytest.raises(InvalidInput, match="one block table and one hash list per group"):
        StoreJob.build(p, "r", [[1]], [[b"x"]])


@settings(max_examples=80, deadline=None)
@given(
    block_size=st.sampled_from([2, 4]),
    factor=st.sampled_from([1, 2, 3, 4]),
    window=st.integers(1, 24),
    steps=st.lists(st.integers(1, 12), min_size=1, max_size=8),
)
def test_jobs_from_a_block_managers_sliding_window_tables(block_size, factor, window, steps):
    """Invariant 4 on the tables the block manager really produces: after chunked prefill and
    decode steps the window has nulled the oldest GPU blocks, and an offload block may cover
    null and real blocks at once."""
    from raykv.blocks import BlockManager

    p = make_plan("sliding", block_size=block_size, factor=factor, window=window)
    total = min(sum(steps), p.max_model_len)
    tokens = list(range(100, 100 + total))
    mgr = BlockManager(p)
    assert mgr.admit("r", total, tokens)
    done = 0
    for n in steps:
        n = min(n, total - done)
        done += n
        assert mgr.allocate("r", n, tokens[:done]) is not None
    table = mgr.block_table("r")
    hashes = group_block_hashes(p, mgr.block_hashes("r"))
    f = group_factor(p, p.groups[0])
    covered = min(len(table[0]), len(hashes[0])) // f
    chunks = [table[0][c * f : (c + 1) * f] for c in range(covered)]
    for kind in (StoreJob, LoadJob):
        job = kind.build(p, "r", table, hashes)
        assert sum(job.group_sizes) == len(job.block_ids)  # invariant 4
        assert list(job.block_ids) == [b for c in chunks for b in c if b != NULL_BLOCK]
        assert job.keys == tuple(
            hashes[0][(c + 1) * f - 1] for c in range(covered) if any(chunks[c])
        )
        assert job.num_skipped == sum(c.count(NULL_BLOCK) for c in chunks if any(c))
        assert sum(map(sum, job.valid_masks())) == len(job.block_ids)


@settings(max_examples=60, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=20))
def test_slots_from_arrays_are_the_pairs_they_hold(pairs):
    """``slots_of`` (a lease's arrays as a job's slots): the same pairs, the shared tuples of a
    one-block-per-key job included."""
    keys = np.array([k for k, _ in pairs], np.int64)
    subs = np.array([s for _, s in pairs], np.int64)
    assert slots_of(keys, subs) == tuple(pairs)
    n = len(pairs)
    assert slots_of(np.arange(n), np.zeros(n, np.int64)) == tuple((i, 0) for i in range(n))

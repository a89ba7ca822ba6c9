"""BlockManager behaviour per spec kind, prefix hits, admission and errors."""

from __future__ import annotations

import pytest

from raykv.blocks import BlockManager, PrefixIndex, tenant_key
from raykv.errors import InvalidInput, UnknownRequest
from raykv.layout import MLA, ChunkedLocal, CrossAttention, FullAttention, Mamba, SlidingWindow

from .helpers import check_pool, make_plan


def _mgr(specs, blocks=64, bs=4, **kw) -> BlockManager:
    return BlockManager(make_plan(specs, blocks, bs, **kw))


def test_full_attention_prefix_hit_and_cached_tokens():
    mgr = _mgr([FullAttention()])
    prompt = list(range(18))  # 4 full blocks + 2 tokens
    assert mgr.admit("a", 18) and mgr.allocate("a", 18, prompt) is not None
    assert mgr.cached_prefix(prompt) == 16
    assert mgr.cached_prefix(prompt[:16]) == 12  # one token is always left to compute
    assert mgr.admit("b", 18)
    assert mgr.blocks_needed("b", 18, prompt) == 1
    new = mgr.allocate("b", 18, prompt)
    assert new[0][:4] == mgr.block_table("a")[0][:4]
    assert mgr.num_cached_tokens("b") == 16
    check_pool(mgr)
    mgr.free("a")
    mgr.free("b")
    assert mgr.num_free_blocks == 63
    assert mgr.cached_prefix(prompt) == 16  # freed blocks stay cached until evicted


def test_hit_is_capped_at_the_step_and_salted_apart():
    mgr = _mgr([FullAttention()])
    prompt = list(range(32))
    mgr.admit("a", 32)
    mgr.allocate("a", 32, prompt)
    assert mgr.cached_prefix(prompt, tenant=tenant_key(cache_salt="other")) == 0
    assert mgr.cached_prefix(prompt, tenant=tenant_key(lora="adapter")) == 0
    # a tenant's own blocks are its hits, and nobody else's
    mgr.admit("t", 32, prompt, tenant=tenant_key("other"))
    mgr.allocate("t", 32, prompt)
    assert mgr.cached_prefix(prompt, tenant=tenant_key(cache_salt="other")) == 28
    assert mgr.cached_prefix(prompt, tenant=tenant_key(cache_salt="another")) == 0
    mgr.free("t")
    mgr.admit("b", 32)
    mgr.allocate("b", 8, prompt)  # chunked prefill: only the chunk's positions
    assert mgr.num_cached_tokens("b") == 8 and len(mgr.block_table("b")[0]) == 2


def test_sliding_window_nulls_blocks_as_tokens_are_computed():
    mgr = _mgr([SlidingWindow(window=6)], bs=2)
    mgr.admit("r", 20)
    mgr.allocate("r", 10)
    assert 0 not in mgr.block_table("r")[0]
    mgr.allocate("r", 1)  # computed 10: the next query reads 5.. -> blocks 0, 1 released
    assert mgr.block_table("r")[0][:3] == [0, 0, mgr.block_table("r")[0][2]]
    assert mgr.num_free_blocks == 63 - 6 + 2
    check_pool(mgr)


def test_chunked_local_nulls_earlier_chunks():
    mgr = _mgr([ChunkedLocal(chunk=8)], bs=2)
    mgr.admit("r", 20)
    mgr.allocate("r", 7)
    mgr.allocate("r", 1)  # computed 7: still chunk 0
    assert 0 not in mgr.block_table("r")[0]
    mgr.allocate("r", 1)  # computed 8: chunk 1 starts, chunk 0's 4 blocks go
    assert mgr.block_table("r")[0][:4] == [0, 0, 0, 0]
    check_pool(mgr)


def test_mamba_one_block_and_cross_attention_once():
    mgr = _mgr([FullAttention(), Mamba(), CrossAttention(max_encoder_len=10)])
    assert not mgr.enable_prefix_caching  # no hit could ever be served
    assert mgr.admission_blocks(9) == 3 + 1 + 3
    mgr.admit("r", 9)
    first = mgr.allocate("r", 9, list(range(9)))
    assert [len(x) for x in first] == [3, 1, 3]
    second = mgr.allocate("r", 4, list(range(13)))
    assert [len(x) for x in second] == [1, 0, 0]
    assert mgr.drain_events() == []


def test_hybrid_hit_is_common_to_all_groups():
    # full attention (block 4) + sliding window 4 (block 8): hit must suit both
    mgr = _mgr([FullAttention(), SlidingWindow(window=4)], group_block_sizes=[4, 8])
    prompt = list(range(30))
    mgr.admit("a", 30)
    mgr.allocate("a", 30, prompt)
    assert mgr.cached_prefix(prompt) == 24
    mgr.admit("b", 30)
    mgr.allocate("b", 30, prompt)
    assert mgr.num_cached_tokens("b") == 24
    sw = mgr.block_table("b")[1]
    assert sw[:2] == [0, 0] and sw[2] == mgr.block_table("a")[1][2]  # window only
    check_pool(mgr)


def test_sliding_window_hit_needs_only_the_window():
    mgr = _mgr([SlidingWindow(window=4)], blocks=12, bs=2, max_num_batched_tokens=4)
    a = list(range(40))
    mgr.admit("a", 40)
    for i in range(0, 40, 4):
        mgr.allocate("a", 4, a[: i + 4])
    mgr.free("a")
    # the early blocks were evicted while "a" ran; the tail still serves a hit
    assert mgr.cached_prefix(a) == 38
    mgr.admit("b", 40)
    # 20 slots, but only the window's 3 are real: 2 revived hits + 1 fresh
    assert mgr.blocks_needed("b", 40, a) == 3
    mgr.allocate("b", 40, a)
    assert mgr.num_cached_tokens("b") == 38
    table = mgr.block_table("b")[0]
    assert table[:17] == [0] * 17 and 0 not in table[17:]  # query 38 reads tokens 35..38
    check_pool(mgr)


def test_allocate_none_changes_nothing():
    mgr = _mgr([FullAttention()], blocks=5)
    mgr.admit("a", 12)
    mgr.allocate("a", 12, list(range(12)))
    mgr.admit("b", 8) if mgr.num_free_blocks >= 2 else None
    before = (mgr.num_free_blocks, mgr.pool.num_taken, mgr.block_table("a"))
    assert mgr.allocate("a", 8) is None
    assert (mgr.num_free_blocks, mgr.pool.num_taken, mgr.block_table("a")) == before


def test_admission_gate():
    mgr = _mgr(
        [SlidingWindow(window=8)], blocks=10, bs=2, max_model_len=100, max_num_batched_tokens=8
    )
    with pytest.raises(InvalidInput):
        mgr.admit("r", 101)
    assert mgr.admit("r", 100)  # needs only its window and one 8-token chunk: 8 blocks
    with pytest.raises(InvalidInput):
        mgr.admit("r", 10)  # already admitted
    mgr.allocate("r", 8)
    mgr.allocate("r", 6)
    assert mgr.num_free_blocks == 9 - 7 + 0
    assert mgr.admit("x", 4) and not mgr.admit("y", 100)  # 4 blocks not free now
    assert "y" not in mgr
    with pytest.raises(InvalidInput):
        mgr.allocate("r", 100)  # past max_model_len


def test_unknown_requests_raise():
    mgr = _mgr([MLA()])
    for call in (mgr.free, mgr.block_table, mgr.num_cached_tokens):
        with pytest.raises(UnknownRequest):
            call("nope")
    with pytest.raises(UnknownRequest):
        mgr.allocate("nope", 1)
    with pytest.raises(UnknownRequest):
        mgr.blocks_needed("nope", 1)
    mgr.admit("r", 4)
    with pytest.raises(InvalidInput):
        mgr.kernel_block_table("r", 7)


def test_held_blocks_are_not_reused_until_released():
    mgr = _mgr([FullAttention()], blocks=3)
    mgr.admit("a", 8)
    mgr.allocate("a", 8)
    blocks = mgr.block_table("a")[0]
    mgr.hold_blocks(blocks)  # a store to the CPU tier is reading them
    mgr.free("a")
    assert mgr.num_free_blocks == 0
    mgr.release_blocks(blocks)
    assert mgr.num_free_blocks == 2


def test_events_replay_to_the_pool_map():
    mgr = _mgr([FullAttention(), SlidingWindow(window=4)], blocks=14, bs=2)
    index = PrefixIndex()
    for r in range(8):
        prompt = [r % 3] * 6 + list(range(r, r + 6))
        if mgr.admit(r, 12):
            mgr.allocate(r, 12, prompt)
            index.replay(mgr.drain_events())
            if r != 7:
                mgr.free(r)
    assert mgr.pool.num_evicted > 0
    index.replay(mgr.drain_events())
    assert index.locations == mgr.pool.cached


def test_hits_are_touched_before_fresh_blocks_are_taken():
    # Invariant 8: the hit blocks are the least recently freed, first in line for eviction.
    mgr = _mgr([FullAttention()], blocks=5, bs=2)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    for rid, prompt in (("x", x), ("y", y)):
        mgr.admit(rid, 4)
        mgr.allocate(rid, 4, prompt)
    x_blocks, y_blocks = mgr.block_table("x")[0], mgr.block_table("y")[0]
    mgr.free("x")
    mgr.free("y")
    assert mgr.num_free_blocks == 4
    mgr.admit("b", 8)
    assert mgr.blocks_needed("b", 8, [*x, 9, 9, 9, 9]) == 4  # 2 revived hits + 2 fresh
    mgr.allocate("b", 8, [*x, 9, 9, 9, 9])
    table = mgr.block_table("b")[0]
    assert table[:2] == x_blocks and sorted(table[2:]) == sorted(y_blocks)
    assert mgr.num_cached_tokens("b") == 4
    check_pool(mgr)


def test_every_groups_hits_are_touched_before_any_group_takes_fresh_blocks():
    # Invariant 8 across groups: x's blocks are the least recently freed, group 0's before
    # group 1's, so group 0's fresh blocks would evict group 1's hits if groups were served
    # one after the other (touch g0 hits, allocate g0, touch g1 hits, ...).
    mgr = _mgr([FullAttention(), SlidingWindow(window=64)], blocks=9, bs=2)
    x, y = [1, 2, 3, 4], [5, 6, 7, 8]
    for rid, prompt in (("x", x), ("y", y)):
        assert mgr.admit(rid, 4)
        mgr.allocate(rid, 4, prompt)
    x_tables, y_tables = mgr.block_table("x"), mgr.block_table("y")
    mgr.free("x")
    mgr.free("y")
    assert mgr.num_free_blocks == 8 and mgr.pool.num_free_blocks == 8
    assert mgr.admit("b", 8)
    prompt = [*x, 9, 9, 9, 9]
    assert mgr.blocks_needed("b", 8, prompt) == 8  # 2 revived hits + 2 fresh, per group
    mgr.allocate("b", 8, prompt)
    assert mgr.num_cached_tokens("b") == 4
    y_blocks = {b for t in y_tables for b in t}
    for table, x_table in zip(mgr.block_table("b"), x_tables, strict=True):
        assert table[:2] == x_table  # every group kept its hits
        assert set(table[2:]) <= y_blocks  # fresh blocks evicted y's, never a hit
    check_pool(mgr)


def test_block_hashes_are_the_request_chain_over_full_hash_blocks():
    from raykv.blocks.hashing import BlockHasher
    from raykv.layout import FullAttention, plan

    p = plan(
        {f"l{i}": FullAttention(num_kv_heads=1, head_dim=8) for i in range(2)},
        num_gpu_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=128,
        block_size=4,
    )
    m = BlockManager(p)
    tokens = list(range(10))
    assert m.admit("r", len(tokens))
    assert m.allocate("r", len(tokens), tokens) is not None
    expect = BlockHasher(4, 0).hash_blocks(tokens, end_block=2)
    assert m.block_hashes("r") == tuple(expect)

"""Issue 9: block accounting that disagreed with vLLM's KV cache manager, each cause as
its reproduction (asserting the right behaviour), plus the property it generalizes to."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raykv.blocks import BlockManager
from raykv.errors import InsufficientMemoryError, RequestTooLarge
from raykv.layout import ChunkedLocal, CrossAttention, FullAttention, Mamba, SlidingWindow, plan

from .helpers import check_pool, examples, make_plan

F = {"l": FullAttention(num_kv_heads=1, head_dim=1, dtype="float32")}
SW = {"l": SlidingWindow(num_kv_heads=1, head_dim=1, dtype="float32", window=8)}


def test_1_gate_credits_prefix_hits_held_by_running_requests():
    bm = BlockManager(
        plan(F, num_gpu_blocks=9, max_model_len=32, max_num_batched_tokens=32, block_size=4)
    )
    a = list(range(1, 25))
    bm.admit("a", 24, a)
    bm.allocate("a", 24, a)
    assert bm.cached_prefix([*a, 99]) == 24  # 6 blocks held by a, 2 free
    assert bm.admit("b", 25, [*a, 99])  # it needs ONE new block
    assert bm.prefix_hit("b") == 24
    assert bm.allocate("b", 25, [*a, 99]) is not None
    assert bm.num_free_blocks == 1
    check_pool(bm)
    # without the tokens there is nothing to credit: the gate counts the whole prompt
    assert not bm.admit("c", 25)


def test_2_a_step_that_does_not_fit_still_releases_blocks_out_of_the_window():
    bm = BlockManager(
        plan(SW, num_gpu_blocks=13, max_model_len=64, max_num_batched_tokens=32, block_size=4),
        enable_prefix_caching=False,
    )
    A, B, C = list(range(1, 49)), list(range(101, 125)), list(range(201, 213))
    assert bm.admit("A", 48, A)
    bm.allocate("A", 16, A)
    assert bm.admit("B", 24, B)
    bm.allocate("B", 24, B)
    head = bm.block_table("A")[0][:2]
    assert bm.allocate("A", 32, A) is None  # fine: it needs 8
    assert bm.block_table("A")[0][:2] == [0, 0]  # never readable again: released
    assert set(head) <= set(bm.pool.free_block_ids())
    assert bm.num_tokens("A") == 16  # and nothing else changed
    assert bm.admit("C", 12, C)  # vLLM runs C too
    assert bm.allocate("C", 12, C) is not None
    check_pool(bm)


def test_3_sizing_and_gate_count_the_in_flight_chunk_for_windowed_groups():
    with pytest.raises(InsufficientMemoryError):
        plan(SW, num_gpu_blocks=4, max_model_len=64, max_num_batched_tokens=64, block_size=4)
    # a hand-built plan the planner would refuse: the gate refuses the request up front
    p = make_plan(
        [SW["l"]], num_gpu_blocks=4, block_size=4, max_model_len=64, max_num_batched_tokens=64
    )
    with pytest.raises(RequestTooLarge):
        BlockManager(p).admit("r", 64, list(range(1, 65)))
    # 16-token chunks: the window's 7 tokens + 16, from anywhere in a block of 4: 7 blocks
    p = plan(SW, num_gpu_blocks=8, max_model_len=64, max_num_batched_tokens=16, block_size=4)
    assert p.admission_blocks(64) == (7,)
    bm, toks = BlockManager(p), list(range(1, 65))
    assert bm.admit("r", 64, toks)
    for done in range(16, 65, 16):
        assert bm.allocate("r", 16, toks[:done]) is not None
    with pytest.raises(InsufficientMemoryError):
        plan(SW, num_gpu_blocks=7, max_model_len=64, max_num_batched_tokens=16, block_size=4)


def test_4_a_duplicate_block_is_findable():
    bm = BlockManager(
        plan(F, num_gpu_blocks=9, max_model_len=32, max_num_batched_tokens=32, block_size=4)
    )
    A = list(range(1, 9))
    bm.admit("A", 8, A)
    bm.allocate("A", 8, A)
    B = A[:4]
    bm.admit("B", 4, B)
    bm.allocate("B", 4, B)
    for t in A[4:]:
        B = [*B, t]
        bm.allocate("B", 1, B)  # B now holds tokens 1..8
    bm.free("A")
    C = list(range(200, 224))
    bm.admit("C", 24, C)
    bm.allocate("C", 24, C)
    bm.free("C")
    assert bm.cached_prefix([*A, 99]) == 8  # B's copy of A's second block serves it
    check_pool(bm)


def test_5_blocks_leaving_the_window_together_are_freed_tail_first():
    bm = BlockManager(
        plan(SW, num_gpu_blocks=32, max_model_len=64, max_num_batched_tokens=32, block_size=4)
    )
    toks = list(range(1, 41))
    bm.admit("r", 40, toks)
    bm.allocate("r", 24, toks[:24])
    table = bm.block_table("r")[0]
    bm.allocate("r", 16, toks)  # computed 24: tokens 0..16 left the window, blocks 0..3
    assert bm.block_table("r")[0][:4] == [0] * 4
    assert bm.pool.free_block_ids()[-4:] == table[3::-1]  # the tail is evicted first
    # as free() does: the head of a prefix is evicted last
    held = bm.block_table("r")[0][4:]
    bm.free("r")
    assert bm.pool.free_block_ids()[-6:] == held[::-1]


# --- properties ---------------------------------------------------------------------------

KINDS = ("full", "sliding_window", "chunked_local", "mamba", "cross")


@st.composite
def layouts(draw):
    specs = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(KINDS))
        specs.append(
            {
                "full": lambda: FullAttention(num_kv_heads=1, head_dim=4),
                "sliding_window": lambda: SlidingWindow(
                    num_kv_heads=1, head_dim=4, window=draw(st.integers(1, 40))
                ),
                "chunked_local": lambda: ChunkedLocal(
                    num_kv_heads=1, head_dim=4, chunk=draw(st.integers(1, 40))
                ),
                "mamba": lambda: Mamba(state_shapes=((4, 4),)),
                "cross": lambda: CrossAttention(
                    num_kv_heads=1, head_dim=4, max_encoder_len=draw(st.integers(1, 40))
                ),
            }[kind]()
        )
    return specs


@settings(
    max_examples=examples(150, 20_000),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    specs=layouts(),
    bs=st.sampled_from([1, 2, 3, 4, 8]),
    max_len=st.integers(1, 120),
    max_batched=st.integers(1, 64),
    data=st.data(),
)
def test_an_accepted_plan_runs_every_admitted_request_alone_to_the_end(
    specs, bs, max_len, max_batched, data
):
    """Invariant 2: sizing, the gate and the step agree. On the smallest pool the plan
    accepts, any admitted request runs alone to its end in chunks of up to
    max_num_batched_tokens, also when an earlier request left its prefix cached."""
    probe = make_plan(specs, 1 << 20, bs, max_model_len=max_len, max_num_batched_tokens=max_batched)
    need = sum(probe.admission_blocks(max_len))
    p = make_plan(specs, need + 1, bs, max_model_len=max_len, max_num_batched_tokens=max_batched)
    bm = BlockManager(p)
    shared = data.draw(st.lists(st.integers(0, 3), max_size=max_len))
    for r in range(2):
        n = data.draw(st.integers(1, max_len), label="tokens")
        toks = (shared + [1000 * (r + 1) + i for i in range(max_len)])[:n]
        assert bm.num_free_blocks == p.usable_gpu_blocks
        assert bm.admit(r, n, toks)
        done = 0
        while done < n:
            if done == 0:
                first = bm.prefix_hit(r)
                step = first + data.draw(st.integers(1, min(max_batched, n - first)))
            else:
                step = data.draw(st.integers(1, min(max_batched, n - done)))
            assert bm.allocate(r, step, toks[: done + step]) is not None, (done, step)
            done += step
        check_pool(bm)
        bm.free(r)

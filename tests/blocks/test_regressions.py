"""Field bugs of issue 2, written as each scenario says."""

from __future__ import annotations

import pytest

from raykv.blocks import BlockManager
from raykv.errors import BlockSizeError, RequestTooLarge
from raykv.layout import FullAttention, Mamba, SlidingWindow, plan
from raykv.layout.presets import PRESETS

from .helpers import check_pool, make_plan


def _sliding_window_manager() -> BlockManager:
    p = make_plan(
        [SlidingWindow(window=8)], num_gpu_blocks=100, block_size=2, max_num_batched_tokens=16
    )
    # The scenario names an admission cap of 4 (= window / block size). A step holds the
    # 7 tokens before it and its chunk (up to 16), from anywhere in a block of 2, so the cap
    # that keeps invariant 2 (admitted => can always make progress) is cdiv(7 + 16 + 1, 2).
    assert p.admission_blocks(10_000) == (12,)
    return BlockManager(p)


def _step(mgr: BlockManager, rid: str, n: int, tokens: list[int] | None) -> int:
    predicted = mgr.blocks_needed(rid, n, tokens)
    before = mgr.pool.num_taken
    new = mgr.allocate(rid, n, tokens)
    assert new is not None
    assert mgr.pool.num_taken - before == predicted, "predicted != allocated"
    # one request, no prefix hits: the real blocks the step appended are the ones it took
    assert sum(1 for group in new for b in group if b) == predicted, "predicted != allocated"
    check_pool(mgr)
    return predicted


@pytest.mark.parametrize(
    "step_sizes, expected",
    [
        # new tokens per step 4, 8, 12, 16: the last steps need more than the cap of 4
        ((4, 8, 12, 16), [2, 4, 6, 8]),
        # request lengths 4, 8, 12, 16 (4 new tokens per step)
        ((4, 4, 4, 4), [2, 2, 2, 2]),
    ],
)
def test_sliding_window_predicted_equals_allocated(step_sizes, expected):
    mgr = _sliding_window_manager()
    assert mgr.admit("r", sum(step_sizes))
    tokens = list(range(sum(step_sizes)))
    got, done = [], 0
    for n in step_sizes:
        done += n
        got.append(_step(mgr, "r", n, tokens[:done]))
        table = mgr.block_table("r")[0]
        first_needed = max(0, done - 8 + 1)  # the next query reads tokens first_needed..
        assert len(table) == -(-done // 2)
        assert all(b == 0 for b in table[: max(0, done - n - 8 + 1) // 2])
        assert all(b != 0 for b in table[first_needed // 2 :])
    assert got == expected


def test_sliding_window_prompt_longer_than_pool_is_admitted():
    mgr = _sliding_window_manager()
    prompt = list(range(1000))  # 500 blocks of 2 tokens, the pool has 99
    assert mgr.admit("long", len(prompt), prompt)
    done = 0
    while done < len(prompt):  # chunked prefill, 16 tokens per step
        n = min(16, len(prompt) - done)
        done += n
        _step(mgr, "long", n, prompt[:done])
        assert mgr.pool.num_used_blocks <= (8 + 16) // 2 + 1
    for t in range(3):  # decode
        prompt.append(t)
        _step(mgr, "long", 1, prompt)
    mgr.free("long")
    assert mgr.num_free_blocks == 99


def test_full_attention_that_can_never_fit_is_refused_up_front():
    mgr = BlockManager(make_plan([FullAttention()], num_gpu_blocks=100, block_size=2))
    with pytest.raises(RequestTooLarge) as e:
        mgr.admit("huge", 1000)
    msg = str(e.value)
    for number in ("1000 tokens", "500 blocks", "99 usable", "block size 2", "198 tokens"):
        assert number in msg
    assert "huge" not in mgr
    # a hybrid with one full-attention group is refused too, even though its window fits
    hybrid = make_plan([SlidingWindow(window=8), FullAttention()], 100, 2)
    with pytest.raises(RequestTooLarge):
        BlockManager(hybrid).admit("huge", 1000)


def test_block_size_not_divisible_by_hash_block_size_names_both():
    bad = make_plan([FullAttention(), Mamba()], 50, 16, group_block_sizes=[24, 16])
    with pytest.raises(BlockSizeError) as e:
        BlockManager(bad)
    assert "24" in str(e.value) and "16" in str(e.value) and "align" in str(e.value)
    layers = {"attn": FullAttention(), "ssm": Mamba(state_shapes=((64, 4), (8, 16, 16)))}
    with pytest.raises(BlockSizeError) as e:
        plan(
            layers,
            num_gpu_blocks=50,
            max_model_len=256,
            max_num_batched_tokens=64,
            block_size=24,
            hash_block_size=16,
        )
    assert "24" in str(e.value) and "16" in str(e.value) and "align" in str(e.value)


def test_mamba_hybrid_pool_size_comes_from_the_plan():
    layers = {
        "attn0": FullAttention(num_kv_heads=2, head_dim=64),
        "attn1": FullAttention(num_kv_heads=4, head_dim=64),
        "ssm0": Mamba(state_shapes=((64, 4), (8, 16, 16))),
        "ssm1": Mamba(state_shapes=((64, 4), (8, 16, 16))),
    }
    p = plan(layers, gpu_bytes=1 << 24, max_model_len=256, max_num_batched_tokens=64)
    mgr = BlockManager(p)
    assert mgr.pool.num_blocks == p.num_gpu_blocks
    assert mgr.num_free_blocks == p.num_gpu_blocks - 1
    assert mgr.admit("r", 100)
    new = mgr.allocate("r", 100)
    kinds = [g.spec.kind for g in p.groups]
    assert len(new[kinds.index("mamba")]) == 1  # one state block per request


def test_kernel_block_size_64_under_block_size_128():
    layers = {f"l{i}": FullAttention(num_kv_heads=2, head_dim=64) for i in range(2)}
    p = plan(
        layers,
        num_gpu_blocks=40,
        max_model_len=2048,
        max_num_batched_tokens=512,
        block_size=128,
        kernel_block_sizes=[16, 32, 64],
    )
    (g,) = p.groups
    assert (g.block_size, g.kernel_block_size) == (128, 64)
    mgr = BlockManager(p)
    assert mgr.admit("r", 1000)
    new = mgr.allocate("r", 1000, list(range(1000)))
    logical = mgr.block_table("r")[0]
    assert new == [logical] and len(logical) == 8  # callers see logical ids only
    assert all(0 < b < p.num_gpu_blocks for b in logical)
    kernel = mgr.kernel_block_table("r", g.group_id)
    assert len(kernel) == 2 * len(logical)
    assert kernel == [k for b in logical for k in (2 * b, 2 * b + 1)]


def test_kernel_table_maps_null_slots_to_block_zero():
    p = make_plan([SlidingWindow(window=4)], 20, 4, kernel_block_sizes=[2])
    mgr = BlockManager(p)
    mgr.admit("r", 16)
    for _ in range(4):
        mgr.allocate("r", 4)
    logical = mgr.block_table("r")[0]
    assert logical[0] == 0
    assert mgr.kernel_block_table("r", 0)[:2] == [0, 1]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_plan_runs_through_the_block_manager(name):
    preset = PRESETS[name]
    p = plan(preset.layers(), gpu_bytes=80 << 30, max_model_len=preset.max_model_len,
             max_num_batched_tokens=2048)  # fmt: skip
    mgr = BlockManager(p)
    prompt = list(range(3000))
    for rid in ("a", "b"):  # the second one hits the first one's prefix where it can
        assert mgr.admit(rid, len(prompt))
        assert mgr.blocks_needed(rid, 3000, prompt) <= mgr.num_free_blocks
        assert mgr.allocate(rid, 3000, prompt) is not None
        assert mgr.allocate(rid, 1, [*prompt, 1]) is not None
    expect_hit = mgr.enable_prefix_caching
    assert (mgr.num_cached_tokens("b") > 0) == expect_hit
    check_pool(mgr)


@pytest.mark.parametrize("window, block_size", [(8, 2), (7, 2), (8, 4), (5, 3), (1, 2)])
def test_sliding_window_admitted_request_always_decodes_in_the_smallest_pool(window, block_size):
    """The admission cap is the most blocks any decode step holds: a pool of exactly
    cap + 1 (null) blocks admits the request and never refuses one of its decode steps."""
    spec = SlidingWindow(window=window)
    cap = spec.max_blocks(10_000, block_size, 1)

    def pool(n: int):
        return make_plan([spec], num_gpu_blocks=n, block_size=block_size, max_num_batched_tokens=1)

    mgr = BlockManager(pool(cap + 1))
    assert mgr.admit("r", 60)
    tokens = list(range(60))
    for done in range(1, 61):
        assert _step(mgr, "r", 1, tokens[:done]) <= 1, f"decode step {done} did not fit"
    # one block fewer and the same request is refused up front, never queued forever
    small = BlockManager(pool(cap))
    with pytest.raises(RequestTooLarge):
        small.admit("r", 60)


def test_kernel_ids_are_refused_where_logical_ids_are_expected():
    """Invariant 7 at run time: a kernel block table handed to an interface that takes
    logical ids is an error that says which is which, and changes nothing."""
    from raykv.errors import InvalidInput
    from raykv.layout import KernelBlockIds
    from raykv.tiers import StoreJob

    p = make_plan([FullAttention()], num_gpu_blocks=32, block_size=128, kernel_block_sizes=[64])
    mgr = BlockManager(p)
    assert mgr.admit("r", 256)
    assert mgr.allocate("r", 256, list(range(256))) is not None
    kernel = mgr.kernel_block_table("r", 0)
    assert isinstance(kernel, KernelBlockIds) and kernel.blocks_per_block == 2
    free_before = mgr.num_free_blocks
    with pytest.raises(InvalidInput, match=r"kernel block ids .*kernel_block_table"):
        mgr.hold_blocks(kernel)
    with pytest.raises(InvalidInput, match="kernel block ids"):
        StoreJob.build(p, "r", [kernel], [[b"h"] * len(kernel)])
    assert mgr.num_free_blocks == free_before
    mgr.hold_blocks(mgr.block_table("r")[0])  # the logical table is accepted
    assert mgr.num_free_blocks == free_before

"""Properties of plan(): invariants 2, 5, 6 and 11 over random layer mixes."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from raykv.blocks import BlockManager
from raykv.errors import (
    BlockSizeError,
    ConfigError,
    InsufficientMemoryError,
    PageSizeError,
    RequestTooLarge,
)
from raykv.layout import FullAttention, Mamba, SlidingWindow, cpu_tier_size, plan

from .strategies import layer_mixes

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

plan_args = st.fixed_dictionaries(
    {
        "gpu_bytes": st.builds(
            lambda e, jitter: (1 << e) + jitter, st.integers(10, 38), st.integers(0, 1 << 20)
        ),
        "max_model_len": st.integers(1, 16384),
        "max_num_batched_tokens": st.integers(1, 8192),
        "tp_size": st.sampled_from([1, 2, 4, 8]),
        "cpu_bytes": st.integers(0, 1 << 36),
        "block_size": st.sampled_from([1, 2, 16, 32]),
        "factor": st.integers(1, 4),
        "kernel_block_sizes": st.one_of(st.none(), st.just([1, 2, 16, 32, 64])),
        "hash_block_size": st.sampled_from([None, 1]),
    }
)


@FAST
@given(layers=layer_mixes(), args=plan_args)
def test_plan_sizes_from_real_bytes(layers, args):
    factor = args["factor"]
    a = {k: v for k, v in args.items() if k != "factor"}
    try:
        p = plan(layers, **a)
    except (InsufficientMemoryError, PageSizeError) as e:
        event(type(e).__name__)
        return  # covered by the tests below
    event("hybrid plan" if len(p.groups) > 1 else "uniform plan")
    p = plan(layers, **a, offload_block_size=p.block_size * factor)

    # Invariant 6: the block count is the plan's own arithmetic, and it fits the memory.
    assert p.gpu_bytes_per_block == sum(p.tensor_page_bytes)
    assert len(p.tensor_page_bytes) == p.num_tensors
    assert p.num_gpu_blocks == a["gpu_bytes"] // p.gpu_bytes_per_block
    assert p.num_gpu_blocks * p.gpu_bytes_per_block <= a["gpu_bytes"]
    # Every layer's page fits its tensor slot.
    for g in p.groups:
        for name, page in zip(g.layer_names, g.layer_page_bytes, strict=True):
            assert page <= p.tensor_page_bytes[p.tensor_of(name)]

    # Invariant 5: real tensor bytes / num_blocks x distinct copies x block_size_factor.
    copies = max(s.distinct_copies(a["tp_size"]) for s in layers.values())
    per_block = p.gpu_tensor_bytes // p.num_gpu_blocks * copies * factor
    assert p.block_size_factor == factor
    assert p.cpu_bytes_per_block == per_block
    assert p.cpu_num_blocks == a["cpu_bytes"] // per_block
    if all(s.kind == "mla" for s in layers.values()):
        assert p.distinct_copies == 1

    # Invariant 2: one max_model_len request fits, by the admission gate's own formula.
    need = p.admission_blocks(a["max_model_len"])
    m = a["max_num_batched_tokens"]
    assert need == tuple(g.spec.max_blocks(a["max_model_len"], g.block_size, m) for g in p.groups)
    assert sum(need) <= p.usable_gpu_blocks

    # Invariant 11: every group block size is a multiple of the hash block size; kernel
    # blocks divide it; Mamba is never split.
    for g in p.groups:
        assert g.block_size % p.hash_block_size == 0
        assert p.hash_block_size == (a["hash_block_size"] or a["block_size"])
        assert g.block_size % g.kernel_block_size == 0
        if g.spec.kind == "mamba":
            assert g.kernel_block_size == g.block_size
    assert sorted(n for g in p.groups for n in g.layer_names) == sorted(layers)


@FAST
@given(layers=layer_mixes(), args=plan_args)
def test_sizing_and_admission_share_one_formula(layers, args):
    """plan() accepts exactly the pools where one max_model_len request passes the gate."""
    a = {k: v for k, v in args.items() if k not in ("factor", "gpu_bytes")}
    try:
        probe = plan(layers, **a, num_gpu_blocks=1 << 40)
    except PageSizeError:
        return
    need = sum(probe.admission_blocks(a["max_model_len"]))
    fits = plan(layers, **a, num_gpu_blocks=need + 1)  # + the null block
    assert fits.usable_gpu_blocks == need
    # The block manager's gate agrees at the same boundary: admitted into the empty pool the
    # plan sized, refused up front (never queued) one block below it.
    assert BlockManager(fits).admit("r", a["max_model_len"])
    with pytest.raises(RequestTooLarge):
        BlockManager(dataclasses.replace(fits, num_gpu_blocks=need)).admit("r", a["max_model_len"])
    with pytest.raises(InsufficientMemoryError, match=str(a["max_model_len"])):
        plan(layers, **a, num_gpu_blocks=need)
    with pytest.raises(InsufficientMemoryError):
        plan(layers, **a, gpu_bytes=(need + 1) * fits.gpu_bytes_per_block - 1)


@FAST
@given(layers=layer_mixes(), tp=st.sampled_from([1, 2, 4, 8]), bs=st.sampled_from([1, 16, 32]))
def test_unified_pages_are_equal(layers, tp, bs):
    try:
        p = plan(
            layers,
            num_gpu_blocks=1 << 40,
            max_model_len=4096,
            max_num_batched_tokens=1,
            tp_size=tp,
            block_size=bs,
        )
    except PageSizeError as e:
        assert "page sizes" in str(e)
        return
    if len(p.groups) == 1:
        assert p.tensor_page_bytes == p.groups[0].layer_page_bytes  # one tensor per layer
        assert p.padding_waste == 0
        return
    page = p.tensor_page_bytes[0]
    assert set(p.tensor_page_bytes) == {page}
    assert max(len(g.layer_names) for g in p.groups) == p.num_tensors
    for g in p.groups:
        assert max(g.layer_page_bytes) <= page
        if g.spec.kind == "mamba":  # attention was raised until its page holds the state
            assert g.block_size == p.block_size
    attn = [g for g in p.groups if g.spec.kind != "mamba"]
    assert any(max(g.layer_page_bytes) == page for g in attn) or not attn
    assert 0 <= p.padding_waste < 1


def test_integer_ratio_raises_the_smaller_page():
    layers = {
        "a0": FullAttention(num_kv_heads=8, head_dim=128),
        "a1": FullAttention(num_kv_heads=8, head_dim=128),
        "s0": SlidingWindow(num_kv_heads=2, head_dim=128, window=512),
        "s1": SlidingWindow(num_kv_heads=2, head_dim=128, window=512),
    }
    p = plan(layers, gpu_bytes=1 << 30, max_model_len=4096, max_num_batched_tokens=512)
    full, sw = p.groups
    assert (full.block_size, sw.block_size) == (16, 64)  # 4x fewer heads -> 4x the tokens
    assert full.layer_page_bytes == sw.layer_page_bytes == (65536, 65536)
    assert p.padding_waste == 0
    # the window cap at the raised size: window - 1 + one 512-token chunk, from anywhere in
    # a block of 64 (invariant 2)
    assert sw.max_blocks(4096, 512) == -(-(511 + 512 + 63) // 64) == 17


def test_padding_is_reported_and_bounded():
    layers = {
        "a": FullAttention(num_kv_heads=3, head_dim=128),
        "s": SlidingWindow(num_kv_heads=2, head_dim=128, window=512),
    }
    p = plan(layers, gpu_bytes=1 << 30, max_model_len=4096, max_num_batched_tokens=512)
    assert [g.block_size for g in p.groups] == [16, 16]
    assert p.tensor_page_bytes == (24576,)  # 2 x 16 tokens x 3 heads x 128 x 2 bytes
    assert p.padding_waste == pytest.approx(1 / 6)  # 2 of 3 head slots used in one group
    with pytest.raises(PageSizeError, match=r"page sizes \[16384, 24576\]"):
        plan(
            layers,
            gpu_bytes=1 << 30,
            max_model_len=4096,
            max_num_batched_tokens=512,
            max_padding_waste=0.1,
        )


def test_insufficient_memory_names_numbers_and_fix():
    layers = {f"l{i}": FullAttention() for i in range(32)}
    with pytest.raises(InsufficientMemoryError) as e:
        plan(layers, gpu_bytes=1 << 30, max_model_len=131072, max_num_batched_tokens=8192)
    msg = str(e.value)
    for text in ("131072", "8192 blocks", "1073741824", "max_model_len to 8176", "tp_size"):
        assert text in msg
    # The suggested length really fits.
    plan(layers, gpu_bytes=1 << 30, max_model_len=8176, max_num_batched_tokens=8192)


@pytest.mark.parametrize(
    ("kwargs", "err", "text"),
    [
        ({"block_size": 24, "hash_block_size": 16}, BlockSizeError, "24"),
        ({"offload_block_size": 40}, BlockSizeError, "offload block size 40"),
        ({"kernel_block_sizes": [48, 64]}, BlockSizeError, "block size 16"),
        ({"tp_size": 3}, ConfigError, "tp_size=3"),
        ({"max_model_len": 0}, ConfigError, "max_model_len"),
    ],
)
def test_misconfiguration_names_the_numbers(kwargs, err, text):
    args = {"gpu_bytes": 1 << 30, "max_model_len": 1024, "max_num_batched_tokens": 64, **kwargs}
    with pytest.raises(err, match=text):
        plan({"l0": FullAttention()}, **args)


def test_kernel_block_sizes_per_layer_backend():
    sw = SlidingWindow(window=64)
    layers = {"f0": FullAttention(), "f1": FullAttention(), "s0": sw, "s1": sw}
    p = plan(
        layers,
        gpu_bytes=1 << 30,
        max_model_len=1024,
        max_num_batched_tokens=64,
        block_size=128,
        kernel_block_sizes={"f0": [16, 32, 64], "f1": [32, 64, 256], "s0": [16], "s1": [16, 32]},
    )
    assert [(g.spec.kind, g.kernel_block_size, g.kernel_blocks_per_block) for g in p.groups] == [
        ("full", 64, 2),
        ("sliding_window", 16, 8),
    ]


def test_cpu_tier_size_with_zero_gpu_blocks():
    assert cpu_tier_size(0, 0, 4, 2, 1 << 40) == (0, 0)
    assert cpu_tier_size(1000, 10, 4, 2, 8000) == (10, 800)


@pytest.mark.parametrize(
    ("kernel_sizes", "block", "kernel"),
    [(None, 48, 48), ([16], 48, 16), ([32, 64], 64, 64), ([64], 64, 64)],
)
def test_mamba_raise_keeps_attention_splittable_by_the_kernel(kernel_sizes, block, kernel):
    mamba = Mamba(state_shapes=((4096, 3), (4096, 16)))  # 155648 B > 65536 B of attention
    layers = {f"l{i}": mamba if i % 4 else FullAttention() for i in range(8)}
    p = plan(
        layers,
        gpu_bytes=1 << 32,
        max_model_len=8192,
        max_num_batched_tokens=8192,
        kernel_block_sizes=kernel_sizes,
    )
    attn = next(g for g in p.groups if g.spec.kind == "full")
    assert (attn.block_size, attn.kernel_block_size) == (block, kernel)
    assert all(g.block_size == block for g in p.groups)  # Mamba padded, never split
    assert p.tensor_page_bytes[0] == FullAttention().page_bytes(block) >= mamba.page_bytes(16)

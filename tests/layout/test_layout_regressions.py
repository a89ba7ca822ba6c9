"""Exact regressions of issue 2, items 2, 3 and 4 (plan part), written as the scenarios say."""

from __future__ import annotations

import pytest

from raykv.errors import BlockSizeError, InsufficientMemoryError
from raykv.layout import FullAttention, Mamba, cpu_tier_size, kernel_block_ids, plan
from raykv.tiers import GpuKV

GiB = 1 << 30


def test_tp4_uniform_group_with_different_head_sizes_sizes_cpu_from_real_bytes():
    head_dims = [64, 128, 256, 128]
    layers = {
        f"layers.{i}": FullAttention(num_kv_heads=8, head_dim=d) for i, d in enumerate(head_dims)
    }
    p = plan(
        layers,
        gpu_bytes=1 * GiB,
        cpu_bytes=64 * GiB,
        tp_size=4,
        block_size=16,
        offload_block_size=32,
        max_model_len=4096,
        max_num_batched_tokens=2048,
    )
    assert len(p.groups) == 1 and p.block_size_factor == 2
    # Real tensors: one per layer, num_blocks x (K+V x 16 tokens x 2 heads/rank x dim x 2 B).
    pages = [2 * 16 * 2 * d * 2 for d in head_dims]
    assert p.tensor_page_bytes == tuple(pages)
    real_tensor_bytes = sum(p.num_gpu_blocks * page for page in pages)
    assert p.num_gpu_blocks == GiB // sum(pages)
    # ... and those are the bytes GpuKV really allocates from this plan (meta: no memory).
    kv = GpuKV.allocate(p, "meta")
    tensors = kv.entries(0)  # one tensor per layer: a uniform-type group shares none
    assert len(tensors) == len(head_dims)
    assert sum(t.nbytes for t in tensors) == real_tensor_bytes
    assert kv.total_bytes == real_tensor_bytes
    expected = 64 * GiB // (real_tensor_bytes // p.num_gpu_blocks * 4 * 2)
    assert p.cpu_num_blocks == expected
    assert p.cpu_bytes_per_block == sum(pages) * 4 * 2
    # The field bug: the largest page size times the tensor count over-counts the bytes.
    buggy = 64 * GiB // (max(pages) * p.num_tensors * 4 * 2)
    assert buggy != expected


def test_zero_gpu_blocks_gives_zero_cpu_blocks_without_division_error():
    assert cpu_tier_size(
        gpu_tensor_bytes=0,
        num_gpu_blocks=0,
        distinct_copies=4,
        block_size_factor=2,
        cpu_bytes=64 * GiB,
    ) == (0, 0)
    layers = {"a": FullAttention(head_dim=64), "b": FullAttention(head_dim=128)}
    for kwargs in ({"gpu_bytes": 0}, {"num_gpu_blocks": 0}, {"gpu_bytes": 1000}):
        with pytest.raises(InsufficientMemoryError, match="0 usable blocks"):
            plan(
                layers,
                **kwargs,
                cpu_bytes=64 * GiB,
                tp_size=4,
                max_model_len=16,
                max_num_batched_tokens=16,
            )


def _mamba_hybrid() -> dict:
    layers = {}
    for i in range(8):
        if i % 4 == 3:  # attention layers with two head sizes
            layers[f"layers.{i}.attn"] = FullAttention(num_kv_heads=8, head_dim=64 + 64 * (i > 4))
        else:  # Mamba layers with two state sizes
            layers[f"layers.{i}.mamba"] = Mamba(
                state_shapes=((4096, 3), (4096, 16 if i < 4 else 32))
            )
    return layers


def test_mamba_hybrid_num_blocks_comes_from_the_plan():
    layers = _mamba_hybrid()
    p = plan(layers, gpu_bytes=4 * GiB, max_model_len=8192, max_num_batched_tokens=2048)
    mamba_pages = {s.page_bytes(16) for s in layers.values() if s.kind == "mamba"}
    attn_pages = {s.page_bytes(16) for s in layers.values() if s.kind == "full"}
    assert len(mamba_pages) == 2 and len(attn_pages) == 2  # really different per-layer pages
    # Attention block size raised (multiple of the hash block) until its page holds Mamba.
    page = p.tensor_page_bytes[0]
    assert set(p.tensor_page_bytes) == {page} and page >= max(mamba_pages)
    assert all(g.block_size == p.block_size and g.block_size % 16 == 0 for g in p.groups)
    # The block count is the plan's: memory // real bytes of one block over all tensors ...
    assert p.gpu_bytes_per_block == p.num_tensors * page
    assert p.num_gpu_blocks == 4 * GiB // p.gpu_bytes_per_block
    # ... not what one tensor's or one layer's shape would give.
    assert p.num_gpu_blocks not in {4 * GiB // page, 4 * GiB // max(mamba_pages)}
    assert p.num_gpu_blocks not in {4 * GiB // (len(layers) * x) for x in mamba_pages | attn_pages}
    # The tensors built from the plan keep the plan's count; a count read back from a shared
    # tensor's bytes over a layer's own (smaller, padded) page would not.
    kv = GpuKV.allocate(p, "meta")
    assert kv.num_blocks == p.num_gpu_blocks
    assert kv.total_bytes == p.num_gpu_blocks * p.gpu_bytes_per_block
    shared = kv.entries(p.groups[0].group_id)[0]
    assert shared.nbytes // min(mamba_pages) != p.num_gpu_blocks


def test_block_size_not_divisible_by_hash_block_size_names_both_and_says_align():
    with pytest.raises(BlockSizeError) as e:
        plan(
            _mamba_hybrid(),
            gpu_bytes=4 * GiB,
            max_model_len=8192,
            max_num_batched_tokens=2048,
            block_size=24,
            hash_block_size=16,
        )
    msg = str(e.value)
    assert "24" in msg and "16" in msg and "align" in msg


def test_block_128_kernel_64_maps_b_to_2b_and_2b_plus_1():
    p = plan(
        {"l": FullAttention()},
        gpu_bytes=GiB,
        max_model_len=4096,
        max_num_batched_tokens=512,
        block_size=128,
        kernel_block_sizes=[16, 32, 64],
    )
    (g,) = p.groups
    assert (g.block_size, g.kernel_block_size, g.kernel_blocks_per_block) == (128, 64, 2)
    logical = [5, 0, 9]
    assert kernel_block_ids(logical, g.kernel_blocks_per_block) == [10, 11, 0, 1, 18, 19]

"""GpuKV: allocation matches the plan byte for byte; register validates engine tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.errors import InvalidInput
from raykv.layout.specs import Mamba
from raykv.tiers import GpuKV
from raykv.tiers.gpu_kv import kernel_shape, layer_spec, torch_dtype

from .helpers import MODELS, make_plan


@settings(max_examples=40, deadline=None)
@given(
    model=st.sampled_from(MODELS),
    block_size=st.sampled_from([4, 8]),
    kernel=st.sampled_from([None, 2, 4]),
    num_gpu_blocks=st.integers(40, 80),
)
def test_total_bytes_equal_plan(model, block_size, kernel, num_gpu_blocks):
    p = make_plan(model, block_size=block_size, kernel=kernel, num_gpu_blocks=num_gpu_blocks)
    kv = GpuKV.allocate(p)
    assert kv.total_bytes == p.num_gpu_blocks * p.gpu_bytes_per_block
    assert kv.num_blocks == p.num_gpu_blocks
    for g in p.groups:
        assert kv.row_bytes(g.group_id) <= p.gpu_bytes_per_block
        for name in g.layer_names:
            views = kv.kernel_view(name)
            views = views if isinstance(views, tuple) else (views,)
            shapes = kernel_shape(p, g, layer_spec(p, g, name))
            assert tuple(tuple(v.shape) for v in views) == shapes


@settings(max_examples=25, deadline=None)
@given(model=st.sampled_from(MODELS), kernel=st.sampled_from([None, 2]), data=st.data())
def test_kernel_view_of_a_logical_block_lands_in_its_row(model, kernel, data):
    """Writing kernel blocks b*k..b*k+k-1 of any layer touches row b only (invariant 7)."""
    p = make_plan(model, block_size=4, kernel=kernel)
    kv = GpuKV.allocate(p)
    g = data.draw(st.sampled_from(p.groups))
    name = data.draw(st.sampled_from(g.layer_names))
    b = data.draw(st.integers(1, p.num_gpu_blocks - 1))
    k = g.kernel_blocks_per_block
    views = kv.kernel_view(name)
    if isinstance(views, tuple):  # Mamba states: dim 0 is the block
        for v in views:
            v[b] = 1
    elif views.dim() == 5:  # attention [2, kernel blocks, ...]
        views[:, b * k : (b + 1) * k] = 1
    else:  # MLA
        views[b * k : (b + 1) * k] = 1
    for gg in p.groups:
        for e in kv.entries(gg.group_id):
            nonzero = e.view(torch.uint8).reshape(e.shape[0], -1).any(dim=1).nonzero().flatten()
            assert set(nonzero.tolist()) <= {b}


def test_hybrid_layers_share_one_tensor():
    p = make_plan("mamba_hybrid")
    kv = GpuKV.allocate(p)
    assert len(p.groups) > 1 and p.num_tensors < sum(len(g.layer_names) for g in p.groups)
    first = [kv.entries(g.group_id)[0] for g in p.groups]
    assert len({e.data_ptr() for e in first}) == 1  # a block id belongs to one group at a time
    mamba = next(g for g in p.groups if isinstance(g.spec, Mamba))
    states = kv.kernel_view(mamba.layer_names[0])
    assert [tuple(s.shape[1:]) for s in states] == [(8, 3), (2, 4, 8)]


def engine_tensors(p, device="cpu"):
    """What an engine would hand us: K/V-outermost contiguous attention caches."""
    out = {}
    for g in p.groups:
        for name in g.layer_names:
            spec = layer_spec(p, g, name)
            shapes = kernel_shape(p, g, spec)
            ts = tuple(torch.zeros(s, dtype=torch_dtype(spec.dtype), device=device) for s in shapes)
            out[name] = ts if isinstance(spec, Mamba) else ts[0]
    return out


@pytest.mark.parametrize("model", ["full", "mla", "sliding", "mixed_heads"])
@pytest.mark.parametrize("kernel", [None, 2])
def test_register_adopts_engine_tensors(model, kernel):
    p = make_plan(model, kernel=kernel)
    tensors = engine_tensors(p)
    kv = GpuKV.register(p, tensors)
    assert kv.num_blocks == p.num_gpu_blocks
    for g in p.groups:
        assert kv.row_bytes(g.group_id) == sum(g.layer_page_bytes)
        for e in kv.entries(g.group_id):
            assert e.shape[0] == p.num_gpu_blocks
    name = p.groups[0].layer_names[0]
    assert kv.kernel_view(name) is tensors[name]


def test_register_mamba_states():
    p = make_plan("mamba_hybrid")
    kv = GpuKV.register(p, engine_tensors(p))
    assert kv.row_bytes(p.groups[-1].group_id) <= p.gpu_bytes_per_block


def _one(p):
    return p.groups[0].layer_names[0]


def test_register_wrong_dtype():
    p = make_plan("full")
    t = engine_tensors(p)
    t[_one(p)] = t[_one(p)].float()
    with pytest.raises(InvalidInput, match=r"dtype expected torch.bfloat16, got torch.float32"):
        GpuKV.register(p, t)


def test_register_wrong_block_count_names_the_plan():
    p = make_plan("full", num_gpu_blocks=64)
    t = engine_tensors(p)
    bad = list(t[_one(p)].shape)
    bad[1] = 50
    t[_one(p)] = torch.zeros(bad, dtype=torch.bfloat16)
    with pytest.raises(InvalidInput, match=r"50 blocks but the plan has num_gpu_blocks=64"):
        GpuKV.register(p, t)


def test_register_wrong_shape():
    p = make_plan("full")
    t = engine_tensors(p)
    shape = tuple(t[_one(p)].shape)
    t[_one(p)] = torch.zeros((*shape[:-1], shape[-1] * 2), dtype=torch.bfloat16)
    with pytest.raises(InvalidInput, match=rf"shape expected \({shape[0]}, {shape[1]}"):
        GpuKV.register(p, t)


def test_register_missing_and_extra_layers():
    p = make_plan("full")
    t = engine_tensors(p)
    t["ghost"] = t.pop(_one(p))
    with pytest.raises(InvalidInput, match=r"missing \['a0'\], unexpected \['ghost'\]"):
        GpuKV.register(p, t)


def test_register_mamba_state_count():
    p = make_plan("mamba_hybrid")
    t = engine_tensors(p)
    name = p.groups[-1].layer_names[0]
    t[name] = t[name][:1]
    with pytest.raises(InvalidInput, match=r"expected 2 tensor\(s\), got 1"):
        GpuKV.register(p, t)


def test_register_mixed_devices():
    p = make_plan("full")
    t = engine_tensors(p)
    t[_one(p)] = t[_one(p)].to("meta")
    with pytest.raises(InvalidInput, match="several devices"):
        GpuKV.register(p, t)


def test_register_rejects_non_contiguous_blocks():
    p = make_plan("full")
    t = engine_tensors(p)
    t[_one(p)] = t[_one(p)].transpose(3, 4).contiguous().transpose(3, 4)  # heads/dim swapped
    with pytest.raises(InvalidInput, match="contiguous"):
        GpuKV.register(p, t)

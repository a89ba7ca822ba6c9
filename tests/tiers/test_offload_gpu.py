"""The same store / load protocol on a CUDA device: side stream, events, pinned arena."""

from __future__ import annotations

import random

import pytest
import torch

from raykv.tiers import CpuTier, GpuKV, LoadJob, OffloadEngine, StoreJob, group_factor

from .helpers import fill_random, make_plan, random_tables, row

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("model", ["full", "mla", "uneven_hybrid", "mamba_hybrid"])
@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize("checksums", [False, True])
def test_store_then_load_on_cuda(model, factor, checksums):
    p = make_plan(model, factor=factor, kernel=2, num_gpu_blocks=256, cpu_blocks=64)
    kv = GpuKV.allocate(p, "cuda")
    fill_random(kv)
    tier = CpuTier(p)
    assert tier.arena.is_pinned()
    eng = OffloadEngine(kv, tier, checksums=checksums)
    rng = random.Random(factor)
    ids = rng.sample(range(1, p.num_gpu_blocks), p.num_gpu_blocks - 1)
    nulls = [1 if g.group_id else 0 for g in p.groups]
    tables, hashes = random_tables(p, rng, ids, 4, nulls)
    store = StoreJob.build(p, "r", tables, hashes)
    assert eng.submit_store(store) is not None
    assert eng.fence.fenced_blocks() == set(store.block_ids)
    (res,) = eng.wait_all()
    assert res.ok, res.error
    assert not eng.fence.fenced_blocks()
    dst = [[0 if b == 0 else ids.pop() for b in t] for t in tables]
    load = LoadJob.build(p, "r2", dst, hashes)
    assert eng.submit_load(load) is not None
    eng.join()
    (res,) = eng.wait_all()
    assert res.ok and res.missed == ()
    torch.cuda.synchronize()
    for g, ts, td in zip(p.groups, tables, dst, strict=True):
        f = group_factor(p, g)
        for s, d in zip(ts, td, strict=True):
            if s and len(ts) >= f:
                assert row(kv, g.group_id, d) == row(kv, g.group_id, s)
    tier.check_consistency()

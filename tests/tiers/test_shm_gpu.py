"""GPU halves of the engine-sharing path: the shared arena is page-locked for CUDA copies,
and a CUDA pool's KV tensors open in another process through CUDA IPC."""

import subprocess
import sys

import pytest
import torch

from raykv.tiers import CpuTier, GpuKV, shm

from .helpers import make_plan

pytestmark = pytest.mark.gpu


def test_the_shared_arena_is_pinned_for_cuda_copies() -> None:
    plan = make_plan("full", cpu_blocks=16)
    tier = CpuTier(plan, shared=True)
    assert tier.arena.is_pinned()
    other = shm.attach(tier.arena_spec)
    assert other.is_pinned()
    src = torch.randint(0, 256, tier.rows(0).shape, dtype=torch.uint8, device="cuda")
    tier.rows(0).copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(other[0].cuda(), src)
    shm.release(tier.arena_spec)


def test_a_cuda_pool_kv_opens_in_another_process_by_ipc() -> None:
    plan = make_plan("full")
    kv = GpuKV.allocate(plan, "cuda")
    kv.raw[0].fill_(7)
    torch.cuda.synchronize()
    import pickle

    handles = pickle.dumps(kv.share_handles())
    code = (
        "import pickle, sys, torch; from raykv.tiers import GpuKV\n"
        "from tests.tiers.helpers import make_plan\n"
        "kv = GpuKV.open_handles(make_plan('full'), pickle.loads(sys.stdin.buffer.read()))\n"
        "assert int(kv.raw[0].min()) == 7; kv.raw[0][1].fill_(9); torch.cuda.synchronize()\n"
    )
    subprocess.run([sys.executable, "-c", code], input=handles, check=True)
    assert int(kv.raw[0][1].max()) == 9


def test_a_pinned_mapping_outlives_its_views_until_detached() -> None:
    """A page-locked mapping unmapped while still registered made the next registration of
    that range fail ("resource already mapped") and torch's next CUDA call report it: an
    engine's view of one tier's arena, dropped, then another arena attached (the bench's
    CPU-engine part, then its CUDA-engine part). Mappings stay until ``detach``."""
    import gc

    from raykv.tiers import CpuTierView

    plan = make_plan("full", cpu_blocks=64)
    for _ in range(3):
        tier = CpuTier(plan, shared=True)
        view = CpuTierView(plan, tier.arena_spec)
        assert view.arena.is_pinned() and view.arena.data_ptr() == tier.arena.data_ptr()
        del view
        gc.collect()
        assert torch.zeros(4, device="cuda").sum().item() == 0  # no error left behind
        CpuTierView(plan, tier.arena_spec).close()
        shm.release(tier.arena_spec)
        assert torch.ones(4, device="cuda").sum().item() == 4

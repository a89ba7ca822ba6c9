"""A GPU pool (num_gpus=1, KV in HBM) on a one-node local Ray: store, read, load back."""

import os

import pytest
import torch

from raykv.layout import FullAttention

pytestmark = [pytest.mark.gpu, pytest.mark.ray]
LAYERS = {f"l{i}": FullAttention(dtype="bfloat16", num_kv_heads=8, head_dim=128) for i in range(4)}


@pytest.fixture
def kv():
    """A raykv client of a one-node, one-GPU local Ray of this test's own."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    import raykv

    ray.init(num_cpus=2, num_gpus=1, _node_ip_address="127.0.0.1", include_dashboard=False)
    try:
        yield raykv.connect()
    finally:
        ray.shutdown()


def test_gpu_pool_round_trip(kv) -> None:
    plan = kv.add_model("g", LAYERS, max_model_len=1024, pool_bytes=128 << 20, cpu_bytes=64 << 20)
    pools = [m for m in kv.stats()["members"] if m["kind"] == "pool"]
    assert [p["device"] for p in pools] == ["cuda"]
    ids = list(range(1, 330))
    assert kv.admit("r", len(ids), ids)
    table = kv.allocate("r", len(ids), ids)[0]
    data = torch.randint(0, 256, (20, plan.gpu_bytes_per_block), dtype=torch.uint8)
    assert kv.store("r", table[:20], data) == 20
    assert torch.equal(kv.read(table[:20]), data)
    shared = kv.pool_kv()  # the pool's HBM, opened here by CUDA IPC: the same bytes
    from raykv import ops

    assert shared.raw[0].is_cuda
    gid = plan.groups[0].group_id
    here = torch.empty((20, plan.gpu_bytes_per_block), dtype=torch.uint8, device="cuda")
    ops.gather_blocks(shared.entries(gid), torch.tensor(table[:20]), here)
    assert torch.equal(here.cpu(), data)
    del shared  # before the pool's process ends (CUDA IPC: the producer outlives users)
    kv.free("r")
    assert kv.lookup(ids).hit_tokens == 320
    assert kv.admit("r2", len(ids), ids)
    t2 = kv.allocate("r2", len(ids), ids)[0]
    assert kv.load("r2", ids, into=[]).num_tokens == 320  # local GPU prefix hits
    assert torch.equal(kv.read(t2[:20]), data)


def test_an_engines_model_takes_no_gpu_and_its_cuda_kv_round_trips(kv) -> None:
    """vLLM's connector serves its model without pools: on a one-GPU node a GPU actor in a
    Serve replica's place (num_gpus=1) still starts, and its own CUDA KV goes through the
    node's tier and comes back byte for byte (checksums on the way)."""
    import ray

    kv.add_model("engine", LAYERS, max_model_len=1024, cpu_bytes=64 << 20, pools=False)
    assert not [m for m in kv.stats()["members"] if m["kind"] == "pool"]

    @ray.remote(num_gpus=1, num_cpus=0)
    def replica() -> bool:
        import raykv as rkv

        eng = rkv.connect().attach(num_blocks=40, device="cuda")
        block = eng.plan.groups[0].block_size
        prompt = list(range(3, 3 + 16 * block + 1))
        for t in eng.kv.raw:
            t.random_(0, 100)
        before = [t[1:17].clone() for t in eng.kv.raw]  # block-major rows
        eng.store_from(prompt, list(range(1, 17)))
        got = eng.load_into(prompt, list(range(21, 37)))
        same = all(torch.equal(t[21:37], b) for t, b in zip(eng.kv.raw, before, strict=True))
        return got == 16 * block and same

    assert ray.get(replica.remote(), timeout=120)

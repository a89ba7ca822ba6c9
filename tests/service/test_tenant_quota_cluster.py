"""Tenant quotas end to end (invariant 13): an attached engine's stores through the node agent
are charged to their tenant; a tenant over its quota stores a prefix and evicts only its own
entries, never another tenant's. One Ray node, the quota in the environment the tier reads."""

import time

import pytest
import ray
from kvdata import ROW  # one CPU-tier entry's bytes

from raykv.bench.chaos import environment
from raykv.blocks.hashing import tenant_key, tenant_label
from raykv.layout import FullAttention
from raykv.service.served import NAMESPACE, tier_name
from raykv.tiers.quotas import QUOTAS_ENV, parse_tenant_quotas

RAY_WORKERS = 0
BS = 16
LAYERS = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)}
A, B = tenant_key("tenant-a"), tenant_key("tenant-b")


@pytest.fixture(scope="module")
def svc(request):
    """The module's cluster, its tier started with tenant a's quota of 3 entries."""
    quotas = parse_tenant_quotas([f"tenant-a={3 * ROW}"]).to_env()
    with environment({QUOTAS_ENV: quotas}):  # the raylet, and so the tier, inherit it
        yield request.getfixturevalue("ray_cluster")


def tier_stats(svc) -> dict:
    tier = ray.get_actor(tier_name(svc.head), namespace=NAMESPACE)
    return ray.get(tier.snapshot.remote())["stats"]


def test_a_tenant_over_its_quota_stores_a_prefix_and_evicts_only_its_own(svc) -> None:
    kv = svc.kv
    plan = kv.add_model("quota", LAYERS, max_model_len=512, pool_bytes=40 * ROW,
                        cpu_bytes=8 * ROW)  # fmt: skip
    assert plan.cpu_num_blocks == 8 and plan.cpu_bytes_per_block == ROW
    eng = kv.on(svc.head).attach(num_blocks=64)
    blocks = list(range(1, 7))
    b_ids, a_ids, a_more = (list(range(s, s + 6 * BS)) for s in (1000, 2000, 3000))
    assert eng.store_from(b_ids[: 4 * BS], blocks[:4], B) == 4  # b has no quota
    assert eng.store_from(a_ids, blocks, A) == 3  # a's quota: the first 3 entries
    assert eng.store_from(a_more, blocks, A) == 3  # its own 3 old ones made room
    held = tier_stats(svc)["per_model"]["quota"]["tenant_bytes"]
    assert held == {tenant_label(A): 3 * ROW, tenant_label(B): 4 * ROW}  # b's all still here
    lease = eng.lease(b_ids[: 4 * BS], [4], [0], B)  # b's prompt: a hit of all 4
    assert len(lease.leases[0].keys) == 4
    deadline = time.monotonic() + 10  # bytes held reach the tenants' counts with a sweep
    while (s := tier_stats(svc))["tenants"].get(tenant_label(A), {}).get("bytes_held") != (
        3 * ROW
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    a = s["tenants"][tenant_label(A)]
    assert (a["bytes_held"], a["quota_refused"], a["quota_evicted"]) == (3 * ROW, 6, 3)
    assert s["tenant_quotas"] == {tenant_label(A): 3 * ROW}
    assert eng.close() == 1  # the lease, released on detach

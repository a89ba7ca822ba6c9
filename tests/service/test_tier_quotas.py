"""The node's tier actor applies ``RAYKV_TENANT_QUOTAS`` to the stores of each tenant
(invariant 13) and reports each tenant's bytes and quota. In-process, no Ray cluster."""

from __future__ import annotations

import asyncio

import pytest
import ray

from raykv.blocks.hashing import tenant_key, tenant_label
from raykv.layout import FullAttention
from raykv.service.member import Membership
from raykv.service.served import ServedModel
from raykv.service.tier.actor import CpuTierActor
from raykv.tiers.quotas import QUOTAS_ENV

BS, ROW = 16, 2 * 16 * 1 * 16 * 4
LAYERS = {"l0": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16)}


KEYS = [bytes(4) + i.to_bytes(32, "little") for i in range(1, 13)]


@pytest.fixture
def run(monkeypatch):
    """The tier actor runs in this process (its publishes answer at once, no Ray actor is
    looked up); yields ``run``, which runs a coroutine on an event loop of the test's own."""

    async def published(*args):
        return True

    monkeypatch.setattr(Membership, "call", lambda self, *a: published())
    monkeypatch.setattr(ray, "get_actor", lambda *a, **k: None)
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


def _tier_actor(cpu_rows: int) -> tuple[CpuTierActor, ServedModel]:
    """A tier actor (its settings from the environment now) serving model "m", whose CPU
    tier holds ``cpu_rows`` entries."""
    model = ServedModel("m", LAYERS, max_model_len=14 * BS, pool_bytes=16 * ROW,
                        cpu_bytes=cpu_rows * ROW)  # fmt: skip
    return CpuTierActor("this-node", {model.name: model.plan(16 * ROW)}), model


def _store_one(t, run, model: str, key: bytes, tenant: bytes) -> None:
    """Store one entry of ``tenant`` in tier actor ``t`` (``run``: its event loop's)."""
    _, res = run(t.reserve(model, (key,), None, 1, "me", tenant))
    run(t.apply(model, [("finish_store", res, True, None, None, 0)], False))


def test_the_tier_actor_charges_stores_to_their_tenant_and_reports_quotas(monkeypatch, run) -> None:
    monkeypatch.setenv(QUOTAS_ENV, f"tenant-a={2 * ROW},default={8 * ROW}")
    t, model = _tier_actor(16)
    a, b = tenant_key("tenant-a"), tenant_key("tenant-b")
    _, res = run(t.reserve(model.name, tuple(KEYS[:3]), None, 1, "me", a))
    assert res.keys == tuple(KEYS[:2])  # a's quota: two entries; the third left out
    run(t.apply(model.name, [("finish_store", res, True, None, None, 0)], False))
    _, res = run(t.reserve(model.name, tuple(KEYS[3:5]), None, 1, "me", b))
    run(t.apply(model.name, [("finish_store", res, True, None, None, 0)], False))
    _, res = run(t.reserve(model.name, (KEYS[5],), None, 1, "me", a))
    assert res.keys == (KEYS[5],)  # a's oldest entry made room, not b's
    run(t.apply(model.name, [("finish_store", res, True, None, None, 0)], False))
    mt = t.tiers[model.name]
    assert KEYS[0] not in mt.where and KEYS[3] in mt.where and KEYS[4] in mt.where
    t.sweep()
    s = t.stats()
    la, lb = tenant_label(a), tenant_label(b)
    assert s["tenant_quotas"] == {"default": 8 * ROW, la: 2 * ROW}
    assert s["per_model"]["m"]["tenant_bytes"] == {la: 2 * ROW, lb: 2 * ROW}
    assert s["tenants"][la] == {"bytes_held": 2 * ROW, "quota_refused": 1,
                                "quota_evicted": 1}  # fmt: skip
    assert s["tenants"][lb] == {"bytes_held": 2 * ROW}


def test_the_tier_actor_hands_tenants_to_the_disk_tier_and_applies_its_quotas(
    monkeypatch, tmp_path, run
) -> None:
    """With ``RAYKV_DISK_TENANT_QUOTAS`` the arena's evictions reach the disk tier with
    their tenant: over its disk quota a tenant's own oldest disk entries go, never another
    tenant's; bytes and counts per tenant are in the disk tier's stats and, each sweep, in
    the metrics' per-tenant counts."""
    from raykv.service.tier.actor import DISK_BYTES_ENV, DISK_PATH_ENV
    from raykv.tiers.quotas import DISK_QUOTAS_ENV

    a, b = tenant_key("tenant-a"), tenant_key("tenant-b")
    la, lb = tenant_label(a), tenant_label(b)
    stride = 4096  # a disk slot: an entry's row, rounded up to 4 KiB
    monkeypatch.setenv(DISK_PATH_ENV, str(tmp_path))
    monkeypatch.setenv(DISK_BYTES_ENV, str(64 << 20))
    monkeypatch.setenv(DISK_QUOTAS_ENV, f"{la}={2 * stride}")
    t, model = _tier_actor(4)
    try:
        mt = t.tiers[model.name]
        assert mt.tier.num_blocks == 4 and mt.disk.stride == stride

        def store(key: bytes, tenant: bytes) -> None:
            _store_one(t, run, model.name, key, tenant)

        for k in KEYS[:4]:
            store(k, a)
        for k in KEYS[4:8]:  # evict a's four, one at a time: a keeps its newest two on disk
            store(k, b)
        for k in KEYS[8:]:  # evict b's four: b has no disk quota, a's entries stay
            store(k, a)
        assert mt.disk.flush(10)
        assert sorted(mt.disk.keys()) == sorted([KEYS[2], KEYS[3], *KEYS[4:8]])
        t.sweep()
        s = t.stats()
        d = s["per_model"]["m"]["disk"]
        assert s["disk_tenant_quotas"] == {la: 2 * stride} and s["tenant_quotas"] == {}
        assert d["tenant_bytes"] == {la: 2 * stride, lb: 4 * stride}
        assert d["quota_counts"] == {la: [0, 2]}
        assert (d["quota_refused"], d["quota_evicted"]) == (0, 2)
        assert s["tenants"][la] == {"bytes_held": 4 * ROW, "disk_bytes_held": 2 * stride,
                                    "disk_quota_evicted": 2}  # fmt: skip
        assert s["tenants"][lb] == {"disk_bytes_held": 4 * stride}
        t.sweep()  # counted once: a sweep adds what changed since the last
        assert t.stats()["tenants"][la]["disk_quota_evicted"] == 2
    finally:
        for mt in t.tiers.values():
            mt.disk.close()


def test_the_tier_actor_hands_tenants_to_the_object_tier_and_applies_its_quotas(
    monkeypatch, run
) -> None:
    """With ``RAYKV_OBJECT_TENANT_QUOTAS`` (and an object tier, no disk tier) the arena's
    evictions reach the bucket with their tenant: over its object quota a tenant's own
    oldest objects are deleted, never another tenant's; bytes in the bucket and counts per
    tenant are in the object tier's stats and, after a sweep, in the tenants' tallies."""
    pytest.importorskip("boto3")
    pytest.importorskip("moto")
    from raykv.bench.tiers import DUMMY_CREDENTIALS, local_s3
    from raykv.service.tier.actor import OBJECT_ENDPOINT_ENV, OBJECT_URL_ENV
    from raykv.tiers.quotas import OBJECT_QUOTAS_ENV

    a, b = tenant_key("tenant-a"), tenant_key("tenant-b")
    la, lb = tenant_label(a), tenant_label(b)
    one = 2 * 4096  # an object of one entry: a header page and a row rounded up to 4 KiB
    with local_s3("raykv-quotas") as endpoint:
        for name, value in {OBJECT_URL_ENV: "s3://raykv-quotas/q", OBJECT_ENDPOINT_ENV: endpoint,
                            OBJECT_QUOTAS_ENV: f"{la}={2 * one}",
                            **DUMMY_CREDENTIALS}.items():  # fmt: skip
            monkeypatch.setenv(name, value)
        t, model = _tier_actor(4)
        try:
            mt = t.tiers[model.name]
            assert mt.disk is None and mt.objects.stride == 4096

            def store(key: bytes, tenant: bytes) -> None:
                _store_one(t, run, model.name, key, tenant)

            for k in KEYS[:4]:
                store(k, a)
            for k in KEYS[4:8]:  # evict a's four, an object each: a keeps two in the bucket
                store(k, b)
                assert mt.objects.flush(30)
            for k in KEYS[8:]:  # evict b's four: b has no object quota, a's objects stay
                store(k, a)
            assert mt.objects.flush(30)
            assert sorted(mt.objects.keys()) == sorted([KEYS[2], KEYS[3], *KEYS[4:8]])
            t.sweep()
            s = t.stats()
            o = s["per_model"]["m"]["object"]
            assert s["object_tenant_quotas"] == {la: 2 * one} and s["disk_tenant_quotas"] == {}
            assert o["tenant_bytes"] == {la: 2 * one} and o["quota_counts"] == {la: [0, 2]}
            assert (o["quota_refused"], o["quota_evicted"], o["objects"]) == (0, 2, 8)
            assert s["tenants"][la]["object_bytes_held"] == 2 * one
            assert s["tenants"][la]["object_quota_evicted"] == 2 and lb not in o["tenant_bytes"]
        finally:
            for mt in t.tiers.values():
                mt.objects.close()

"""Per-tenant byte quotas of the object tier (invariant 13 in the bucket), against a real
S3-compatible server on 127.0.0.1 (moto's): a tenant's usage is the size of the objects under
its prefix, whoever uploaded them; an upload over its tenant's quota first deletes that
tenant's own oldest objects, never another tenant's; an object larger than the quota is not
uploaded; a deleted object's entries are misses, never wrong rows."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

pytest.importorskip("boto3")
pytest.importorskip("moto")

from raykv.bench.tiers import local_s3
from raykv.blocks.hashing import Tenant, tenant_key, tenant_label
from raykv.tiers import object_tier
from raykv.tiers.disk_tier import DiskTier, model_identity
from raykv.tiers.object_tier import ObjectSettings, ObjectTier
from raykv.tiers.quotas import TenantQuotas
from raykv.tiers.slab import SlabFormat

from .helpers import make_plan
from .test_disk_tier import arena_of, content, keys_
from .test_object_tier import monkeypatch_module  # noqa: F401 (a fixture)

PLAN = make_plan("full")
ID = model_identity("m", PLAN)
A, B = tenant_key("tenant-a"), tenant_key("tenant-b")
LA, LB = tenant_label(A), tenant_label(B)
TENANTS: tuple[Tenant, ...] = (None, A, B)
KEYS = 12  # key i is tenant TENANTS[i % 3]'s (a tenant enters its blocks' hashes)
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def endpoint(monkeypatch_module):  # noqa: F811 (test_object_tier's, a server of this module)
    with local_s3("raykv-test") as url:
        yield url


def fresh(endpoint: str) -> ObjectSettings:
    return ObjectSettings("raykv-test", f"q{next(_prefixes)}/kv", endpoint)


def tier(where: ObjectSettings, quotas: TenantQuotas | None, per_object: int = 1) -> ObjectTier:
    stride = SlabFormat(PLAN, ID).stride
    return ObjectTier(where, PLAN, ID, batch_bytes=per_object * stride, quotas=quotas)


def key(i: int) -> bytes:
    return keys_(1, i)[0]


def tenant_of(k: bytes) -> Tenant:
    return TENANTS[int.from_bytes(k[-4:], "little") % len(TENANTS)]


def demote(t: ObjectTier, keys: list[bytes]) -> list[bytes]:
    arena, valid, sums, widths = arena_of(t, keys)
    members = [(k, *([None] * (t.factor - 1))) for k in keys]
    return t.demote(keys, arena, np.arange(len(keys)), valid, sums, widths, members,
                    tenants=[tenant_of(k) for k in keys])  # fmt: skip


def expect(t: ObjectTier, k: bytes) -> np.ndarray:
    return content(k, (t.copies, t.factor, t.slot_bytes))


def size(t: ObjectTier, n: int = 1) -> int:
    """The bytes of an object of ``n`` entries."""
    return t.format.header_bytes(n) + n * t.stride


def bucket(t: ObjectTier) -> dict[str, dict[str, int]]:
    """Per tenant label, its objects and their sizes, listed apart from the tier."""
    out: dict[str, dict[str, int]] = {}
    pages = t.client.get_paginator("list_objects_v2").paginate(
        Bucket=t.settings.bucket, Prefix=f"{t.base}/o/"
    )
    for page in pages:
        for o in page.get("Contents", ()):
            label = o["Key"][len(f"{t.base}/o/") :].split("/")[0]
            out.setdefault(label, {})[o["Key"]] = int(o["Size"])
    return out


def test_over_quota_a_tenant_loses_its_own_oldest_objects_and_too_large_ones_are_refused(
    endpoint,
):
    where = fresh(endpoint)
    probe = tier(where, None)
    one, two = size(probe, 1), size(probe, 2)
    probe.close()
    assert one < two < 2 * one  # (a header page per object)
    t = tier(where, TenantQuotas({LA: two - 1}), per_object=2)
    # A's keys: 1, 4, 7, 10; B's: 2, 5, 8, 11 (no quota): an object each, of two entries
    assert demote(t, [key(1), key(4), key(2), key(5)]) == [key(1), key(4), key(2), key(5)]
    assert t.flush(30)
    listed = bucket(t)
    assert sorted(listed) == [LB] and len(listed[LB]) == 1  # A's is larger than its quota
    assert t.stats.quota_refused == 2 and t.over_quota() == {LA: [2, 0]}
    assert sorted(t.take_gone()) == sorted([key(1), key(4)]) and t.stats.objects == 1
    assert t.load([key(1), key(4)]).keys == [] and t.stats.torn == 0
    t.close()
    t = tier(where, TenantQuotas({LA: 2 * one}), per_object=1)  # one entry an object
    for k in (key(1), key(4), key(7)):
        assert demote(t, [k]) == [k]
        assert t.flush(30)
        time.sleep(0.01)  # their uploads in order
    listed = bucket(t)
    assert sum(listed[LA].values()) == 2 * one == t.tenant_bytes()[LA]
    assert t.object_name(t.digest_of([key(1)]), LA) not in listed[LA]  # the oldest went
    assert t.stats.quota_evicted == 1 and t.stats.quota_evicted_objects == 1
    assert t.over_quota() == {LA: [0, 1]} and key(1) in t.take_gone()
    assert len(listed[LB]) == 1  # B's object stays
    got = t.load([key(1), key(4), key(7), key(2), key(5)])
    assert got.keys == [key(4), key(7), key(2), key(5)]
    assert all(np.array_equal(got.rows[i], expect(t, k)) for i, k in enumerate(got.keys))
    other = tier(where, None)  # the pointers of the deleted object went with it: a miss
    assert other.find([key(1)]) == [] and other.load([key(1)]).keys == []
    t.close()
    small = tier(where, TenantQuotas({LB: one - 1}))  # below one object: nothing of B's goes
    assert demote(small, [key(8)]) == [key(8)] and small.flush(30)
    assert small.stats.quota_refused == 1 and small.over_quota() == {LB: [1, 0]}
    assert bucket(small)[LB] == listed[LB] and small.load([key(8)]).keys == []
    small.close()
    other.close()


def test_a_disk_slab_of_several_tenants_becomes_one_object_per_tenant(endpoint, tmp_path):
    where = fresh(endpoint)
    obj = tier(where, None, per_object=8)
    probe = DiskTier(tmp_path / "probe", PLAN, ID, 1 << 40, slab_bytes=1)
    per = probe.stride * 3 + probe.slab_bytes
    probe.close()
    disk = DiskTier(tmp_path / "d", PLAN, ID, 2 * per, slab_bytes=per,
                    on_evict=obj.upload_file)  # fmt: skip
    ks = [key(i) for i in range(9)]
    for i in range(0, 9, 3):
        batch = ks[i : i + 3]
        disk.record(batch * (i + 2))  # hotter than those before: admitted, evicting
        arena, valid, sums, widths = arena_of(disk, batch)
        disk.demote(batch, arena, np.arange(3), valid, sums, widths, [(k,) for k in batch],
                    tenants=[tenant_of(k) for k in batch])  # fmt: skip
        assert disk.flush(10)
    assert obj.flush(30)
    assert disk.stats.evicted == 3 and obj.stats.handed == 3  # one slab, three entries
    listed = bucket(obj)  # keys 0, 1, 2: three tenants, three objects
    assert sorted(listed) == sorted(["none", LA, LB]) and all(len(v) == 1 for v in listed.values())
    assert obj.stats.objects == 3 and obj.stats.uploaded == 3 and obj.stats.write_errors == 0
    assert not list((tmp_path / "d").glob("evicted-*"))
    for t in (obj, tier(where, None)):  # this node (its index) and another (the pointers)
        got = t.load(ks[:3])
        assert got.keys == ks[:3]
        assert all(np.array_equal(got.rows[i], expect(t, k)) for i, k in enumerate(got.keys))
        assert got.members == [(k,) for k in ks[:3]]
        t.close()
    disk.close()


def test_another_node_sees_the_tenants_usage_and_deletes_its_oldest(endpoint, monkeypatch):
    """Usage is the bucket's: a second tier (another node or cluster) lists the tenant's
    prefix on its first upload and counts the first one's objects, and deletes the oldest
    of them over quota; a tier's view older than ``REFRESH_S`` is listed again."""
    where = fresh(endpoint)
    probe = tier(where, None)
    one = size(probe)
    probe.close()
    quotas = TenantQuotas({LA: 3 * one})
    a = tier(where, quotas)
    for k in (key(1), key(4)):
        demote(a, [k])
        assert a.flush(30)
        time.sleep(1.1)  # LastModified as the server keeps it: whole seconds, maybe
    b = tier(where, quotas)
    demote(b, [key(7)])
    assert b.flush(30) and b.tenant_bytes() == {LA: 3 * one} and b.stats.quota_evicted == 0
    time.sleep(1.1)
    demote(b, [key(10)])
    assert b.flush(30) and b.over_quota() == {LA: [0, 1]}
    names = set(bucket(b)[LA])
    assert names == {b.object_name(b.digest_of([k]), LA) for k in (key(4), key(7), key(10))}
    assert a.load([key(1)]).keys == [] and a.stats.torn == 1  # deleted under a: a counted miss
    assert a.load([key(4)]).keys == [key(4)]
    assert a.tenant_bytes() == {LA: 2 * one}  # a's view: listed before b's uploads
    monkeypatch.setattr(object_tier, "REFRESH_S", 0.0)  # stale now: listed again
    demote(a, [key(1)])
    assert a.flush(30) and a.tenant_bytes() == {LA: 3 * one} and a.over_quota() == {LA: [0, 1]}
    assert key(4) not in set(bucket(a)[LA]) and len(bucket(a)[LA]) == 3
    assert a.object_name(a.digest_of([key(4)]), LA) not in bucket(a)[LA]
    a.close()
    b.close()


class ObjectQuotaMachine(RuleBasedStateMachine):
    """Two tiers (nodes) on one bucket, random quotas (some tenants without one), any
    sequence of demotions of three tenants' entries and loads: after each upload every
    tenant's bytes in the bucket (listed apart) are within its quota, only the demoting
    tenant's objects disappear, an entry whose object was deleted is a miss and one whose
    object is there loads back exactly."""

    endpoint = ""

    def __init__(self) -> None:
        super().__init__()
        self.tiers: list[ObjectTier] = []

    @initialize(
        entries=st.fixed_dictionaries({t: st.none() | st.integers(0, 4) for t in TENANTS}),
        extra=st.floats(0, 0.99),
    )
    def start(self, entries, extra):
        where = fresh(self.endpoint)
        probe = tier(where, None)
        one = size(probe)
        probe.close()
        listed = {tenant_label(t): n for t, n in entries.items() if n is not None}
        self.quotas = TenantQuotas({t: n * one + int(extra * one) for t, n in listed.items()})
        self.tiers = [tier(where, self.quotas, 1), tier(where, self.quotas, 2)]

    @rule(node=st.integers(0, 1), ids=st.lists(st.integers(0, KEYS - 1), min_size=1,
                                                max_size=4))  # fmt: skip
    def demote(self, node, ids):
        t = self.tiers[node]
        keys = [key(i) for i in ids]
        before = bucket(t)
        demote(t, keys)
        assert t.flush(30)
        after = bucket(t)
        demoting = {tenant_label(tenant_of(k)) for k in keys}
        for label, objects in before.items():  # only the demoting tenants lost objects
            if label not in demoting:
                assert set(objects) <= set(after.get(label, {}))

    @rule(node=st.integers(0, 1), ids=st.lists(st.integers(0, KEYS - 1), min_size=1,
                                                max_size=6))  # fmt: skip
    def load(self, node, ids):
        t = self.tiers[node]
        keys = list(dict.fromkeys(key(i) for i in ids))
        there = {n for objects in bucket(t).values() for n in objects}
        with t._lock:
            where = {k: t.object_name(t._index[k].digest, t._index[k].label)
                     for k in keys if k in t._index}  # fmt: skip
        got = t.load(keys)
        for i, k in enumerate(got.keys):  # its own bytes, never another entry's
            assert np.array_equal(got.rows[i], expect(t, k))
        for k, name in where.items():
            assert (k in got.keys) == (name in there)

    @invariant()
    def within_quotas(self):
        if not self.tiers:
            return
        for label, objects in bucket(self.tiers[0]).items():
            quota = self.quotas.of_label(label)
            if quota is not None:
                assert sum(objects.values()) <= quota

    def teardown(self) -> None:
        for t in self.tiers:
            t.close()


def test_a_tenant_at_its_object_quota_never_deletes_another_tenants_objects(endpoint, monkeypatch):
    monkeypatch.setattr(object_tier, "REFRESH_S", 0.0)  # each upload lists: the bucket's usage
    ObjectQuotaMachine.endpoint = endpoint
    run = ObjectQuotaMachine.TestCase
    run.settings = settings(
        max_examples=12, stateful_step_count=12, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )  # fmt: skip
    run().runTest()


def test_the_object_quotas_read_their_own_variable():
    from raykv.tiers.quotas import OBJECT_QUOTAS_ENV, tenant_quotas

    env = {OBJECT_QUOTAS_ENV: f"default=1TiB,{LA}=10GiB"}
    assert tenant_quotas(env, OBJECT_QUOTAS_ENV) == TenantQuotas({LA: 10 << 30}, 1 << 40)
    assert tenant_quotas(env) is None


def test_a_pointer_of_the_format_before_tenant_labels_is_a_miss(endpoint):
    """Pointers name their object's tenant now (magic ``RAYKVPT2``): one of the format
    before, which names an object by its digest alone, is refused, never misread."""
    import struct

    where = fresh(endpoint)
    t = tier(where, None)
    demote(t, [key(1)])
    assert t.flush(30)
    name = t.pointer_name(key(1))
    body = t.client.get_object(Bucket=where.bucket, Key=name)["Body"].read()
    _, label, digest, slot, slots, sub = object_tier._POINTER.unpack(
        body[: object_tier._POINTER.size]
    )
    assert label.rstrip(b"\0").decode() == LA
    old = struct.pack("<8s32sIIH", b"RAYKVPTR", digest, slot, slots, sub) + key(1)
    t.client.put_object(Bucket=where.bucket, Key=name, Body=old)
    other = tier(where, None)
    assert other.find([key(1)]) == [] and other.load([key(1)]).keys == []
    assert other.stats.misses == 1 and other.stats.checksum_errors == 0
    t.client.put_object(Bucket=where.bucket, Key=name, Body=body)  # the pointer as written
    again = tier(where, None)  # (``other`` does not ask for a block nothing named for 5 s)
    assert again.find([key(1)]) == [(key(1), 0)] and again.load([key(1)]).keys == [key(1)]
    for x in (t, other, again):
        x.close()

"""Per-tenant byte quotas of the CPU tier (invariant 13) and their configuration."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raykv.blocks.hashing import Tenant, tenant_key, tenant_label
from raykv.errors import ConfigError
from raykv.tiers import CpuTier
from raykv.tiers.quotas import (
    QUOTAS_ENV,
    TenantQuotas,
    parse_tenant_quotas,
    quota_label,
    tenant_quotas,
)

from .helpers import make_plan

A, B = tenant_key("tenant-a"), tenant_key("tenant-b")
TENANTS: tuple[Tenant, ...] = (None, A, B)


def tier(n: int, quotas: dict[Tenant, int], default: int | None = None, policy: str = "lru"):
    """A tier of ``n`` blocks with quotas in blocks per tenant (``default``: the rest's)."""
    t = CpuTier(make_plan("full", cpu_blocks=n), policy)
    bb = t.block_bytes
    t.quotas = TenantQuotas(
        {tenant_label(k): q * bb for k, q in quotas.items()},
        None if default is None else default * bb,
    )
    return t


def key(tenant: Tenant, i: int) -> bytes:
    return hashlib.sha256(tenant_label(tenant).encode() + i.to_bytes(4, "little")).digest()


def fingerprint(t: CpuTier, k: bytes) -> np.ndarray:
    """The bytes an entry of key ``k`` holds here: derived from the key."""
    return np.resize(np.frombuffer(k, np.uint8), t.slot_bytes)


def store(t: CpuTier, tenant: Tenant, *keys: bytes):
    r = t.prepare_store(keys, tenant=tenant)
    if r is not None:
        write(t, r)
        t.finish_store(r, ok=True)
    return r


def write(t: CpuTier, r) -> None:
    for k, b in zip(r.keys, r.blocks, strict=True):
        t.rows(0)[t.row(b, 0)] = torch.from_numpy(fingerprint(t, k))


def owner(t: CpuTier) -> dict[bytes, Tenant]:
    """Each held key's tenant, as the tier recorded it."""
    return {k: t._tenant_of[t._tenant[i]] for k, i in t._by_key.items()}


def test_over_quota_store_frees_the_tenants_own_lru_entry_first():
    t = tier(8, {A: 2})
    store(t, A, key(A, 0))
    store(t, B, key(B, 0))
    store(t, A, key(A, 1))
    t.lookup([key(A, 0)])  # A's 0 is the more recently used now
    r = store(t, A, key(A, 2))
    assert r.evicted == (key(A, 1),)  # A's least recently used, not B's (older) entry
    assert key(B, 0) in t and key(A, 0) in t and key(A, 2) in t
    assert t.held_bytes(A) == 2 * t.block_bytes
    assert t.stats.quota_evicted == 1 and t.quota_counts[tenant_label(A)] == [0, 1]
    assert t.tenant_bytes() == {tenant_label(A): 2 * t.block_bytes,
                                tenant_label(B): t.block_bytes}  # fmt: skip
    t.check_consistency()


def test_a_store_whose_own_entries_are_all_leased_is_refused_and_counted():
    t = tier(8, {A: 2})
    store(t, A, key(A, 0), key(A, 1))
    store(t, B, key(B, 0))
    lease = t.prepare_load([key(A, 0), key(A, 1)])
    assert t.prepare_store([key(A, 2)], tenant=A) is None  # no own entry may go: refused
    assert t.stats.quota_refused == 1 and t.stats.rejected_stores == 1
    assert t.quota_counts[tenant_label(A)] == [1, 0]
    assert key(B, 0) in t and t.state(key(A, 2)) is None  # B's entry stays, nothing half
    # the part within its quota is stored, the rest refused: a prefix
    t.finish_load(lease)
    lease = t.prepare_load([key(A, 0)])
    r = store(t, A, key(A, 3), key(A, 4))
    assert r.keys == (key(A, 3),) and r.evicted == (key(A, 1),)
    assert t.stats.quota_refused == 2 and key(A, 4) not in t
    t.finish_load(lease)
    t.check_consistency()


def test_global_eviction_still_takes_any_tenants_entry_when_the_tier_is_full():
    t = tier(3, {A: 3})  # A under its quota; the tier is what is full
    store(t, B, key(B, 0))
    store(t, A, key(A, 0), key(A, 1))
    r = store(t, A, key(A, 2))
    assert r.evicted == (key(B, 0),)  # the tier's LRU, B's: A was within its quota
    assert t.tenant_bytes() == {tenant_label(A): 3 * t.block_bytes}
    t.check_consistency()


def test_untenanted_traffic_is_the_tenant_none_with_the_default_quota():
    t = tier(8, {}, default=1)
    store(t, None, key(None, 0))
    r = store(t, None, key(None, 1))
    assert r.evicted == (key(None, 0),)
    assert t.tenant_bytes() == {"none": t.block_bytes}
    t.quotas = TenantQuotas({"none": 2 * t.block_bytes}, t.block_bytes)
    assert store(t, None, key(None, 2)).evicted == ()  # none's own quota: 2 blocks


def test_a_quota_below_one_entry_stores_nothing_for_that_tenant():
    t = tier(4, {A: 0})
    assert t.prepare_store([key(A, 0)], tenant=A) is None
    assert store(t, B, key(B, 0)) is not None
    t.check_consistency()


def test_tenant_ids_of_tenants_holding_nothing_are_reused():
    t = tier(2, {})
    for i in range(50):  # a new tenant per store: ids stay bounded by what is held
        store(t, tenant_key(f"salt-{i}"), key(tenant_key(f"salt-{i}"), 0))
    assert len(t._tenant_of) <= 4 and len(t._tenant_ids) == 2
    t.check_consistency()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    quotas=st.tuples(*[st.integers(0, 6)] * 3),
    policy=st.sampled_from(["lru", "arc"]),
    steps=st.lists(
        st.tuples(
            st.sampled_from(
                ["store", "store", "reserve", "finish", "fail", "lease", "unlease", "drop"]
            ),
            st.integers(0, 2),  # tenant
            st.lists(st.integers(0, 9), min_size=1, max_size=4),  # its keys
        ),
        max_size=40,
    ),
)
def test_a_tenant_at_its_quota_never_evicts_another_tenants_entry(quotas, policy, steps):
    """Random stores, reservations, failures, leases and drops of three tenants (None, A, B)
    with quotas in a tier of 10 blocks: after every store, every tenant holds at most its
    quota; a store by a tenant evicts another tenant's entries only within the room its
    quota left it (none at all at its quota); every lease reads the bytes its key stored."""
    n = 10
    t = tier(n, dict(zip(TENANTS, quotas, strict=True)), policy=policy)
    limit = dict(zip(TENANTS, quotas, strict=True))
    pending, leases = [], []
    for op, who, ids in steps:
        tenant = TENANTS[who]
        keys = [key(tenant, i) for i in ids]
        if op in ("store", "reserve"):
            before = owner(t)
            held = t.held_bytes(tenant) // t.block_bytes
            r = t.prepare_store(keys, tenant=tenant)
            after = owner(t)
            gone = [k for k in before if k not in after]
            others = [k for k in gone if before[k] != tenant]
            assert len(others) <= max(0, limit[tenant] - held), (op, tenant, gone)
            if r is not None:
                assert set(r.evicted) == set(gone)
                write(t, r)
                if op == "store":
                    t.finish_store(r, ok=True)
                else:
                    pending.append(r)
            for x in TENANTS:
                assert t.held_bytes(x) <= limit[x] * t.block_bytes
        elif op in ("finish", "fail") and pending:
            t.finish_store(pending.pop(ids[0] % len(pending)), ok=op == "finish")
        elif op == "lease":
            lease = t.prepare_load(keys)
            if lease is not None:
                for k, b in zip(lease.keys, lease.blocks, strict=True):
                    got = t.rows(0)[t.row(b, 0)].numpy()
                    assert np.array_equal(got, fingerprint(t, k)), "an entry with wrong bytes"
                leases.append(lease)
        elif op == "unlease" and leases:
            t.finish_load(leases.pop(ids[0] % len(leases)))
        elif op == "drop":
            t.drop(keys[0])
        t.check_consistency()
        assert sum(t.tenant_bytes().values()) == (n - t.num_free) * t.block_bytes


# -- configuration ----------------------------------------------------------------------------


def test_quotas_parse_labels_salts_none_and_default():
    q = parse_tenant_quotas(["default=1GiB", "none=512MiB", "3f2a9c1d=2GiB", "tenant-a=4096",
                             "salt:deadbeef=1KiB"])  # fmt: skip
    assert q.default == 1 << 30
    assert q.by_label == {"none": 512 << 20, "3f2a9c1d": 2 << 30, tenant_label(A): 4096,
                          tenant_label(tenant_key("deadbeef")): 1024}  # fmt: skip
    assert q.of(A) == 4096 and q.of(None) == 512 << 20 and q.of(B) == 1 << 30
    assert quota_label("deadbeef") == "deadbeef"  # 8 hex digits: a label
    assert "tenant-a" not in q.to_env()  # salts never reach the environment
    assert tenant_quotas({QUOTAS_ENV: q.to_env()}) == q
    assert tenant_quotas({QUOTAS_ENV: ""}) is None and tenant_quotas({}) is None


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["tenant-a"], "NAME=SIZE"),
        (["=2GiB"], "NAME=SIZE"),
        (["tenant-a="], "NAME=SIZE"),
        (["tenant-a=lots"], r"tenant-a=lots.*cannot read size 'lots'.*60GiB"),
        (["tenant-a=-1"], "cannot read size|a quota of -1"),
        (["salt:=1GiB"], "is empty"),
        (["tenant-a=1GiB", f"{tenant_label(A)}=2GiB"], "1073741824 and 2147483648 bytes"),
    ],
)
def test_quota_settings_that_cannot_work_are_config_errors(items, match):
    with pytest.raises(ConfigError, match=match):
        parse_tenant_quotas(items)


def test_a_bad_environment_names_the_variable():
    with pytest.raises(ConfigError, match=QUOTAS_ENV):
        tenant_quotas({QUOTAS_ENV: "default=2GiB,oops"})

"""Per-tenant byte quotas of the disk tier (invariant 13 on disk): a demotion over its
tenant's quota drops that tenant's own least recently used entries, then leaves out what
still does not fit; never another tenant's entry; usage is rebuilt from the slab headers."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from raykv.blocks.hashing import Tenant, tenant_key, tenant_label
from raykv.tiers.disk_tier import DiskTier
from raykv.tiers.quotas import TenantQuotas

from .helpers import make_plan
from .test_disk_tier import ID, arena_of, expect, keys_

A, B = tenant_key("tenant-a"), tenant_key("tenant-b")
TENANTS: tuple[Tenant, ...] = (None, A, B)
KEYS = 15  # key i is tenant TENANTS[i % 3]'s (a tenant enters its blocks' hashes)


def key(i: int) -> bytes:
    return keys_(1, i)[0]


def tenant_of(k: bytes) -> Tenant:
    return TENANTS[int.from_bytes(k[-4:], "little") % len(TENANTS)]


def open_disk(path: Path, quotas: TenantQuotas, *, slabs: int, slab_entries: int) -> DiskTier:
    plan = make_plan("full")
    probe = DiskTier(path / "probe", plan, ID, 64 << 20, slab_bytes=1)
    per = probe.stride * slab_entries + probe.slab_bytes  # ``slab_entries`` a slab
    probe.close()
    return DiskTier(path / "d", plan, ID, slabs * per, slab_bytes=per, quotas=quotas)


def demote(disk: DiskTier, keys: list[bytes]) -> list[bytes]:
    arena, valid, sums, widths = arena_of(disk, keys)
    members = [(k, *([None] * (disk.factor - 1))) for k in keys]
    return disk.demote(keys, arena, np.arange(len(keys)), valid, sums, widths, members,
                       tenants=[tenant_of(k) for k in keys])  # fmt: skip


def held_by_tenant(disk: DiskTier) -> dict[Tenant, set[bytes]]:
    out: dict[Tenant, set[bytes]] = {t: set() for t in TENANTS}
    held = disk.keys()
    for k in held:
        out[tenant_of(k)].add(k)
    return out


def test_over_quota_a_tenant_drops_its_own_least_recently_used_then_refuses(tmp_path):
    """Tenant A (keys 1, 4, 7, ...) may hold two entries, B (2, 5, 8) has no quota: A's
    demotions drop A's least recently used entries (a load makes one recent), then leave
    out the first of what still does not fit; B's entries stay; a restart keeps the drops."""
    stride = open_disk(tmp_path / "probe", TenantQuotas(), slabs=1, slab_entries=1).stride
    quotas = TenantQuotas({tenant_label(A): 2 * stride + stride // 2})
    disk = open_disk(tmp_path, quotas, slabs=8, slab_entries=3)
    a = tenant_label(A)
    assert demote(disk, [key(1), key(4)]) == [key(1), key(4)] and disk.flush(10)
    assert disk.load([key(1)]).keys == [key(1)]  # 1 used: 4 is A's least recently used
    assert demote(disk, [key(2), key(5), key(8), key(7)]) == [key(2), key(5), key(8), key(7)]
    assert key(4) not in disk and disk.quota_counts[a] == [0, 1]
    assert disk.load([key(4)]).keys == [] and key(4) in disk.take_gone()
    assert demote(disk, [key(10), key(13)]) == [key(10), key(13)]  # 1 and 7 go
    assert disk.flush(10)
    assert demote(disk, [key(1), key(4), key(7)]) == [key(4), key(7)]  # 10, 13 go; 1 left out
    assert disk.quota_counts[a] == [1, 5] and disk.stats.quota_refused == 1
    assert disk.held_bytes(A) == 2 * stride and disk.held_bytes(B) == 3 * stride
    assert disk.tenant_bytes() == {a: 2 * stride, tenant_label(B): 3 * stride}
    got = disk.load([key(i) for i in range(15)])
    assert got.keys == [key(2), key(4), key(5), key(7), key(8)]
    assert all(np.array_equal(got.rows[i], expect(disk, k)) for i, k in enumerate(got.keys))
    disk.close()
    again = open_disk(tmp_path, quotas, slabs=8, slab_entries=3)  # dropped stay dropped
    assert sorted(again.keys()) == sorted([key(2), key(4), key(5), key(7), key(8)])
    assert again.tenant_bytes() == {a: 2 * stride, tenant_label(B): 3 * stride}
    again.close()
    lower = TenantQuotas({tenant_label(A): stride, tenant_label(B): 3 * stride})
    trimmed = open_disk(tmp_path, lower, slabs=8, slab_entries=3)  # A keeps its newest one
    assert trimmed.held_bytes(A) == stride and key(7) in trimmed and key(4) not in trimmed
    assert trimmed.quota_counts == {a: [0, 1]} and trimmed.take_gone() == []
    assert trimmed.load([key(4), key(7)]).keys == [key(7)]
    trimmed.close()
    trimmed = open_disk(tmp_path, lower, slabs=8, slab_entries=3)  # tombstoned on disk
    assert trimmed.quota_counts == {} and sorted(trimmed.keys()) == sorted(
        [key(2), key(5), key(7), key(8)]
    )
    trimmed.close()


class DiskQuotaMachine(RuleBasedStateMachine):
    """Random quotas (in entries, some not whole ones, some tenants without one, maybe a
    default), then any sequence of demotions of three tenants' entries, loads, flushes and
    restarts from the headers: after a demotion every tenant's bytes are within its quota,
    only the demoting tenants lost entries over quota, a dropped entry is a miss (a load
    returns its own bytes or nothing), and a restart rebuilds the same usage."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="raykv-diskquota-"))
        self.disk: DiskTier | None = None

    @initialize(
        entries=st.fixed_dictionaries({t: st.none() | st.integers(0, 5) for t in TENANTS}),
        default=st.none() | st.integers(0, 5),
        extra=st.floats(0, 0.99),
        slabs=st.integers(2, 8),
    )
    def start(self, entries, default, extra, slabs):
        stride = open_disk(self.dir / "probe", TenantQuotas(), slabs=1, slab_entries=1).stride
        self.stride = stride

        def size(n: int) -> int:
            return n * stride + int(extra * stride)  # a part of an entry holds none

        self.quotas = TenantQuotas(
            {tenant_label(t): size(n) for t, n in entries.items() if n is not None},
            None if default is None else size(default),
        )
        self.slabs = slabs
        self.disk = self.open()
        self.dropped_over_quota: list[bytes] = []

    def open(self) -> DiskTier:
        disk = open_disk(self.dir, self.quotas, slabs=self.slabs, slab_entries=3)
        drop = disk._drop_over_quota

        def spy(k: bytes) -> None:  # which entries a demotion dropped over quota
            self.dropped_over_quota.append(k)
            drop(k)

        disk._drop_over_quota = spy
        return disk

    @rule(ids=st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=6), wait=st.booleans())
    def demote(self, ids, wait):
        keys = [key(i) for i in ids]
        if wait:
            self.disk.flush(10)
        before = held_by_tenant(self.disk)
        self.dropped_over_quota = []
        held = demote(self.disk, keys)
        demoting = {tenant_of(k) for k in keys}
        for k in self.dropped_over_quota:  # only the demoting tenants' own entries
            assert tenant_of(k) in demoting
            assert k in before[tenant_of(k)] and k not in keys
        assert set(held) <= set(keys)
        for k in set(keys) - set(held):  # left out: a miss (a held one may go with its slab)
            assert k not in self.disk
        for k in self.dropped_over_quota:
            assert k not in self.disk
        self.check_quotas()

    @rule(ids=st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=8), wait=st.booleans())
    def load(self, ids, wait):
        if wait:
            self.disk.flush(10)
        ks = [key(i) for i in ids]
        got = self.disk.load(ks)
        assert set(got.keys) <= set(ks)
        for i, k in enumerate(got.keys):  # its own bytes, never another entry's
            assert np.array_equal(got.rows[i], expect(self.disk, k))

    @rule()
    def restart(self):
        assert self.disk.flush(10)
        usage, keys = self.disk.tenant_bytes(), set(self.disk.keys())
        for t, held in held_by_tenant(self.disk).items():  # usage: its entries' slots
            assert usage.get(tenant_label(t), 0) == len(held) * self.stride
        self.disk.close()
        self.disk = self.open()
        assert self.disk.tenant_bytes() == usage
        assert set(self.disk.keys()) == keys

    @invariant()
    def check_quotas(self):
        if self.disk is None:
            return
        for t in TENANTS:
            quota = self.quotas.of(t)
            if quota is not None:  # (the writer, evicting slabs meanwhile, only lowers it)
                assert self.disk.held_bytes(t) <= quota

    def teardown(self) -> None:
        if self.disk is not None:
            self.disk.close()
        shutil.rmtree(self.dir)


TestDiskQuotaMachine = DiskQuotaMachine.TestCase
TestDiskQuotaMachine.settings = settings(
    max_examples=30, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def test_a_slab_of_the_format_before_tenants_is_refused(tmp_path):
    """Format 1 records name no tenant: such a slab is refused (removed, counted), as a
    slab of any other format is; its entries are misses."""
    disk = open_disk(tmp_path, TenantQuotas(), slabs=2, slab_entries=3)
    demote(disk, [key(1), key(2)])
    disk.close()
    (slab,) = (tmp_path / "d").glob("slab-*.kv")
    with open(slab, "r+b") as fh:  # the version after the magic
        fh.seek(8)
        fh.write((1).to_bytes(4, "little"))
    again = open_disk(tmp_path, TenantQuotas(), slabs=2, slab_entries=3)
    assert again.stats.refused_slabs == 1 and len(again) == 0 and not slab.exists()
    again.close()


def test_the_disk_quotas_read_their_own_variable_with_the_one_parser():
    """``RAYKV_DISK_TENANT_QUOTAS`` has ``RAYKV_TENANT_QUOTAS``' syntax and parser; a bad
    item's error names the variable it came from."""
    import pytest

    from raykv.errors import ConfigError
    from raykv.tiers.quotas import DISK_QUOTAS_ENV, QUOTAS_ENV, tenant_quotas

    env = {DISK_QUOTAS_ENV: f"default=50GiB,{tenant_label(A)}=1GiB", QUOTAS_ENV: "none=1MiB"}
    assert tenant_quotas(env, DISK_QUOTAS_ENV) == TenantQuotas({tenant_label(A): 1 << 30},
                                                               50 << 30)  # fmt: skip
    assert tenant_quotas(env) == TenantQuotas({"none": 1 << 20})
    with pytest.raises(ConfigError, match=f"{DISK_QUOTAS_ENV} 'acme:1GiB'"):
        tenant_quotas({DISK_QUOTAS_ENV: "acme:1GiB"}, DISK_QUOTAS_ENV)

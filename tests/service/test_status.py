"""The status ``raykv status`` prints, assembled from the coordinator's state (pure)."""

from __future__ import annotations

import time
from collections import Counter

from raykv.blocks import PrefixIndex
from raykv.layout import FullAttention, plan
from raykv.service.control import status
from raykv.service.control.coordinator import Member
from raykv.service.served import ServedModel


def test_the_status_counts_nodes_members_models_and_lookups() -> None:
    layers = {"l0": FullAttention("float32", 1, 8)}
    model = ServedModel("m", layers, max_model_len=64, cpu_bytes=1 << 16)
    p = plan(layers, num_gpu_blocks=9, max_model_len=64, max_num_batched_tokens=64)
    index = PrefixIndex()
    index.add(0, b"h1", 3, holder="pool", scope="m")
    index.add(0, b"h1", 0, holder="tier", scope="m")
    index.add(0, b"h2", 4, holder="pool", scope="m")
    members = [
        Member("tier", "tier", "n1", None, stats={"blocks_used": 1}),
        Member("pool", "pool", "n1", "m", stats={"blocks_used": 2}),
    ]
    tally = Counter(lookups=3, hits_local_gpu=6, misses_all=2, failures_watch=1)
    nodes = [
        {"NodeID": "n1", "NodeManagerAddress": "127.0.0.1", "Alive": True, "Resources": {}},
        {
            "NodeID": "n2",
            "NodeManagerAddress": "127.0.0.1",
            "Alive": False,
            "Resources": {"GPU": 2},
        },
    ]
    s = status.cluster(
        ray_nodes=nodes,
        members_=members,
        index=index,
        served={"m": model},
        plans={"m": p},
        tally=tally,
        started=time.time() - 5,
        restarted=False,
    )
    assert [(n["node_id"], n["alive"], n["gpus"]) for n in s["nodes"]] == [
        ("n1", True, 0),
        ("n2", False, 2),
    ]
    assert [(m["name"], m["indexed_blocks"], m["blocks_used"]) for m in s["members"]] == [
        ("pool", 2, 2),  # sorted by node, kind, name
        ("tier", 1, 1),
    ]
    assert s["models"]["m"]["num_gpu_blocks"] == p.num_gpu_blocks == 9
    assert s["models"]["m"]["groups"] == [["full", 16, 1]]
    assert s["indexed_blocks"] == 2 and s["lookups"] == 3
    assert s["hit_rate"] == 6 / 8 and s["hits"] == {"local_gpu": 6} and s["misses"] == 2
    assert s["failures"] == {"watch": 1} and 4 < s["uptime_s"] < 60


def tier_members_status(members: list[Member]) -> dict:
    """The cluster's status with ``members`` (tiers) and one small model served."""
    layers = {"l0": FullAttention("float32", 1, 8)}
    p = plan(layers, num_gpu_blocks=9, max_model_len=64, max_num_batched_tokens=64)
    return status.cluster(
        ray_nodes=[],
        members_=members,
        index=PrefixIndex(),
        served={"m": ServedModel("m", layers, max_model_len=64, cpu_bytes=1 << 16)},
        plans={"m": p},
        tally=Counter(),
        started=time.time(),
        restarted=False,
    )


def test_engines_counts_per_tenant_are_bounded_and_summed_over_the_nodes() -> None:
    """A node's metrics count engines' lookups and stores per tenant label: at most
    ``MAX_TENANTS`` tenants apart (requests without one always apart), the rest, and
    anything that is not a label (never a raw salt), as "other"; the status sums them over
    the nodes."""
    from raykv.blocks import tenant_key
    from raykv.blocks.hashing import tenant_label
    from raykv.service.control.metrics import MAX_TENANTS, OTHER_TENANTS, ServiceMetrics

    m = ServiceMetrics("tier")
    labels = [tenant_label(tenant_key(f"salt-{i}")) for i in range(MAX_TENANTS + 5)]
    assert tenant_label(None) == "none" and all(len(x) == 8 for x in labels)
    for label in labels:
        m.engine_counts("m", label, lookups=1, hit_blocks=2, miss_blocks=3, stored_entries=4)
    m.engine_counts("m", "none", lookups=1, hit_blocks=0, miss_blocks=5, stored_entries=0)
    m.engine_counts("m", "salt-0", lookups=1, hit_blocks=0, miss_blocks=1, stored_entries=0)
    m.engine_counts("m", labels[0], lookups=1, hit_blocks=7, miss_blocks=0, stored_entries=0)
    assert set(m.tenants) == {*labels[:MAX_TENANTS], "none", OTHER_TENANTS}
    assert m.tenants[labels[0]] == {"lookups": 2, "hit_blocks": 9, "miss_blocks": 3,
                                    "stored_entries": 4}  # fmt: skip
    assert m.tenants[OTHER_TENANTS]["lookups"] == 6  # 5 past the bound, 1 not a label
    assert m.tenants["none"] == {"lookups": 1, "miss_blocks": 5}
    assert m.tally["engine_lookups"] == MAX_TENANTS + 5 + 3

    a, b = labels[0], labels[1]
    members = [
        Member("tier-1", "tier", "n1", None, stats={"tenants": {a: {"lookups": 2}}}),
        Member("tier-2", "tier", "n2", None,
               stats={"tenants": {a: {"lookups": 1, "hit_blocks": 4}, b: {"lookups": 1}}}),
    ]  # fmt: skip
    s = tier_members_status(members)
    assert s["tenants"] == {a: {"lookups": 3, "hit_blocks": 4}, b: {"lookups": 1}}
    from raykv.service.control.launcher import status_table

    assert f"  {a}         3 lookups  4 / 0 blocks  0 stored" in status_table({**s, "address": "-"})


def test_tenants_bytes_held_and_quotas_reach_the_metrics_and_the_status_table() -> None:
    """A tier's per-tenant bytes (every model, summed over the nodes), its stores over quota
    (refused / own evicted) and the configured quotas, in ``raykv status`` (invariant 13)."""
    from raykv.blocks import tenant_key
    from raykv.blocks.hashing import tenant_label
    from raykv.service.control.launcher import status_table
    from raykv.service.control.metrics import ServiceMetrics

    a = tenant_label(tenant_key("a"))
    m = ServiceMetrics("tier")
    m.tenant_bytes({"m1": {a: 1 << 20, "none": 512}, "m2": {a: 1 << 20}})
    m.tenant_quota("m1", a, refused=3, evicted=2)
    assert m.tenants[a] == {"bytes_held": 2 << 20, "quota_refused": 3, "quota_evicted": 2}
    m.tenant_bytes({"m1": {"none": 512}})  # a holds nothing now: its gauge back to 0
    assert m.tenants[a]["bytes_held"] == 0 and m._gauged["cpu"] == {"m1": {"none"}, "m2": set()}

    quotas = {"default": 1 << 30, a: 2 << 20}
    members = [
        Member("tier-1", "tier", "n1", None, stats={
            "tenants": {a: {"bytes_held": 1 << 20, "quota_refused": 1}},
            "tenant_quotas": quotas}),
        Member("tier-2", "tier", "n2", None, stats={
            "tenants": {a: {"bytes_held": 1 << 20}, "none": {"bytes_held": 5}},
            "tenant_quotas": quotas}),
    ]  # fmt: skip
    s = tier_members_status(members)
    assert s["tenants"][a] == {"bytes_held": 2 << 20, "quota_refused": 1}
    assert s["tenant_quotas"] == quotas
    table = status_table({**s, "address": "-"})
    assert "0 stored  2.00 MiB / 2.00 MiB  1 / 0" in table
    assert "none" in table and "5 B / 1.00 GiB  0 / 0" in table
    assert "disk" not in table  # no disk tier holds tenants' entries: no disk columns


def test_disk_tier_tenant_bytes_and_quotas_reach_the_metrics_and_the_status_table() -> None:
    """The disk tier's per-tenant bytes, its demotions over quota (refused / own dropped)
    and its configured quotas sit beside the CPU tier's in the metrics and ``raykv status``."""
    from raykv.blocks import tenant_key
    from raykv.blocks.hashing import tenant_label
    from raykv.service.control.launcher import status_table
    from raykv.service.control.metrics import ServiceMetrics

    a = tenant_label(tenant_key("a"))
    m = ServiceMetrics("tier")
    m.tenant_bytes({"m1": {a: 1 << 20}})
    m.tenant_bytes({"m1": {a: 3 << 20}}, tier="disk")
    m.tenant_quota("m1", a, refused=1, evicted=4, tier="disk")
    assert m.tenants[a] == {"bytes_held": 1 << 20, "disk_bytes_held": 3 << 20,
                            "disk_quota_refused": 1, "disk_quota_evicted": 4}  # fmt: skip
    m.tenant_bytes({}, tier="disk")  # the disk holds none of a's now: its gauge back to 0
    assert m.tenants[a]["disk_bytes_held"] == 0 and m._gauged["disk"] == {"m1": set()}
    assert m.tenants[a]["bytes_held"] == 1 << 20 and m._gauged["cpu"] == {"m1": {a}}

    members = [
        Member("tier-1", "tier", "n1", None, stats={
            "tenants": {a: {"bytes_held": 1 << 20, "disk_bytes_held": 2 << 20,
                            "disk_quota_evicted": 3}},
            "disk_tenant_quotas": {"default": 4 << 20}}),
    ]  # fmt: skip
    s = tier_members_status(members)
    assert s["disk_tenant_quotas"] == {"default": 4 << 20} and s["tenant_quotas"] == {}
    table = status_table({**s, "address": "-"})
    assert "1.00 MiB / no quota  0 / 0  disk 2.00 MiB / 4.00 MiB  0 / 3" in table


def test_object_tier_tenant_bytes_and_quotas_reach_the_metrics_and_the_status_table() -> None:
    """The object tier's per-tenant bytes in the bucket, its uploads over quota (refused /
    own deleted) and its configured quotas sit beside the other tiers' in the metrics and
    ``raykv status``; every node sees the whole bucket, so its bytes are not summed."""
    from raykv.blocks import tenant_key
    from raykv.blocks.hashing import tenant_label
    from raykv.service.control.launcher import status_table
    from raykv.service.control.metrics import ServiceMetrics

    a = tenant_label(tenant_key("a"))
    m = ServiceMetrics("tier")
    m.tenant_bytes({"m1": {a: 5 << 20}}, tier="object")
    m.tenant_quota("m1", a, refused=2, evicted=6, tier="object")
    assert m.tenants[a] == {"object_bytes_held": 5 << 20, "object_quota_refused": 2,
                            "object_quota_evicted": 6}  # fmt: skip
    assert m._gauged["object"] == {"m1": {a}} and m._gauged["cpu"] == {} and m._gauged["disk"] == {}
    m.tenant_bytes({}, tier="object")
    assert m.tenants[a]["object_bytes_held"] == 0 and m._gauged["object"] == {"m1": set()}

    def node(n: str, held: int) -> Member:
        return Member(f"tier-{n}", "tier", n, None, stats={
            "tenants": {a: {"object_bytes_held": held, "object_quota_evicted": 1}},
            "object_tenant_quotas": {"default": 8 << 20}})  # fmt: skip

    s = tier_members_status([node("n1", 5 << 20), node("n2", 6 << 20)])
    assert s["object_tenant_quotas"] == {"default": 8 << 20}
    assert s["tenants"][a] == {"object_bytes_held": 6 << 20, "object_quota_evicted": 2}
    table = status_table({**s, "address": "-"})
    assert "object 6.00 MiB / 8.00 MiB  0 / 2" in table and " disk " not in table

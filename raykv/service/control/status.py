"""Status: the cluster as ``Client.stats()`` and ``raykv status`` show it, assembled from
the coordinator's state (nodes, members, served models and their plans, the prefix index,
the lookup tallies). Pure: it reads what it is given and changes nothing.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterable, Mapping
from typing import Any

# a tenant's object-tier bytes: the bucket's, as each node last listed it (not per node)
BUCKET_HELD = "object_bytes_held"
_WHERE = ("gpu", "cpu", "remote")  # where a corrupt copy was found (``checksum_errors``)


def nodes(ray_nodes: Iterable[dict]) -> list[dict]:
    """One row per Ray node (``ray.nodes()`` entries), alive or not."""
    rows = {
        n["NodeID"]: {
            "node_id": n["NodeID"],
            "address": n["NodeManagerAddress"],
            "alive": n["Alive"],
            "gpus": int(n["Resources"].get("GPU", 0)),
        }
        for n in ray_nodes
    }
    return list(rows.values())


def members(members: Iterable[Any], index: Any) -> list[dict]:
    """One row per registered member (pool or tier), by node, kind and name: what it last
    reported with its heartbeat, and how many of its blocks the prefix index holds."""
    now = time.monotonic()
    return [
        {
            "name": m.name,
            "kind": m.kind,
            "node_id": m.node_id,
            "model": m.model,
            "indexed_blocks": index.blocks_of(m.name),
            "heartbeat_age_s": round(now - m.last_seen, 2),
            **m.stats,
        }
        for m in sorted(members, key=lambda m: (m.node_id, m.kind, m.name))
    ]


def models(served: Mapping[str, Any], plans: Mapping[str, Any]) -> dict[str, dict]:
    """Per served model: its settings and what its plan sized."""
    return {
        name: {
            "max_model_len": m.max_model_len,
            "block_size": m.block_size,
            "tp_size": m.tp_size,
            "groups": [[g.spec.kind, g.block_size, len(g.layer_names)] for g in plans[name].groups],
            "num_gpu_blocks": plans[name].num_gpu_blocks,
            "cpu_num_blocks": plans[name].cpu_num_blocks,
            "cpu_bytes_per_block": plans[name].cpu_bytes_per_block,
            "block_size_factor": plans[name].block_size_factor,
        }
        for name, m in served.items()
    }


def lookups(tally: Mapping[str, int]) -> dict[str, Any]:
    """Lookup counts and the hit rate (hit blocks / blocks looked up) from the metrics."""
    hits = {k.removeprefix("hits_"): v for k, v in tally.items() if k.startswith("hits_")}
    looked = sum(hits.values()) + tally.get("misses_all", 0)
    return {
        "lookups": tally.get("lookups", 0),
        "hit_rate": sum(hits.values()) / looked if looked else 0.0,
        "hits": hits,
        "misses": tally.get("misses_all", 0),
    }


def cluster(
    *,
    ray_nodes: Iterable[dict],
    members_: Iterable[Any],
    index: Any,
    served: Mapping[str, Any],
    plans: Mapping[str, Any],
    tally: Mapping[str, int],
    started: float,
    restarted: bool,
    routes: Mapping[tuple[str, str], str] | None = None,
    routers: Iterable[dict] = (),
) -> dict[str, Any]:
    """The whole status, in the shape ``raykv status`` prints (``status_table``)."""
    rows = members(members_, index)
    # lookups engines answered from their node's index replica are counted at the tiers
    tally = Tally(tally)
    engine = (
        ("engine_lookups", "lookups"),
        ("engine_hit_blocks", "hits_replica"),
        ("engine_miss_blocks", "misses_all"),
    )
    for row in rows:
        for theirs, ours in engine:
            if row.get(theirs):
                tally[ours] += row[theirs]
    look = lookups(tally)
    per_tenant: dict[str, Tally] = {}
    for row in rows:  # each node's engines, summed per tenant label
        for label, counts in (row.get("tenants") or {}).items():
            mine = per_tenant.setdefault(label, Tally())
            bucket = max(mine.get(BUCKET_HELD, 0), counts.get(BUCKET_HELD, 0))
            mine.update(counts)
            if bucket:  # every node sees the whole bucket: the largest view, not a sum
                mine[BUCKET_HELD] = bucket
    return {
        "nodes": nodes(ray_nodes),
        "models": models(served, plans),
        "members": rows,
        "indexed_blocks": len(index),
        "lookups": look["lookups"],
        "hit_rate": look["hit_rate"],
        "hits": look["hits"],
        "misses": look["misses"],
        # engines' lookups, hit / missed blocks and stored CPU-tier entries per tenant
        # (``tenant_label``: "none" for requests without one, "other" past MAX_TENANTS)
        "tenants": {label: dict(c) for label, c in sorted(per_tenant.items())},
        # each tenant label's byte quota in one model's arena on one node (invariant 13;
        # "default": every tenant not listed), as the tiers were configured: RAYKV_TENANT_QUOTAS
        "tenant_quotas": next((r["tenant_quotas"] for r in rows if r.get("tenant_quotas")), {}),
        # and in one model's disk tier on one node: RAYKV_DISK_TENANT_QUOTAS
        "disk_tenant_quotas": next(
            (r["disk_tenant_quotas"] for r in rows if r.get("disk_tenant_quotas")), {}
        ),
        # and in one model's objects in the bucket, every node's: RAYKV_OBJECT_TENANT_QUOTAS
        "object_tenant_quotas": next(
            (r["object_tenant_quotas"] for r in rows if r.get("object_tenant_quotas")), {}
        ),
        # copies that failed their checksum (invariant 12: served as misses), each counted
        # once, by the member that found it (its row), and by where: "gpu" (a pool's own
        # block), "cpu" (a CPU-tier entry loaded on its node), "remote" (a copy another
        # member sent)
        "checksum_errors": sum(m.get("checksum_errors", 0) for m in rows),
        "checksum_errors_where": {
            w: sum(m.get(f"checksum_errors_{w}", 0) for m in rows) for w in _WHERE
        },
        # CPU-tier leases / reservations: reclaimed at their deadline, released with their
        # holder (it exited or detached), and finishes that came too late (ignored)
        "leases_expired": sum(m.get("leases_expired", 0) for m in rows),
        "leases_released": sum(m.get("leases_released", 0) for m in rows),
        "late_finishes": sum(m.get("late_finishes", 0) for m in rows),
        # peers a member's UCX listener refused (no or wrong transport secret)
        "transport_auth_refused": sum(m.get("failures_transport_auth", 0) for m in rows),
        "failures": {
            k.removeprefix("failures_"): v for k, v in tally.items() if k.startswith("failures_")
        },
        # which transport each (holder, reader) pair fetched over (``raykv.transport.choose``)
        "routes": [
            {"from": a, "to": b, "transport": t} for (a, b), t in sorted((routes or {}).items())
        ],
        # Ray Serve routers ranking replicas from the index (``raykv.integrations.serve``):
        # their cost constants and decisions
        "routers": list(routers),
        "uptime_s": round(time.time() - started, 1),
        "restarted": restarted,
    }

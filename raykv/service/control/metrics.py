"""Service metrics: exported through ``ray.util.metrics`` (Prometheus) and mirrored in plain
counters so ``stats()`` / ``raykv status`` can print them without a metrics backend."""

from __future__ import annotations

from collections import Counter as Tally

from ray.util import metrics

from raykv.blocks.hashing import TENANT_LABEL_CHARS

_LATENCY_BOUNDS = [0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 1000]  # ms
# ``raykv_fetched_bytes``' transport of a pool's loads from its own node's CPU tier: they go
# through the shared arena, not over a ``raykv.transport``, and are most of what a pool loads
ARENA = "arena"

# Tenants a component counts apart (each a label of its own in Prometheus); the rest are
# counted together as "other", so a service with many tenants keeps a bounded set of series.
MAX_TENANTS = 32
OTHER_TENANTS = "other"
_HEX = frozenset("0123456789abcdef")


class ServiceMetrics:
    def __init__(self, component: str) -> None:
        tags = ("component", "model", "tier")
        self.component = component
        self.tally: Tally[str] = Tally()
        self._hits = metrics.Counter("raykv_hit_blocks", "Blocks found, per tier", tags)
        self._misses = metrics.Counter("raykv_miss_blocks", "Blocks looked up, not found", tags)
        self._evictions = metrics.Counter("raykv_evicted_blocks", "Blocks evicted", tags)
        self._offloads = metrics.Counter("raykv_offloaded_blocks", "GPU blocks saved to CPU", tags)
        self._moved = metrics.Counter("raykv_bytes_moved", "KV bytes moved between members", tags)
        self._fetched = metrics.Counter(
            "raykv_fetched_bytes",
            "KV bytes readers received (verified), per transport that carried them",
            ("component", "model", "transport"),
        )
        self._corrupt = metrics.Counter(
            "raykv_checksum_errors", "Copies whose bytes failed their checksum (misses)", tags
        )
        self._failed = metrics.Counter(
            "raykv_failed_copies", "Copies that found their peer gone (misses)", tags
        )
        self._reclaimed = metrics.Counter(
            "raykv_reclaimed_leases",
            "CPU-tier leases and reservations reclaimed: past their deadline (expired) or "
            "with their holder gone (released)",
            (*tags, "why"),
        )
        self._used = metrics.Gauge("raykv_blocks_used", "Blocks holding KV", tags)
        self._failures = metrics.Counter(
            "raykv_handled_failures",
            "Failures a component handled without failing its caller (each one is logged)",
            ("component", "what"),
        )
        self._latency = metrics.Histogram(
            "raykv_lookup_latency_ms", "Coordinator lookup latency", _LATENCY_BOUNDS, tags
        )
        # engines' counts per tenant (``tenant_label``: "none" for requests without one)
        self.tenants: dict[str, Tally[str]] = {}
        per_tenant = ("component", "model", "tenant")
        self._tenant = {
            what: metrics.Counter(f"raykv_tenant_{what}", about, per_tenant)
            for what, about in (
                ("lookups", "Engine lookups, per tenant"),
                ("hit_blocks", "Blocks engine lookups found, per tenant"),
                ("miss_blocks", "Blocks engine lookups did not find, per tenant"),
                ("stored_entries", "CPU-tier entries engines stored, per tenant"),
                ("quota_refused", "New CPU-tier entries a store left out over its tenant's quota"),
                ("quota_evicted", "A tenant's own CPU-tier entries its store evicted over quota"),
                ("disk_quota_refused", "Disk-tier entries a demotion left out over quota"),
                ("disk_quota_evicted", "A tenant's own disk-tier entries dropped over quota"),
                ("object_quota_refused", "Object-tier entries an upload left out over quota"),
                ("object_quota_evicted", "A tenant's own object-tier entries deleted over quota"),
            )
        }
        # per tier ("cpu", "disk", "object"): the bytes-held gauge, and per model the
        # labels whose gauge is not 0
        self._tenant_bytes = {
            tier: metrics.Gauge(f"raykv_tenant_{pre}bytes_held", about, per_tenant)
            for tier, pre, about in (
                ("cpu", "", "CPU-tier bytes a tenant's entries hold"),
                ("disk", "disk_", "Disk-tier bytes a tenant's entries hold"),
                ("object", "object_", "Object-tier bytes a tenant's objects hold in the bucket"),
            )
        }
        # per tier, model -> the labels whose bytes-held gauge is not 0
        self._gauged: dict[str, dict[str, set[str]]] = {tier: {} for tier in self._tenant_bytes}

    def _tags(self, model: str, tier: str) -> dict[str, str]:
        return {"component": self.component, "model": model, "tier": tier}

    def hit(self, model: str, tier: str, n: int) -> None:
        if n:
            self.tally[f"hits_{tier}"] += n
            self._hits.inc(n, self._tags(model, tier))

    def miss(self, model: str, tier: str, n: int) -> None:
        if n:
            self.tally[f"misses_{tier}"] += n
            self._misses.inc(n, self._tags(model, tier))

    def evicted(self, model: str, tier: str, n: int) -> None:
        if n:
            self.tally["evictions"] += n
            self._evictions.inc(n, self._tags(model, tier))

    def offloaded(self, model: str, n: int) -> None:
        if n:
            self.tally["offloads"] += n
            self._offloads.inc(n, self._tags(model, "cpu"))

    def moved(self, model: str, tier: str, nbytes: int) -> None:
        if nbytes:
            self.tally["bytes_moved"] += nbytes
            self._moved.inc(nbytes, self._tags(model, tier))

    def fetched(self, model: str, transport: str, nbytes: int) -> None:
        """Bytes this reader received over ``transport`` (``raykv.transport.select``'s names,
        or ``ARENA``), counted once, by the reader (``fetch_over``'s ``carried``)."""
        if nbytes:
            self.tally[f"fetched_bytes_{transport}"] += nbytes
            self._fetched.inc(nbytes, {"component": self.component, "model": model,
                                       "transport": transport})  # fmt: skip

    def checksum_errors(self, model: str, tier: str, n: int) -> None:
        """Copies found corrupt (dropped, served as misses, never as KV), each counted once,
        by where it was found: ``tier`` "gpu", "cpu" or "remote"
        (``raykv.service.pool.dataplane``)."""
        if n:
            self.tally["checksum_errors"] += n
            self.tally[f"checksum_errors_{tier}"] += n
            self._corrupt.inc(n, self._tags(model, tier))

    def copy_failed(self, model: str, tier: str, what: str) -> None:
        """A copy that could not run (its peer gone): logged by the caller, a miss."""
        self.tally[f"failed_{what}"] += 1
        self._failed.inc(1, self._tags(model, tier))

    def reclaimed(self, model: str, tier: str, n: int, why: str) -> None:
        """Leases / reservations the tier took back: ``why`` is "expired" or "released"."""
        if n:
            self.tally[f"reclaimed_{why}"] += n
            self._reclaimed.inc(n, {**self._tags(model, tier), "why": why})

    def used(self, model: str, tier: str, n: int) -> None:
        self._used.set(n, self._tags(model, tier))

    def failed(self, what: str) -> None:
        """Count a failure that was handled (and logged) instead of raised: ``what`` names
        the step, e.g. ``coordinator_call`` or ``health_tick``."""
        self.tally[f"failures_{what}"] += 1
        self._failures.inc(1, {"component": self.component, "what": what})

    def engine_counts(
        self,
        model: str,
        tenant: str,
        lookups: int,
        hit_blocks: int,
        miss_blocks: int,
        stored_entries: int,
    ) -> None:
        """Lookups engines answered from this node's index replica and entries they stored
        (``raykv.engine``), of one tenant (``tenant_label``)."""
        self.tally["engine_lookups"] += lookups
        self.tally["engine_hit_blocks"] += hit_blocks
        self.tally["engine_miss_blocks"] += miss_blocks
        if hit_blocks:
            self._hits.inc(hit_blocks, self._tags(model, "replica"))
        if miss_blocks:
            self._misses.inc(miss_blocks, self._tags(model, "replica"))
        label = self._tenant_label(tenant)
        counts = self.tenants.setdefault(label, Tally())
        tags = {"component": self.component, "model": model, "tenant": label}
        for what, n in (
            ("lookups", lookups),
            ("hit_blocks", hit_blocks),
            ("miss_blocks", miss_blocks),
            ("stored_entries", stored_entries),
        ):
            if n:
                counts[what] += n
                self._tenant[what].inc(n, tags)

    def _tenant_label(self, tenant: str) -> str:
        """``tenant`` while fewer than ``MAX_TENANTS`` tenants are counted apart, else
        "other"; so is anything that is not a ``tenant_label`` (no raw salt ever becomes a
        label). Requests without a tenant ("none") are always counted apart."""
        if tenant in self.tenants or tenant == "none":
            return tenant
        well_formed = len(tenant) == TENANT_LABEL_CHARS and _HEX.issuperset(tenant)
        if not well_formed or len(self.tenants.keys() - {"none", OTHER_TENANTS}) >= MAX_TENANTS:
            return OTHER_TENANTS
        return tenant

    def tenant_quota(
        self,
        model: str,
        tenant: str,
        refused: int,
        evicted: int,
        tier: str = "cpu",
    ) -> None:
        """A store of ``tenant`` (``tenant_label``) over its quota (invariant 13): new entries
        it left out, and its own entries it evicted to stay within the quota; ``tier``
        "disk": the disk tier's quota, over which demotions left entries out and dropped its
        own; "object": the object tier's, over which uploads left entries out and deleted the
        tenant's own objects' entries."""
        label = self._tenant_label(tenant)
        counts = self.tenants.setdefault(label, Tally())
        tags = {"component": self.component, "model": model, "tenant": label}
        pre = "" if tier == "cpu" else f"{tier}_"
        for what, n in ((f"{pre}quota_refused", refused), (f"{pre}quota_evicted", evicted)):
            if n:
                counts[what] += n
                self._tenant[what].inc(n, tags)

    def tenant_bytes(self, held: dict[str, dict[str, int]], tier: str = "cpu") -> None:
        """The bytes each tenant label's entries hold now, per model (``{model: {label:
        bytes}}``): the ``raykv_tenant_bytes_held`` gauge per model (back to 0 for a tenant
        that holds nothing now) and ``tenants``' ``bytes_held`` over every model; ``tier``
        "disk": the disk tier's (``raykv_tenant_disk_bytes_held``, ``disk_bytes_held``);
        "object": the object tier's, in the bucket (``raykv_tenant_object_bytes_held``,
        ``object_bytes_held``)."""
        gauge, gauged = self._tenant_bytes[tier], self._gauged[tier]
        key = "bytes_held" if tier == "cpu" else f"{tier}_bytes_held"
        total: Tally[str] = Tally()
        for model in [*held, *(gauged.keys() - held.keys())]:  # a model gone: 0s
            now: Tally[str] = Tally()
            for tenant, n in held.get(model, {}).items():
                label = self._tenant_label(tenant)
                self.tenants.setdefault(label, Tally())
                now[label] += n
            gone = gauged.get(model, set()) - now.keys()
            for label in [*now, *gone]:
                tags = {"component": self.component, "model": model, "tenant": label}
                gauge.set(now.get(label, 0), tags)
            gauged[model] = set(now)
            total.update(now)
        for label, counts in self.tenants.items():
            if total.get(label) or counts.get(key):
                counts[key] = total.get(label, 0)

    def lookup_ms(self, model: str, ms: float) -> None:
        self.tally["lookups"] += 1
        self._latency.observe(ms, self._tags(model, "all"))

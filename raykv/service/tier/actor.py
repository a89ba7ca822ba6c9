"""CpuTierActor: the CPU tier of one node (pinned to it), one ``raykv.tiers.CpuTier`` arena
per served model, in shared memory (``raykv.tiers.shm``).

An entry is one chunk (``raykv.service.groups``): ``block_size_factor`` GPU blocks of one
group, keyed by its last block's key, holding every distinct TP copy (invariant 5: the
arena is sized from the plan, ``cpu_num_blocks x cpu_bytes_per_block``). Null sub-slots
carry nothing. Outside, the tier answers per GPU-block key: it publishes the key of every
block an entry carries, so a lookup or a load never needs to know how blocks were chunked.

This actor moves no bytes of its own node's pools and engines: it keeps the arena's
metadata (the ``CpuTier`` state machine, checksums, the key -> entry map) and hands out
reservations and leases; the pools, their TP ranks and attached engines map the arena
(``CpuTierView``) and run ``raykv.tiers.OffloadEngine`` jobs on it themselves, then send the
engine's queued metadata calls back in one ``apply``. So the store/load path, the checksums
(computed on every store, verified before every load, invariant 12) and the arena
addressing are ``raykv.tiers``' alone. Other nodes fetch through ``raykv.transport``
(``export_blocks``): the rows go out with the checksums they were stored with, and the
receiver verifies them. A corrupt entry found by anyone is dropped (``apply`` / ``drop_keys``)
and counted once (``checksum_errors``: here, "cpu", when a pool or engine of this node found
it loading; by the reader, "remote", when it came from here to another member); it is a
miss from then on.

Every reservation and lease names its holder (``raykv.tiers.holds``: the asking
process) and ends at a deadline, ``RAYKV_LEASE_TIMEOUT_S`` seconds (default 60) after it was
taken: a sweep every ``SWEEP_S`` reclaims holds past their deadline and releases at once
those of holders that exited (``reserve`` also reclaims overdue holds first), and a holder
that detaches releases its own (``release_holder``). A late finish of a reclaimed hold
changes nothing, and a reader that copied reclaimed entries sees their generation changed
(``raykv.tiers.cpu_tier``): a miss, never wrong KV. Counted per tier as ``leases_expired``,
``leases_released`` and ``late_finishes`` (``raykv status``).

With ``RAYKV_DISK_PATH`` and ``RAYKV_DISK_BYTES`` in the node's environment (``raykv up
--disk-path --disk-bytes`` sets them on a head it starts), each model also has a disk tier
below its arena (``raykv.tiers.disk_tier``, in ``<path>/<model>``; the bytes are the node's,
split equally between its models: ``NodeDisk``): the entries the arena
evicts are demoted to it and stay published (lookups count them as this node's CPU tier),
and a lease of entries that are only on disk promotes them first (read and verified in a
worker thread, then stored in the arena as a normal store), so the load path is the CPU
tier's. Keys the disk tier loses (its slab evicted, corrupt, torn) leave the index with the
next apply. A tier placed again (restarted) rebuilds its disk index from the slab headers and
publishes those entries as it registers. A full disk tier admits an entry only if the CPU
tier's stores and leases used it more than the slab it would evict (``DiskTier.record``).

With ``RAYKV_TENANT_QUOTAS`` (``raykv up --tenant-quota``, ``raykv.tiers.quotas``) each
model's arena bounds the bytes each tenant's entries hold: an engine's reserve, pull and
promotion carry the request's tenant, and a store over its quota evicts only that tenant's
entries (invariant 13); bytes held per tenant are in ``stats`` and the
``raykv_tenant_bytes_held`` gauge (set every sweep). With ``RAYKV_DISK_TENANT_QUOTAS`` (``raykv
up --disk-tenant-quota``, the same syntax) each model's disk tier bounds them too: the arena
hands each demoted entry's tenant down, and a demotion over its quota drops only that
tenant's disk entries (``raykv.tiers.disk_tier``); the disk tier's bytes and counts per
tenant are in its ``stats`` (``per_model``'s ``disk``) and, each sweep, in the metrics
(``raykv_tenant_disk_bytes_held``, ``raykv_tenant_disk_quota_*``).

With ``RAYKV_OBJECT_URL`` (``s3://bucket/prefix``; ``RAYKV_OBJECT_ENDPOINT`` for a server
other than AWS; ``raykv up --object-url --object-endpoint``) each model also has an object
tier (``raykv.tiers.object_tier``) below its lowest tier: the disk tier's evicted slabs are
uploaded as they are, or, without a disk tier, the arena's evictions are. Its entries stay
published like the disk's and are promoted the same way on a lease; a lease of blocks past
what the node holds also looks for pointers in the bucket (another node's or cluster's
uploads) and promotes what it finds. With ``RAYKV_OBJECT_TENANT_QUOTAS`` (``raykv up
--object-tenant-quota``, the same syntax) the object tier bounds each tenant's bytes in the
bucket (every node's and cluster's objects of the model together): an upload over its quota
deletes only that tenant's oldest objects; its bytes and counts per tenant are in its
``stats`` (``per_model``'s ``object``) and, each sweep, in the metrics
(``raykv_tenant_object_bytes_held``, ``raykv_tenant_object_quota_*``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import operator
import os
import pickle
import re
from collections.abc import Coroutine, Hashable, Sequence
from itertools import filterfalse, repeat
from typing import TYPE_CHECKING, Any

import numpy as np

from raykv.blocks.hashing import Tenant, tenant_label
from raykv.errors import ConfigError, InvalidInput, RaykvError
from raykv.service.control.index import CPU
from raykv.service.control.metrics import ServiceMetrics
from raykv.service.groups import check_servable, key_group, row_widths
from raykv.service.member import Membership
from raykv.service.node.agent import AgentServer
from raykv.service.node.replica import ReplicaSpec, ReplicaWriter, replica_slots
from raykv.service.served import NAMESPACE, tier_name
from raykv.service.transports import reader_transports
from raykv.tiers import holds, shm
from raykv.tiers.cpu_tier import READABLE, KeyRows, KeySums
from raykv.tiers.quotas import DISK_QUOTAS_ENV, OBJECT_QUOTAS_ENV, TenantQuotas, tenant_quotas
from raykv.transport import Lent, export_rows

if TYPE_CHECKING:
    from raykv.tiers.disk_tier import NodeDisk
    from raykv.tiers.object_tier import ObjectSettings

Members = tuple[bytes | None, ...]
log = logging.getLogger(__name__)
LEASE_TIMEOUT_ENV = "RAYKV_LEASE_TIMEOUT_S"
DISK_PATH_ENV, DISK_BYTES_ENV = "RAYKV_DISK_PATH", "RAYKV_DISK_BYTES"
DISK = "disk"  # the metrics' tier label of disk-tier promotions and checksum errors
OBJECT_URL_ENV, OBJECT_ENDPOINT_ENV = "RAYKV_OBJECT_URL", "RAYKV_OBJECT_ENDPOINT"
OBJECT = "object"  # the metrics' tier label of object-tier promotions and checksum errors
SWEEP_S = 1.0  # how often overdue holds and exited holders are looked for
FEED_S = 0.05  # how often the node's replicas ask the coordinator what changed
SWEEP_LIMIT = 4096  # holds reclaimed per model and sweep at most (bounded work)


def lease_timeout_s() -> float:
    """Seconds a CPU-tier lease or reservation may stay unfinished (``RAYKV_LEASE_TIMEOUT_S``,
    default ``raykv.tiers.holds.DEFAULT_TIMEOUT_S``)."""
    from raykv.tiers.holds import DEFAULT_TIMEOUT_S, check_timeout

    return check_timeout(os.environ.get(LEASE_TIMEOUT_ENV, DEFAULT_TIMEOUT_S), LEASE_TIMEOUT_ENV)


@dataclasses.dataclass(frozen=True)
class DiskSettings:
    """Where this node's disk tier keeps its slabs, and how many bytes its models' slabs may
    use together (``raykv.tiers.disk_tier.NodeDisk`` splits them)."""

    path: str
    nbytes: int


def disk_settings() -> DiskSettings | None:
    """The node's disk tier from ``RAYKV_DISK_PATH`` and ``RAYKV_DISK_BYTES`` (both or
    neither; the bytes as ``raykv up`` reads sizes: 100GiB, 4096); None: no disk tier."""
    from raykv.layout.report import parse_size

    path, nbytes = os.environ.get(DISK_PATH_ENV, ""), os.environ.get(DISK_BYTES_ENV, "")
    if not path and not nbytes:
        return None
    if not (path and nbytes):
        raise ConfigError(
            f"{DISK_PATH_ENV}={path!r} and {DISK_BYTES_ENV}={nbytes!r}: set both for a disk "
            "tier (raykv up --disk-path DIR --disk-bytes N), or neither"
        )
    return DiskSettings(path, parse_size(nbytes))


def object_settings() -> ObjectSettings | None:
    """The node's object tier from ``RAYKV_OBJECT_URL`` (and ``RAYKV_OBJECT_ENDPOINT``, an
    S3-compatible server's URL; unset: AWS); None: no object tier."""
    from raykv.tiers.object_tier import ObjectSettings

    url, endpoint = os.environ.get(OBJECT_URL_ENV, ""), os.environ.get(OBJECT_ENDPOINT_ENV, "")
    if not url:
        if endpoint:
            raise ConfigError(
                f"{OBJECT_ENDPOINT_ENV}={endpoint!r} without {OBJECT_URL_ENV}: set "
                f"{OBJECT_URL_ENV}=s3://BUCKET/PREFIX too (raykv up --object-url), or neither"
            )
        return None
    return ObjectSettings.parse(url, endpoint or None)


def _model_dir(model: str) -> str:
    """A model's folder under the disk path: its name made safe, and a digest of it (two
    names that read the same once made safe stay apart)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model)[:64]
    return f"{safe}-{hashlib.sha256(model.encode()).hexdigest()[:8]}"


class _Own:
    """``OWN``: an entry that is its own only member, ``(entry,)``, and a block held by its
    own entry alone, at sub-slot 0 (``{key: 0}``): every entry of a plan without a
    block-size factor. One shared marker instead of a tuple or dict per key, so that a
    store's or a load's thousands of keys are a few passes of C over the dicts (issue 45)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "OWN"


OWN = _Own()


class _ModelTier:
    """One model's arena plus the block-key -> (entry key, sub-slot) map."""

    def __init__(
        self,
        plan: Any,
        timeout_s: float,
        model: str = "",
        disk: NodeDisk | None = None,
        quotas: TenantQuotas | None = None,
        objects: ObjectSettings | None = None,
        object_quotas: TenantQuotas | None = None,
    ) -> None:
        from raykv.tiers.cpu_tier import CpuTier
        from raykv.tiers.disk_tier import model_identity
        from raykv.tiers.object_tier import ObjectTier

        check_servable(plan)
        self.plan = plan
        self.disk = None
        self.objects = None
        self.read_buffer = np.empty(0, np.uint8)  # promotions read into it (``_promote``)
        self.promoting = asyncio.Lock()
        identity = model_identity(model, plan)
        if objects is not None:  # below the disk tier: what it evicts is uploaded
            self.objects = ObjectTier(objects, plan, identity, quotas=object_quotas)
        if disk is not None:
            evict = self.objects.upload_file if self.objects is not None else None
            self.disk = disk.open(_model_dir(model), plan, identity, on_evict=evict)
        # the tier right below the arena: what it evicts is demoted to it
        self.below = self.disk if self.disk is not None else self.objects
        self.tier = CpuTier(plan, "lru", shared=True, lease_timeout_s=timeout_s,
                            demote=self._demote if self.below is not None else None,
                            quotas=quotas)  # fmt: skip
        spec = ReplicaSpec("", replica_slots())
        buf, shared = shm.create((spec.nbytes,), "replica")
        # the node's engines answer lookups from it (``raykv.service.node.replica``)
        self.replica = ReplicaWriter(buf.numpy(), ReplicaSpec(shared.path, spec.slots))
        self.replica_shm = shared
        self.reclaimed = (0, 0)  # (expired, released) holds already counted in the metrics
        # the disk tier's counts over quota per tenant label already in the metrics
        self.disk_over_quota: dict[str, list[int]] = {}
        self.object_over_quota: dict[str, list[int]] = {}  # the object tier's
        self.widths = {g.group_id: w for g, w in zip(plan.groups, row_widths(plan), strict=True)}
        # entry key -> its members; block key -> {entry key: sub-slot}; entries being
        # written -> their members (``OWN`` for ``(entry,)`` and ``{key: 0}`` alike)
        self.entries: dict[bytes, Members | _Own] = {}
        self.where: dict[bytes, dict[bytes, int] | _Own] = {}
        self.pending: dict[bytes, Members | _Own] = {}
        self.unpublished: list[bytes] = []  # evicted block keys the index still lists
        if self.disk is not None:  # what a tier before this one left on disk: held again
            kept = self.disk.entries()
            self.note_all([k for k, _ in kept], [OWN if m == (k,) else m for k, m in kept])

    def _demote(
        self,
        entries: list[bytes],
        blocks: np.ndarray,
        valid: KeyRows,
        sums: KeySums,
        tenants: list[Tenant],
    ) -> None:
        """The arena evicts ``entries`` (of ``tenants``, whose disk quotas they count
        against): their rows go to the disk tier (``CpuTier``'s ``demote``). A failure here
        must not fail the store that evicted them: logged, and those entries leave the index
        as plain evictions."""
        try:
            known = [i for i, e in enumerate(entries) if e in self.entries]
            if len(known) < len(entries):  # not noted (never the rule): plain evictions
                entries, blocks = [entries[i] for i in known], blocks[known]
                valid = KeyRows(valid.values[known], valid.lengths[known])
                sums = KeySums(sums.sums[:, known], sums.lengths[:, known])
                tenants = [tenants[i] for i in known]
            members = [(e,) if m is OWN else m for e, m in zip(entries, map(self.entries.get,
                       entries), strict=True)]  # fmt: skip
            widths = [self.widths[key_group(e)] for e in entries]
            self.below.demote(entries, self.tier.arena, blocks, valid, sums, widths, members,
                              tenants=tenants)  # fmt: skip
        except Exception as e:
            log.warning("tier below the CPU tier: demoting %d entries failed: %r", len(entries), e)

    def held_below(self, entry: bytes) -> bool:
        """Whether the disk or object tier holds ``entry``."""
        return (self.disk is not None and entry in self.disk) or (
            self.objects is not None and entry in self.objects
        )

    def evicted(self, entries: Sequence[bytes]) -> list[bytes]:
        """The arena evicted ``entries``: those the tiers below did not take are forgotten;
        returns the block keys no entry holds any more."""
        if self.below is not None:
            entries = [e for e in entries if not self.held_below(e)]
        return self.forget_all(entries)

    def object_stats(self) -> dict[str, Any]:
        """The object tier's counts (``quota_refused`` / ``quota_evicted``: entries over a
        tenant's object quota), the entries it knows it holds, the bytes in the bucket per
        tenant label with a quota (every node's objects, as last listed) and the counts over
        quota per label ([refused, own deleted])."""
        o = self.objects
        return dataclasses.asdict(o.stats) | {"entries": len(o), "bucket": o.settings.bucket,
                                              "tenant_bytes": o.tenant_bytes(),
                                              "quota_counts": o.over_quota()}  # fmt: skip

    def disk_stats(self) -> dict[str, Any]:
        """The disk tier's counts (``quota_refused`` / ``quota_evicted``: over a tenant's
        disk quota), entries, slabs, bytes, bytes per tenant label, the counts over quota per
        label ([refused, own evicted]) and whether it writes O_DIRECT."""
        d = self.disk
        held = {"entries": len(d), "slabs": d.num_slabs, "bytes_used": d.used_bytes,
                "tenant_bytes": d.tenant_bytes(),
                "quota_counts": d.over_quota()}  # fmt: skip
        return dataclasses.asdict(d.stats) | held | {"direct": d.direct}

    def lost_below(self) -> list[bytes]:
        """Entries the tiers below lost (evicted with a slab and not uploaded, corrupt, torn)
        and the arena does not hold are forgotten; returns the block keys no entry holds any
        more."""
        if self.below is None:
            return []
        gone = [*(self.disk.take_gone() if self.disk is not None else ()),
                *(self.objects.take_gone() if self.objects is not None else ())]  # fmt: skip
        gone = [e for e in dict.fromkeys(gone) if e not in self.pending and not self.held_below(e)]
        states = self.tier.states(gone)
        return self.forget_all([e for e, s in zip(gone, states, strict=True) if s is None])

    def holders(self, key: bytes) -> dict[bytes, int]:
        """{entry: sub-slot} of the entries holding block ``key`` (empty: none)."""
        held = self.where.get(key)
        if held is OWN:
            return {key: 0}
        return {} if held is None else held

    def forget(self, entry: bytes) -> list[bytes]:
        """Drop an evicted entry's members; returns block keys no entry holds any more."""
        return self.forget_all((entry,))

    def forget_all(self, entries: Sequence[bytes]) -> list[bytes]:
        """``forget`` of each of ``entries`` in turn: entries that are their own only member
        and blocks their own entry alone held (the rule) in a few passes of C."""
        popped = list(map(self.entries.pop, entries, repeat(())))
        where, n = self.where, len(entries)
        # each its own member (a key named twice pops () the second time), held alone
        if popped.count(OWN) == n and list(map(where.get, entries)).count(OWN) == n:
            list(map(where.pop, entries))  # no entry holds any of them now
            return list(entries)
        gone = []
        for entry, members in zip(entries, popped, strict=True):
            for s, m in enumerate((entry,) if members is OWN else members):
                held = where.get(m) if m is not None else None
                if held is OWN:
                    held = where[m] = {m: 0}
                if held is not None and held.pop(entry, None) == s and not held:
                    del where[m]
                    gone.append(m)
        return gone

    def note(self, entry: bytes, members: Members | _Own) -> list[bytes]:
        """Record a stored entry; returns block keys that became available."""
        return self.note_all([entry], [members])

    def note_all(self, entries: Sequence[bytes], members: list[Members | _Own]) -> list[bytes]:
        """``note`` of each entry with its members, in turn; entries that are their own
        only member, all new to ``where`` (a store's, as a rule), in a few passes of C."""
        self.entries.update(zip(entries, members, strict=True))
        where, n = self.where, len(entries)
        if members.count(OWN) == n and where.keys().isdisjoint(entries):
            before = len(where)
            where.update(zip(entries, repeat(OWN)))
            return list(entries) if len(where) - before == n else list(dict.fromkeys(entries))
        new = []
        for entry, ms in zip(entries, members, strict=True):
            for s, m in enumerate((entry,) if ms is OWN else ms):
                if m is None:
                    continue
                held = where.get(m)
                if held is None:
                    held = where[m] = {}
                elif held is OWN:
                    held = where[m] = {m: 0}
                if not held:
                    new.append(m)
                held[entry] = s
        return new

    def choose(self, keys: list[bytes]) -> list[tuple[bytes, int]]:
        """(entry, sub-slot) of the leading ``keys`` (one group) held here."""
        return _pairs(keys, self.holding(keys))

    def holding(self, keys: Sequence[bytes]) -> list[dict[bytes, int] | _Own]:
        """``where`` of the leading ``keys`` held here (those of ``keys[0]``'s group, up to
        the first not held): the lookups in C, the group compared on the keys' prefixes."""
        held = list(map(self.where.get, keys))
        if None in held:
            held = held[: held.index(None)]
        if held.count(OWN) < len(held) and {} in held:  # an empty holder dict: not held
            held = held[: held.index({})]
        return held[: _group_run(keys[: len(held)])]


def _entries_of(
    mt: _ModelTier | None, keys: Sequence[bytes]
) -> tuple[bool, Sequence[bytes] | list[tuple[bytes, int]], list[bytes]]:
    """For one group's leading ``keys`` held here: (each block its own entry's, at sub-slot
    0: the rule; the chosen blocks: their keys in that case, else (entry, sub-slot) pairs;
    the distinct entries, in order)."""
    held = mt.holding(keys) if mt is not None and keys else []
    own = held.count(OWN) == len(held)
    chosen = keys[: len(held)] if own else _pairs(keys, held)
    return own, chosen, list(dict.fromkeys(chosen if own else map(_FIRST, chosen)))


def _pairs(keys: Sequence[bytes], held: list[dict[bytes, int] | _Own]) -> list[tuple[bytes, int]]:
    """(entry, sub-slot) of each leading key by its ``where`` (``held``): the first holder."""
    return [(k, 0) if h is OWN else next(iter(h.items())) for k, h in zip(keys, held, strict=False)]


def _group_run(keys: Sequence[bytes]) -> int:
    """How many leading ``keys`` are of ``keys[0]``'s group (``key_group``): keys of one
    length (as a rule) compared on their 4-byte prefixes in one numpy pass, others in C,
    ``key_group`` itself only from a prefix that differs on."""
    if not keys:
        return 0
    n, width = len(keys), len(keys[0])
    if width >= 4 and list(map(len, keys)).count(width) == n:
        rows = np.frombuffer(b"".join(keys), np.uint8).reshape(n, width)[:, :4]
        other = (rows != rows[0]).any(axis=1)
        n = int(other.argmax()) if other.any() else n
    elif width >= 4:
        same = list(map(keys[0][:4].__eq__, map(_PREFIX, keys)))
        n = same.index(False) if False in same else n
    else:
        n = 1
    gid = key_group(keys[0])
    while n < len(keys) and key_group(keys[n]) == gid:  # a shorter key of the same id
        n += 1
    return n


_PREFIX = operator.itemgetter(slice(0, 4))
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_KEY_BITS = operator.itemgetter(1, 2)  # a feed change's (group key, bits)


class CpuTierActor:
    """The node's CPU tier actor (see the module docstring); a member of the coordinator's
    cluster through its ``member`` part, the node agent's host through ``agent``."""

    kind = "tier"

    def __init__(self, node_id: str, plans: dict[str, Any] | None = None) -> None:
        self.name, self.node_id = tier_name(node_id), node_id
        self.timeout_s = lease_timeout_s()
        from raykv.tiers.disk_tier import NodeDisk

        self.disk = disk_settings()
        self.quotas = tenant_quotas()  # RAYKV_TENANT_QUOTAS (raykv up --tenant-quota)
        # RAYKV_DISK_TENANT_QUOTAS (raykv up --disk-tenant-quota): the disk tier's own
        self.disk_quotas = tenant_quotas(name=DISK_QUOTAS_ENV) if self.disk else None
        self.objects = object_settings()
        # RAYKV_OBJECT_TENANT_QUOTAS (raykv up --object-tenant-quota): the object tier's own
        self.object_quotas = tenant_quotas(name=OBJECT_QUOTAS_ENV) if self.objects else None
        # one budget for the node's disk, shared by its models' disk tiers (``NodeDisk``)
        self.node_disk = (
            NodeDisk(self.disk.path, self.disk.nbytes, self.disk_quotas) if self.disk else None
        )
        # the served models' arenas from the start: a tier placed again after it died must
        # take its node's offloads before it registers (its pools added them to the old one),
        # and registers with what its disk tier holds
        self.tiers = {m: _ModelTier(p, self.timeout_s, m, self.node_disk, self.quotas,
                                    self.objects, self.object_quotas)
                      for m, p in (plans or {}).items()}  # fmt: skip
        self.metrics = ServiceMetrics("tier")
        # its UCX server sends from the arena where it can (``export_blocks``: lends rows)
        self.member = Membership(
            self.name, node_id, self.kind, self.metrics, self, self.export_blocks, lends_rows=True
        )
        self._publishing: set[asyncio.Task] = set()
        self.transports = reader_transports()  # for pull: the object store, UCX where it runs
        self.pull_sources: dict[str, Any] = {}  # model -> where its last pull was sent first
        self._sweeper: asyncio.Task | None = None
        self.agent = AgentServer(self, NAMESPACE)  # engines on this node talk to it
        self._follower: asyncio.Task | None = None
        self._feed: tuple[str, int] = ("", 0)  # (epoch, since) of the coordinator's feed

    async def start(self) -> str:
        name = await self.member.start()
        if self._sweeper is None:
            loop = asyncio.get_running_loop()
            self._sweeper = loop.create_task(self._sweeps())
            self._follower = loop.create_task(self._follow_index())
            try:
                log.info("tier %s: node agent at %s", self.name, await self.agent.start())
            except (OSError, RaykvError) as e:  # pools still use the tier; engines cannot
                log.error("tier %s: no node agent (%r): engines here run without raykv",
                          self.name, e)  # fmt: skip
                self.metrics.failed("agent_start")
        return name

    # --- the node's index replica ---------------------------------------------------------

    def replica_spec(self, model: str) -> ReplicaSpec | None:
        mt = self.tiers.get(model)
        return None if mt is None else mt.replica.spec

    async def _follow_index(self) -> None:
        """Keep every model's replica current with the coordinator's change feed."""
        while True:
            await asyncio.sleep(FEED_S)
            try:
                answer = await self.member.call("index_changes", *self._feed, self.node_id)
                if answer is None:
                    continue
                epoch, since, resync, changes = pickle.loads(answer)
                if resync:
                    for mt in self.tiers.values():
                        mt.replica.clear_holders()
                by_model: dict[str, list[tuple[bytes, int]]] = {}
                models = set(map(_FIRST, changes))
                if len(models) == 1:  # one model (the rule): its changes in C, as they came
                    by_model[models.pop()] = list(map(_KEY_BITS, changes))
                else:
                    for model, key, bits in changes:
                        by_model.setdefault(model, []).append((key, bits))
                for model, batch in by_model.items():
                    mt = self.tiers.get(model)
                    if mt is not None:
                        mt.replica.set_holders(batch)
                self._feed = (epoch, since)
            except Exception as e:  # never let the loop die: the next poll resyncs
                log.warning("tier %s: following the index failed: %r", self.name, e)
                self.metrics.failed("index_feed")
                self._feed = ("", 0)

    def publish(
        self, model: str, stored: list[tuple[Hashable, int]], removed: list[Hashable]
    ) -> Coroutine[Any, Any, None]:
        """``Membership.publish`` (to the coordinator: returned, to await or run as a task), after
        the node's replica took the change at once: an engine's lookup right after its store
        is answered sees it."""
        mt = self.tiers.get(model)
        if mt is not None:
            mt.replica.set_local(list(map(_FIRST, stored)), True)
            mt.replica.set_local(removed, False)
        return self.member.publish(model, stored, removed)

    async def add_model(self, model: str, plan: Any) -> int:
        """Make room for ``model`` (idempotent); returns its CPU-tier block count."""
        if model not in self.tiers:
            mt = self.tiers[model] = _ModelTier(plan, self.timeout_s, model, self.node_disk,
                                                self.quotas, self.objects,
                                                self.object_quotas)  # fmt: skip
            if mt.where:  # its disk tier's entries (a model added after the tier started)
                await self.publish(model, list(zip(mt.where, repeat(-1))), [])
        return self.tiers[model].tier.num_blocks

    async def remove_model(self, model: str) -> bool:
        """Forget ``model`` and free its arena (the coordinator withdrew a model whose pools
        could not be placed: ``Coordinator._withdraw``). False: it had none here."""
        mt = self.tiers.pop(model, None)
        if mt is not None:
            if self.node_disk is not None:  # its slabs go: the other models take its share
                self.node_disk.close(_model_dir(model))
            if mt.objects is not None:
                mt.objects.close()  # uploads what is queued; the objects stay
            mt.tier.release()
            shm.release(mt.replica_shm)
        return mt is not None

    # --- holds: deadlines and holders -----------------------------------------------------

    async def _sweeps(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                self.sweep()
            except Exception as e:  # never let the loop die: the next sweep tries again
                log.warning("tier %s: lease sweep failed: %r", self.name, e)
                self.metrics.failed("lease_sweep")

    def sweep(self) -> int:
        """Reclaim overdue holds (bounded per model) and the holds of holders that exited;
        returns how many holds were reclaimed."""
        n = 0
        for model, mt in self.tiers.items():
            n += mt.tier.reclaim(limit=SWEEP_LIMIT)
            for h in mt.tier.holders():
                if holds.gone(h):
                    got = mt.tier.release_holder(h)
                    log.warning("tier %s: %s exited holding %d leases of %s; released",
                                self.name, h, got, model)  # fmt: skip
                    n += got
            self._reclaimed(model, mt)
            if mt.disk is not None:  # the disk tier's demotions over quota since the last sweep
                mt.disk_over_quota = self._over_quota(model, mt.disk, mt.disk_over_quota, DISK)
            if mt.objects is not None:  # and the object tier's uploads
                mt.object_over_quota = self._over_quota(model, mt.objects,
                                                        mt.object_over_quota, OBJECT)  # fmt: skip
        self.metrics.tenant_bytes({m: mt.tier.tenant_bytes() for m, mt in self.tiers.items()})
        if self.node_disk is not None:
            self.metrics.tenant_bytes({m: mt.disk.tenant_bytes() for m, mt in self.tiers.items()
                                       if mt.disk is not None}, tier=DISK)  # fmt: skip
        if self.objects is not None:
            self.metrics.tenant_bytes({m: mt.objects.tenant_bytes() for m, mt in
                                       self.tiers.items() if mt.objects is not None},
                                      tier=OBJECT)  # fmt: skip
        return n

    def _over_quota(
        self, model: str, below: Any, was: dict[str, list[int]], tier: str
    ) -> dict[str, list[int]]:
        """The counts over quota per tenant label of the disk or object tier ``below`` since
        ``was`` (the last sweep's) into the metrics; returns them now."""
        now = below.over_quota()
        for label, (refused, evicted) in now.items():
            before = was.get(label, [0, 0])
            if [refused, evicted] != before:
                self.metrics.tenant_quota(model, label, refused - before[0],
                                          evicted - before[1], tier=tier)  # fmt: skip
        return now

    async def release_holder(self, holder: Any) -> int:
        """Release every lease and reservation ``holder`` still has (it detached or exited);
        their finishes, if they still come, change nothing. Returns how many."""
        n = 0
        for model, mt in self.tiers.items():
            n += mt.tier.release_holder(holder)
            self._reclaimed(model, mt)
        return n

    def _reclaimed(self, model: str, mt: _ModelTier) -> None:
        """Count reclaims since the last call; forget reclaimed reservations' members."""
        s = mt.tier.stats
        now = (s.expired_leases + s.expired_reservations, s.released_holds)
        if now == mt.reclaimed:
            return
        self.metrics.reclaimed(model, CPU, now[0] - mt.reclaimed[0], "expired")
        self.metrics.reclaimed(model, CPU, now[1] - mt.reclaimed[1], "released")
        mt.reclaimed = now
        pending = list(mt.pending)
        for k, state in zip(pending, mt.tier.states(pending), strict=True):
            if state is None:
                del mt.pending[k]  # its reservation was reclaimed: never published
        self.metrics.used(model, CPU, mt.tier.num_blocks - mt.tier.num_free)

    def _tier(self, model: str) -> _ModelTier:
        mt = self.tiers.get(model)
        if mt is None:
            raise InvalidInput(f"the CPU tier on node {self.node_id[:12]} holds no model {model!r}")
        return mt

    async def arena(self, model: str) -> Any:
        """The ``SharedSpec`` of ``model``'s arena: map it with ``CpuTierView``."""
        return self._tier(model).tier.arena_spec

    # --- stores: reserve here, copy in the writer's process, apply here -------------------

    async def reserve(
        self,
        model: str,
        keys: tuple[bytes, ...],
        members: tuple[Members, ...] | None,
        writers: int = 1,
        holder: Any = None,
        tenant: bytes | None = None,
    ) -> Any:
        """Reserve entries for ``keys`` (all or nothing; LRU evicts to make room; keys held
        already are skipped): (the arena's ``SharedSpec``, a ``StoreReservation`` for
        ``writers`` TP writers or None), ``holder``'s until applied or its deadline. The
        spec rides along so a writer never needs a call of its own to find (or re-find,
        after the tier was placed again) the arena. ``members``: each entry's block keys;
        None: each entry is one block, its own key (``(key,)`` each: an engine's store of a
        plan without a block-size factor sends no tuple per key). The reservation's
        ``evicted`` are forgotten and unpublished here, so it comes back without them.
        ``tenant``: the entries' (``tenant_key``): over its quota, its own entries go first
        and the last keys may be left out of the reservation (invariant 13)."""
        mt = self._tier(model)
        factor = mt.tier.factor
        if members is None:
            bad = factor != 1  # each entry one member
        else:
            bad = len(members) != len(keys) or any(len(m) != factor for m in members)
        if bad:
            raise InvalidInput(f"each stored entry of model {model!r} needs {factor} member keys")
        spec = mt.tier.arena_spec
        if mt.disk is not None:
            mt.disk.record(keys)
        s = mt.tier.stats
        before = (s.quota_refused, s.quota_evicted)
        res = mt.tier.prepare_store(keys, writers=writers, holder=holder, tenant=tenant)
        self._reclaimed(model, mt)  # overdue holds it reclaimed first, if any
        if (s.quota_refused, s.quota_evicted) != before:  # over the tenant's quota
            self.metrics.tenant_quota(model, tenant_label(tenant), s.quota_refused - before[0],
                                      s.quota_evicted - before[1])  # fmt: skip
        if res is None:
            return spec, None
        removed = mt.evicted(res.evicted) + mt.lost_below()
        self.metrics.evicted(model, CPU, len(res.evicted))
        if members is None or list(members) == list(zip(keys)):  # each its own member
            mt.pending.update(zip(res.keys, repeat(OWN)))
        elif res.keys == tuple(keys):  # every key new, none twice: as they came
            mt.pending.update(zip(keys, members, strict=True))
        else:
            member_of = dict(zip(keys, members, strict=True))
            mt.pending.update(zip(res.keys, map(member_of.__getitem__, res.keys), strict=True))
        # evicted keys leave the index with the next apply (off the writer's critical path);
        # until then a lookup may still name them here: a lease then misses, never wrong KV
        mt.unpublished += removed
        if res.evicted:  # done with here: the writer gets (and sends back) none of them
            kept = res.block_array
            res = dataclasses.replace(res, evicted=())
            res.__dict__["block_array"] = kept  # what ``block_array`` would compute
        return spec, res

    async def lease(
        self, model: str, keys: list[bytes], holder: Any = None, tenant: bytes | None = None
    ) -> tuple[Any, Any, list[tuple[int, int]]]:
        """Read references on the entries holding the leading block ``keys`` (one group),
        ``holder``'s until released or their deadline: (the arena's ``SharedSpec``,
        ``LoadLease`` or None, per block (entry index in the lease, sub-slot))."""
        mt = self.tiers.get(model)
        if mt is not None and mt.below is not None:
            await self._promote(model, mt, [keys], tenant)
        lease, chosen = self._lease(model, mt, keys, holder)
        spec = mt.tier.arena_spec if mt is not None else None
        return spec, lease, list(map(tuple, chosen.tolist()))

    def _lease(
        self, model: str, mt: _ModelTier | None, keys: Sequence[bytes], holder: Any
    ) -> tuple[Any, np.ndarray]:
        """``lease`` of one group's ``keys``: (``LoadLease`` or None, int64 [blocks, 2]: per
        block its entry's index in the lease and its sub-slot). The entries of a plan
        without a block-size factor are the keys themselves, so a 2048-key lease is a few
        passes of C and numpy, its answer arrays (no tuple per block to pickle; issue 45)."""
        own, chosen, entries = _entries_of(mt, keys)
        n = len(chosen)
        if entries and mt.disk is not None:
            mt.disk.record(entries)
        if entries and mt.below is not None:  # after ``_promote``: up to the first not readable
            ok = [st in READABLE for st in mt.tier.states(entries)]
            if not all(ok):
                entries = entries[: ok.index(False)]
                lead = set(entries)  # the blocks of the entries left: a shorter prefix
                n = next(i for i, c in enumerate(chosen) if (c if own else c[0]) not in lead)
                chosen = chosen[:n]
        lease = mt.tier.prepare_load(entries, holder=holder) if entries else None
        if lease is None:
            self.metrics.miss(model, CPU, len(keys))
            return None, np.empty((0, 2), np.int64)
        self.metrics.miss(model, CPU, len(keys) - n)
        self.metrics.hit(model, CPU, n)
        width = mt.widths[key_group(keys[0])]
        self.metrics.moved(model, CPU, n * width * mt.tier.copies)
        out = np.zeros((n, 2), np.int64)
        if len(entries) == n:  # each block a distinct entry's: block i's is entry i
            out[:, 0] = np.arange(n)
        else:
            at = dict(zip(lease.keys, range(len(lease.keys)), strict=True))
            out[:, 0] = np.fromiter(map(at.__getitem__, chosen if own else map(_FIRST, chosen)),
                                    np.int64, n)  # fmt: skip
        if not own:
            out[:, 1] = np.fromiter(map(_SECOND, chosen), np.int64, n)
        return lease, out

    async def _promote(
        self, model: str, mt: _ModelTier, groups: list[list[bytes]], tenant: bytes | None = None
    ) -> None:
        """Bring the entries a lease of ``groups`` (each one group's leading block keys)
        needs that only the disk or object tier holds into the arena: read and verified in a
        worker thread (the actor answers other calls meanwhile; one promotion of a model at a
        time, they share its read buffer), then stored as a normal store. What is lost or
        unreadable stays out: the lease stops before it. With an object tier, blocks past
        those the node holds are looked for in the bucket first (``_discover``). ``tenant``:
        whose entries they become (its quota, invariant 13)."""
        async with mt.promoting:
            for keys in groups:
                if mt.objects is not None:
                    await self._discover(model, mt, keys, tenant)
                entries = _entries_of(mt, keys)[2]
                states = mt.tier.states(entries)
                missing = [e for e, st in zip(entries, states, strict=True) if st is None]
                for below, label in ((mt.disk, DISK), (mt.objects, OBJECT)):
                    if below is None or not missing:
                        continue
                    # the disk's own, the rest from the bucket (by pointer if not indexed)
                    want = [e for e in missing if e in below] if below is mt.disk else missing
                    got = await self._read_below(model, mt, below, label, want)
                    if got is None:
                        continue
                    states = mt.tier.states(entries)  # stores and evictions ran meanwhile
                    here = [e for e, st in zip(entries, states, strict=True) if st is not None]
                    res = mt.tier.store_rows(got.keys, got.rows, got.valid, got.sums,
                                             beside=here, tenant=tenant)  # fmt: skip
                    if res is not None:
                        self.metrics.hit(model, label, len(res.keys))
                        self.metrics.evicted(model, CPU, len(res.evicted))
                        mt.unpublished += mt.evicted(res.evicted)
                    done = set(got.keys)
                    missing = [e for e in missing if e not in done]

    async def _read_below(
        self, model: str, mt: _ModelTier, below: Any, label: str, entries: list[bytes]
    ) -> Any:
        """``below.load`` of ``entries`` in a worker thread into the model's read buffer,
        its checksum errors counted; None: nothing read."""
        if not entries:
            return None
        errors = below.stats.checksum_errors
        if mt.read_buffer.nbytes < len(entries) * below.stride:
            mt.read_buffer = below.buffer(len(entries))  # kept: the next reuse it
        got = await asyncio.to_thread(below.load, entries, mt.read_buffer)
        self.metrics.checksum_errors(model, label, below.stats.checksum_errors - errors)
        return got if got.keys else None

    async def _discover(
        self, model: str, mt: _ModelTier, keys: list[bytes], tenant: bytes | None = None
    ) -> None:
        """The blocks of ``keys`` past those this node holds that pointers in the bucket name
        (another node's or cluster's uploads): read, verified, stored in the arena, noted
        and published as this node's, so the lease goes on through them."""
        held = len(mt.holding(keys))
        if held == len(keys) or mt.objects is None:
            return
        found = await asyncio.to_thread(mt.objects.find, keys[held:])
        entries = [e for e in dict.fromkeys(e for e, _ in found) if e not in mt.entries]
        got = await self._read_below(model, mt, mt.objects, OBJECT, entries)
        if got is None:
            return
        here = [e for e in _entries_of(mt, keys)[2] if mt.tier.state(e) is not None]
        res = mt.tier.store_rows(got.keys, got.rows, got.valid, got.sums, beside=here,
                                 tenant=tenant)  # fmt: skip
        if res is None:
            return
        self.metrics.hit(model, OBJECT, len(res.keys))
        self.metrics.evicted(model, CPU, len(res.evicted))
        mt.unpublished += mt.evicted(res.evicted)
        stored = set(res.keys)
        new = [(k, m) for k, m in zip(got.keys, got.members, strict=True) if k in stored]
        added = mt.note_all([k for k, _ in new], [OWN if m == (k,) else m for k, m in new])
        if added:
            await self.publish(model, list(zip(added, repeat(-1))), [])

    async def lease_groups(
        self,
        model: str,
        keys: list[list[bytes]],
        holder: Any = None,
        tenant: bytes | None = None,
    ) -> tuple[Any, list[tuple[Any, np.ndarray]]]:
        """``lease`` for every group at once (one round trip for a hybrid model's load):
        (the arena's ``SharedSpec``, per group (``LoadLease`` or None, int64 [blocks, 2]: per
        block its entry's index in the lease and its sub-slot)): an engine's load, through
        the node agent."""
        mt = self.tiers.get(model)
        spec = mt.tier.arena_spec if mt is not None else None
        if mt is not None and mt.below is not None:
            await self._promote(model, mt, keys, tenant)
        return spec, [self._lease(model, mt, gk, holder) for gk in keys]

    async def apply(
        self,
        model: str,
        ops: list[tuple],
        wait_publish: bool = True,
    ) -> int:
        """Apply the metadata calls an ``OffloadEngine`` on a ``CpuTierView`` queued; publish
        entries that became readable, unpublish corrupt ones. Returns the entries stored.
        ``wait_publish=False`` answers before the coordinator has the events (an engine's
        store needs no index round trip on its path; events stay in order by sequence).
        An engine's applies come through the node agent, which runs a connection's requests
        in order: its next reserve or lease sees them applied."""
        return await self._apply(model, ops, wait_publish)

    async def _apply(
        self, model: str, ops: list[tuple], wait_publish: bool, counted: bool = False
    ) -> int:
        """``apply``; ``counted``: the corrupt drops among ``ops`` were counted where they
        were found (a reader on another member: ``drop_keys``), else the entries they drop
        count here, once each (an engine or pool of this node found them loading)."""
        mt = self._tier(model)
        tier = mt.tier
        corrupt = [op[1] for op in ops if op[0] == "drop" and op[2]]
        dropped = tier.stats.checksum_errors
        tier.apply(ops)
        dropped = tier.stats.checksum_errors - dropped  # entries dropped: once, if still held
        added, removed, stored = [], [], 0
        for op in ops:
            if op[0] != "finish_store":
                continue
            keys = list(filter(mt.pending.__contains__, op[1].keys))
            states = tier.states(keys)
            if sum(map(states.count, READABLE)) == len(keys):  # the usual: all stored
                added += mt.note_all(keys, list(map(mt.pending.pop, keys)))
                stored += len(keys)
                continue
            for k, state in zip(keys, states, strict=True):
                if state is None:  # a writer failed: back to free
                    mt.pending.pop(k)
                elif state in READABLE:  # every writer done
                    added += mt.note(k, mt.pending.pop(k))
                    stored += 1
        removed, mt.unpublished = removed + mt.unpublished + mt.lost_below(), []
        for k in corrupt:
            removed += mt.forget(k)
        if not counted:
            self.metrics.checksum_errors(model, CPU, dropped)
        self.metrics.used(model, CPU, tier.num_blocks - tier.num_free)
        removed = list(filterfalse(mt.where.__contains__, removed))
        if added or removed:
            sent = self.publish(model, list(zip(added, repeat(-1))), removed)
            if wait_publish:
                await sent
            else:
                task = asyncio.get_running_loop().create_task(sent)
                self._publishing.add(task)
                task.add_done_callback(self._published)
        return stored

    def _published(self, task: asyncio.Task) -> None:
        self._publishing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("tier %s: publishing KV events failed: %r", self.name, task.exception())
            self.metrics.copy_failed("all", CPU, "publish")

    async def drop_keys(self, model: str, keys: list[bytes]) -> None:
        """A reader found the entries holding block ``keys`` corrupt: they are misses now
        (the reader counted them: ``checksum_errors`` "remote")."""
        mt = self.tiers.get(model)
        if mt is None:
            return
        entries = {e for k in keys for e in mt.holders(k)}
        await self._apply(model, [("drop", e, True) for e in entries], True, counted=True)

    # --- other nodes ----------------------------------------------------------------------

    async def export_blocks(
        self, model: str, keys: list[bytes], out: np.ndarray | None = None, lend: float = 0.0
    ) -> tuple[int, np.ndarray, list[list[int]]] | Lent:
        """For ``raykv.transport``: the leading block ``keys`` (one group) held here as one
        buffer uint8 [copies, count, row_bytes] (in ``out`` where it fits: a UCX server's
        reused buffer) with their stored checksums [copies][count]. ``lend`` (a UCX server
        that sends from the arena: the seconds its send may read them): where the rows are
        one run of whole rows of the one copy and their lease outlasts that, a ``Lent`` view
        of them instead, leased (never evicted or rewritten) until released."""
        mt = self.tiers.get(model)
        _, lease, chosen = await self.lease(model, keys) if mt is not None else (0, None, [])
        if lease is None:
            return 0, np.empty((1, 0, 0), np.uint8), []
        tier, view = mt.tier, None
        try:
            width = mt.widths[key_group(keys[0])]
            picks = [(lease.blocks[e], s) for e, s in chosen]
            sums = [[lease.checksums[e][c][s] for e, s in chosen] for c in range(tier.copies)]
            if lend > 0 and tier.copies == 1 and tier.hold_left(lease) > lend:
                view = tier.run_view([tier.row(b, s) for b, s in picks], width)
            if view is not None:  # the lease now ends with the send
                return Lent(len(chosen), view.unsqueeze(0).numpy(), sums,
                            lambda: tier.finish_load(lease))  # fmt: skip
            rows = tier.read(picks, width, out)
        finally:
            if view is None:
                tier.finish_load(lease)
        return len(chosen), export_rows(rows), sums

    async def pull(self, model: str, keys: list[bytes], tenant: bytes | None = None) -> int:
        """Copy the leading block ``keys`` (one group, prefix order, from a chunk boundary)
        that other members hold into this node's arena (CPU tier -> CPU tier over UCX where
        both run it, else the object store): verified, stored with their checksums,
        published. Returns how many leading ``keys`` this tier holds afterwards; the rest
        are misses (``raykv.service.tier.pull``)."""
        from raykv.service.tier.pull import pull

        return await pull(self, model, keys, tenant)

    # --- membership (``Membership``: what it asks of the tier, ``Contents``) ---------------

    def snapshot(self) -> dict[str, Any]:
        return self.member.snapshot()

    async def watch(self, seconds: float) -> str | None:
        return await self.member.watch(seconds)

    def endpoints(self) -> dict[str, Any]:
        return self.member.endpoints()

    def extra_snapshot(self) -> dict[str, Any]:
        return {}

    def blocks(self) -> dict[str, list[tuple[Hashable, int]]]:
        return {m: [(k, -1) for k in mt.where] for m, mt in self.tiers.items()}

    def stats(self) -> dict[str, Any]:
        tiers = [mt.tier for mt in self.tiers.values()]
        return {
            "blocks_used": sum(t.num_blocks - t.num_free for t in tiers),
            "blocks_total": sum(t.num_blocks for t in tiers),
            "bytes": sum(t.total_bytes for t in tiers),
            # leases / reservations: live, reclaimed at their deadline, released with their
            # holder, and finishes that came after the reclaim (ignored)
            "leases_held": sum(t.num_holds for t in tiers),
            "leases_expired": sum(
                t.stats.expired_leases + t.stats.expired_reservations for t in tiers
            ),
            "leases_released": sum(t.stats.released_holds for t in tiers),
            "late_finishes": sum(t.stats.late_finishes for t in tiers),
            "per_model": {
                m: {
                    "blocks_total": mt.tier.num_blocks,
                    "blocks_used": mt.tier.num_blocks - mt.tier.num_free,
                    "bytes": mt.tier.total_bytes,
                    "copies": mt.tier.copies,
                    "block_size_factor": mt.tier.factor,
                    "checksum_errors": mt.tier.stats.checksum_errors,
                    "leases_held": mt.tier.num_holds,
                    "leases_expired": mt.tier.stats.expired_leases,
                    "reservations_expired": mt.tier.stats.expired_reservations,
                    "leases_released": mt.tier.stats.released_holds,
                    "late_finishes": mt.tier.stats.late_finishes,
                    # bytes per tenant label, entries over quota left out / own evicted
                    "tenant_bytes": mt.tier.tenant_bytes(),
                    "quota_refused": mt.tier.stats.quota_refused,
                    "quota_evicted": mt.tier.stats.quota_evicted,
                    **({"disk": mt.disk_stats()} if mt.disk is not None else {}),
                    **({"object": mt.object_stats()} if mt.objects is not None else {}),
                }
                for m, mt in self.tiers.items()
            },
            # engine processes connected to this node's agent now
            "agent_clients": self.agent.clients,
            # their lookups, hit / missed blocks and stored entries per tenant (labels:
            # "none", a short hash of a tenant's key, or "other" past MAX_TENANTS)
            # and bytes_held (this node's tiers, every model), quota_refused / quota_evicted
            "tenants": {t: dict(c) for t, c in self.metrics.tenants.items()},
            # the quota of each tenant label (and "default") in each model's arena here
            "tenant_quotas": self.quotas.as_dict() if self.quotas is not None else {},
            # and in each model's disk tier here (RAYKV_DISK_TENANT_QUOTAS)
            "disk_tenant_quotas": (
                self.disk_quotas.as_dict() if self.disk_quotas is not None else {}
            ),
            # and in each model's objects in the bucket (RAYKV_OBJECT_TENANT_QUOTAS)
            "object_tenant_quotas": (
                self.object_quotas.as_dict() if self.object_quotas is not None else {}
            ),
            "replica_dropped": sum(mt.replica.dropped for mt in self.tiers.values()),
        } | dict(self.metrics.tally)

"""The coordinator: one named, detached actor that knows who holds which block.

It keeps membership (pools and tiers register, then heartbeat), one ``Plan`` per served
model and the cluster-wide prefix index fed by the members' KV events; it places pools and
tiers on nodes through ``raykv.service.control.placement`` and reports through
``raykv.service.control.status``. It holds NO block data: every byte lives in the pools and
tiers, which are detached actors of their own. When Ray restarts the coordinator it asks
every live member (found by name) for a snapshot, so the index comes back whole; a member
that talks to it first just re-registers (its heartbeat or event sequence says "unknown").
A member that dies on a live node (or a TP group that lost a rank: its leader leaves) is
dropped from the index at once and started afresh under its name: its blocks are misses.
The coordinator keeps one long call open on every member (``Membership.watch``), so a death is
seen when Ray reports it, not only when heartbeats stop; the fresh member is placed on the
next health tick (a second), on the same node (and so the same GPU slot).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import ray

from raykv.blocks.events import PrefixIndex
from raykv.blocks.hashing import split_hashes
from raykv.errors import ConfigError, InsufficientMemoryError, InvalidInput, ServiceError
from raykv.service.control import placement, status
from raykv.service.control.index import (
    CPU,
    GPU,
    IndexFeed,
    Located,
    Location,
    group_key,
    key_events,
    pack,
    rank,
    split_key,
    unpack,
)
from raykv.service.control.metrics import ServiceMetrics
from raykv.service.groups import (
    check_servable,
    common_hit,
    key_limit,
    managers,
    needed_slots,
    primary_group,
)
from raykv.service.served import COORDINATOR, NAMESPACE, ServedModel
from raykv.transport.select import COLLECTIVE, OBJECT_STORE, route

HEARTBEAT_S = 1.0
WATCH_S = 30.0  # how long one watch call stays open before the next replaces it
DEAD_AFTER_S = 6.0  # missed heartbeats before a member's blocks stop being hits
CALL_TIMEOUT_S = 10.0
_MEMBER_PREFIXES = ("raykv-pool-", "raykv-tier-")
log = logging.getLogger(__name__)


@dataclass
class Member:
    name: str
    kind: str  # "pool" or "tier"
    node_id: str
    model: str | None  # pools serve one model; a tier serves every model of its node
    seq: int = 0  # last KV-event batch applied; a gap means "send a snapshot"
    last_seen: float = field(default_factory=time.monotonic)
    stats: dict[str, Any] = field(default_factory=dict)
    actor_id: str | None = None  # the incarnation that registered (a name outlives actors)
    # transport name -> endpoint it advertised (``Membership.endpoints``)
    transports: dict[str, Any] = field(default_factory=lambda: {OBJECT_STORE: None})


def _size(n: int) -> str:
    """Bytes as a person reads them, never rounded away: "512 bytes", "64 MiB",
    "1.5 MiB (1572864 bytes)"."""
    if n < 2**20:
        return f"{n} byte{'s' * (n != 1)}"
    mib = n / 2**20
    return f"{mib:.0f} MiB" if n % 2**20 == 0 else f"{mib:.1f} MiB ({n} bytes)"


def _plan_or_explain(model: ServedModel, pool_bytes: int, *, on_gpus: bool) -> Any:
    """``model.plan``; on a cluster without GPUs the fix for too little memory is the
    CPU-device pools' size (``--pool-mem``), not more GPU memory."""
    try:
        return model.plan(pool_bytes)
    except InsufficientMemoryError as e:
        if on_gpus:
            raise
        shorter = (
            f", or lower max_model_len to {e.fits_len} (--max-model-len)" if e.fits_len else ""
        )
        need = e.need_bytes
        fix = f"{-(-need // 2**20)}MiB" if need >= 2**20 else str(need)
        raise InsufficientMemoryError(
            f"model {model.name!r}: one request of max_model_len={model.max_model_len} tokens "
            f"needs {_size(need)} of KV per pool, but this cluster has no GPUs and its pools "
            f"hold {_size(pool_bytes)} of host memory each; fix: raise the pool size to at "
            f"least {_size(need)} (raykv up --pool-mem {fix}, or pool_bytes={need} in "
            f"add_model){shorter}",
            need_bytes=e.need_bytes,
            fits_len=e.fits_len,
        ) from None


ROUTER_REPORT_S = 60.0  # a Serve router that has not reported for this long is not listed


class Coordinator:
    def __init__(self) -> None:
        self.models: dict[str, ServedModel] = {}
        self.plans: dict[str, Any] = {}
        self.members: dict[str, Member] = {}
        self.index = PrefixIndex(journal=True)
        self.feed = IndexFeed(self.index)  # its changes, for the nodes' replicas
        self.metrics = ServiceMetrics("coordinator")
        self.started = time.time()
        self.restarts = ray.get_runtime_context().was_current_actor_reconstructed
        self._ready: asyncio.Event | None = None
        self._health: asyncio.Task | None = None
        self.placer = placement.Placer()
        self._placing: asyncio.Task | None = None
        self._managers: dict[str, Any] = {}  # model -> its group managers (hit rules)
        self._watches: dict[str, tuple[str, asyncio.Task]] = {}  # name -> (actor id, watch)
        self.routes: dict[tuple[str, str], str] = {}  # (holder, reader) -> transport used
        self.routers: dict[str, dict] = {}  # Serve routers' reports (``router_report``)
        self._rendezvous: tuple[Any, str, int] | None = None  # NCCL / gloo pairs' TCPStore
        self._withdrawn: set[str] = set()  # models add_model could not place (``_withdraw``)

    # --- lifecycle ----------------------------------------------------------------------

    async def _up(self) -> None:
        """First call after (re)start: rebuild from the live members, then start health."""
        if self._ready is None:
            self._ready = asyncio.Event()
            try:
                await self._rebuild()
            finally:
                self._ready.set()
            self._health = asyncio.get_running_loop().create_task(self._health_loop())
        await self._ready.wait()

    async def _rebuild(self) -> None:
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE and a["name"].startswith(_MEMBER_PREFIXES)
        ]

        async def snap(name: str) -> None:
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                self._register(await asyncio.wait_for(actor.snapshot.remote(), CALL_TIMEOUT_S))
            except Exception as e:  # dead or dying: it holds nothing we can serve
                log.warning("coordinator rebuild: no snapshot from %s (%r)", name, e)
                self.metrics.failed("rebuild_snapshot")

        await asyncio.gather(*(snap(n) for n in names))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                alive = self._drop_dead()
                idle = self._placing is None or self._placing.done()
                if idle and self.placer.missing(alive, self.members):
                    # a node joined (give it a tier and pools), or a member on a live node
                    # died (start a fresh one: its blocks are misses, its name serves again)
                    self._placing = asyncio.get_running_loop().create_task(self._replace())
            except Exception:  # the loop must outlive a bad tick
                log.exception("coordinator health tick failed; the next tick retries")
                self.metrics.failed("health_tick")

    async def _replace(self) -> None:
        try:
            await self._place()
        except Exception as e:  # e.g. no free GPU yet: the next tick retries
            log.warning("coordinator: placing again failed, the next tick retries: %s", e)
            self.metrics.failed("replace")

    def _drop_dead(self) -> set[str]:
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        now = time.monotonic()
        for m in list(self.members.values()):
            if m.node_id not in alive or now - m.last_seen > DEAD_AFTER_S:
                self._forget(m.name)
        return alive

    def _forget(self, name: str) -> None:
        self.members.pop(name, None)
        self.index.drop_member(name)
        self.routes = {pair: t for pair, t in self.routes.items() if name not in pair}

    def _watch(self, name: str, actor_id: str | None) -> None:
        """Watch the member ``name`` registered as (one task per name and incarnation)."""
        if actor_id is None:
            return  # nothing to tell incarnations apart by: heartbeats decide
        watched, task = self._watches.get(name, (None, None))
        if watched == actor_id and task is not None and not task.done():
            return
        task = asyncio.get_running_loop().create_task(self._watch_loop(name, actor_id))
        self._watches[name] = (actor_id, task)

    async def _watch_loop(self, name: str, actor_id: str) -> None:
        """Keep a ``watch`` call open on the member; when Ray says it died, forget it at once
        (its blocks become misses; the health loop places a fresh one). A member that
        registered again under a new incarnation is left alone."""

        def current() -> bool:
            m = self.members.get(name)
            return m is not None and m.actor_id == actor_id

        while current():
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
                seen = await actor.watch.remote(WATCH_S)
            except (ray.exceptions.RayActorError, ValueError):  # dead, or its name is free
                if current():
                    self._forget(name)
                return
            except Exception as e:  # e.g. an older member without ``watch``: heartbeats decide
                log.warning("coordinator: cannot watch %s (%r); heartbeats decide", name, e)
                self.metrics.failed("watch")
                return
            if seen != actor_id:  # the name belongs to a newer incarnation: its own watch
                return

    async def ping(self) -> dict:
        await self._up()
        return {"models": sorted(self.models), "members": len(self.members)}

    # --- models and placement -----------------------------------------------------------

    async def add_model(self, model: ServedModel) -> Any:
        """Plan ``model`` once (with its tp_size) and place its TP groups (``tp_size`` pools
        per group: one group per ``tp_size`` GPUs of a node, or one of CPU-device pools per
        GPU-less node) and a CPU tier per node. Idempotent for the same model. A model the
        service cannot serve raises ConfigError before anything is recorded."""
        await self._up()
        have = self.models.get(model.name)
        if have is not None:
            if have != model or dict(have.layers) != dict(model.layers):
                raise ConfigError(
                    f"model {model.name!r} is already served with different settings; "
                    "remove it first (raykv down) or serve the new one under another name"
                )
        else:
            on_gpus = placement.check_placeable(model, self.models)
            gpu_bytes = model.pool_bytes or await placement.probe_gpu_bytes(model)
            plan = _plan_or_explain(model, gpu_bytes, on_gpus=on_gpus)
            check_servable(plan)
            self._withdrawn.discard(model.name)
            self.plans[model.name] = plan
            self.models[model.name] = model
            await self._place_new(model.name)
            return plan
        await self._place()
        if model.name not in self.plans:  # another add_model of it failed meanwhile
            raise ServiceError(
                f"model {model.name!r} was withdrawn while this add_model waited: its pools "
                "could not be placed (the other call raised why); fix that and add it again"
            )
        return self.plans[model.name]

    async def _place_new(self, name: str) -> None:
        """Place a model just recorded, all or nothing: if any of its pools cannot start, it
        is withdrawn (``_withdraw``: no plan, no pools, no CPU-tier arena left, and no
        placing it again) and ServiceError names the pool and the cause. Other members that
        did not start (e.g. an older model's pool being placed again) are the health loop's
        to retry, as before."""
        try:
            await self._place()
        except Exception as e:
            mine = (
                [f for f in e.failed if f[1] == name]
                if isinstance(e, placement.PlacementFailed)
                else [(name, name, e)]
            )
            if not mine:  # this model's pools all started
                log.warning("coordinator: placing %r: other members failed: %s", name, e)
                self.metrics.failed("place")
                return
            pools = await self._withdraw(name)
            member, _, error = mine[0]
            more = f" (and {len(mine) - 1} more of its pools)" if len(mine) > 1 else ""
            raise ServiceError(
                f"model {name!r} was not added: {member}{more} could not start: "
                f"{placement._why(error)}; nothing of the model was kept (its plan, "
                f"{len(pools)} pool(s) and CPU-tier arenas are gone, and it is not placed "
                "again): fix the cause (raykv status shows the nodes' members) and add it again"
            ) from None

    async def _withdraw(self, name: str) -> list[str]:
        """Forget model ``name`` and everything placed for it: its plan, pools, TP ranks and
        placement groups, its index entries, and its arena in every CPU tier. A pool of it
        that registers afterwards (a heartbeat in flight) is not taken back."""
        self.models.pop(name, None)
        self.plans.pop(name, None)
        self._managers.pop(name, None)
        self._withdrawn.add(name)
        pools = await self.placer.withdraw(name)
        for m in list(self.members.values()):
            if m.model == name:
                self._forget(m.name)
            elif m.kind == "tier":
                try:
                    await asyncio.wait_for(
                        ray.get_actor(m.name, namespace=NAMESPACE).remove_model.remote(name),
                        CALL_TIMEOUT_S,
                    )
                except Exception as e:  # dead or restarting: a fresh tier has no arena of it
                    log.warning("coordinator: tier %s kept %r's arena (%r)", m.name, name, e)
                    self.metrics.failed("withdraw_tier")
        return pools

    async def _place(self) -> None:
        """Start whatever is missing on every alive node that runs engines (its CPU tier
        and every model's TP groups: ``raykv.service.control.placement``)."""
        await self.placer.place(self.models, self.plans)

    def model(self, name: str) -> tuple[ServedModel, Any]:
        if name not in self.models:
            raise InvalidInput(
                f"unknown model {name!r}; served models: {sorted(self.models) or 'none'} "
                "(serve it with Client.add_model or raykv up --preset)"
            )
        return self.models[name], self.plans[name]

    async def get_model(self, name: str | None) -> tuple[ServedModel, Any]:
        await self._up()
        if name is None:
            if len(self.models) != 1:
                raise InvalidInput(
                    f"{len(self.models)} models are served ({sorted(self.models)}); "
                    "name the one you want"
                )
            name = next(iter(self.models))
        return self.model(name)

    async def pools(self, model: str, node_id: str | None = None) -> list[str]:
        """Names of ``model``'s live pools on node ``node_id`` (every node's with None),
        sorted. A client only ever uses its own node's pool (its GPU, its block ids): an
        empty list means that node's pool is being placed (again); a node that runs no pool
        of ``model`` (not alive, or a CPU-only node of a GPU cluster) raises ServiceError."""
        await self._up()
        if not self.model(model)[0].pools:
            raise ServiceError(
                f"model {model!r} is served without pools (its engines keep their own KV: "
                "the CPU tiers and the index only), so it has no blocks to allocate; attach "
                "the engine's KV (Client.attach) or serve the model with pools under another name"
            )
        pools = [m for m in self.members.values() if m.kind == "pool" and m.model == model]
        if node_id is None:
            return sorted(m.name for m in pools)
        names = sorted(m.name for m in pools if m.node_id == node_id)
        if names:
            return names
        groups = placement.node_groups(self.models)
        if node_id not in groups:
            raise ServiceError(
                f"node {node_id[:12]} is not an alive node of this Ray cluster; a client uses "
                "the pool of the node it runs on (or the node passed to Client.on)"
            )
        if not groups[node_id].get(model):
            raise ServiceError(
                f"node {node_id[:12]} runs no pool of model {model!r} (on a GPU cluster only "
                "GPU nodes do); run the engine on a GPU node, or pick one with Client.on"
            )
        return []  # being placed (again): the caller waits for it

    # --- membership and events ----------------------------------------------------------

    def _register(self, snap: dict) -> None:
        name = snap["name"]
        if snap.get("model") in self._withdrawn:  # a withdrawn model's pool, being killed
            return
        self._forget(name)
        for model, plan in snap.get("models", {}).items():
            if model not in self.models:
                self.models[model], self.plans[model] = plan
        self.members[name] = Member(
            name,
            snap["kind"],
            snap["node_id"],
            snap.get("model"),
            snap["seq"],
            stats=snap.get("stats", {}),
            actor_id=snap.get("actor_id"),
            transports=snap.get("transports") or {OBJECT_STORE: None},
        )
        self._watch(name, snap.get("actor_id"))
        for model, blocks in snap["blocks"].items():
            self.index.replay(key_events(blocks, [], self._block_sizes(model)), name, model)

    async def register(self, snap: dict) -> None:
        await self._up()
        self._register(snap)

    async def heartbeat(self, name: str, seq: int, stats: dict) -> bool:
        """False: this coordinator does not know ``name`` as it is; send a snapshot."""
        await self._up()
        m = self.members.get(name)
        if m is None or m.seq != seq:
            return False
        m.last_seen, m.stats = time.monotonic(), stats
        return True

    async def events(
        self,
        name: str,
        seq: int,
        model: str,
        stored_keys: list[bytes],
        stored_blocks: list[int],
        removed: list[Hashable],
    ) -> bool:
        """Apply one batch of KV events (``stored_keys[i]`` now held in block
        ``stored_blocks[i]``, ``removed``: group keys), as the block pool's events held by
        ``name``, to the one prefix index; False when a batch is missing (send a snapshot).
        Two flat lists, not (key, block) pairs: Ray sends lists of bytes and ints natively,
        where each tuple would be an extension of its own (2048 blocks: ~4 ms more a call)."""
        await self._up()
        m = self.members.get(name)
        if m is None or seq != m.seq + 1:
            return False
        m.seq, m.last_seen = seq, time.monotonic()
        stored = zip(stored_keys, stored_blocks, strict=True)
        self.index.replay(key_events(stored, removed, self._block_sizes(model)), name, model)
        return True

    def _block_sizes(self, model: str) -> dict[int, int]:
        plan = self.plans.get(model)
        return {} if plan is None else {g.group_id: g.block_size for g in plan.groups}

    async def member_failed(self, name: str) -> None:
        """A caller could not reach ``name``: stop pointing lookups at it until it
        re-registers (a live member does so on its next heartbeat)."""
        await self._up()
        self._forget(name)

    @ray.method(max_task_retries=0, enable_task_events=False)
    async def index_changes(self, epoch: str, since: int, node_id: str) -> bytes:
        """For node ``node_id``'s index replica (``raykv.service.node.replica``): the blocks whose
        holders changed since ``since`` (``IndexFeed``), each with where members other than
        that node's CPU tier hold it, packed: (epoch, next since, resync, [(model, group
        key, LOCAL_POOL | ELSEWHERE bits)]). The node's tier keeps its own bit itself."""
        from raykv.service.node.replica import ELSEWHERE, LOCAL_POOL

        await self._up()
        epoch, seq, resync, keys = self.feed.changes(epoch, since)
        out = []
        for model, gid, h in keys:
            bits = 0
            for holder in self.index.table(gid, model).get(h, ()):
                m = self.members.get(holder)
                if m is None or (m.kind == "tier" and m.node_id == node_id):
                    continue
                bits |= LOCAL_POOL if m.node_id == node_id else ELSEWHERE
            out.append((model, group_key(gid, h), bits))
        return pack((epoch, seq, resync, out))

    @ray.method(max_task_retries=0, enable_task_events=False)
    async def placement_changes(self, epoch: str, since: int) -> bytes:
        """For a cluster-wide index replica (a Serve router's, ``raykv.integrations.serve``):
        the blocks whose holders changed since ``since`` (``IndexFeed``), each with every
        place that holds it, packed: (epoch, next since, resync, [(model, group key,
        ((node id, "gpu" | "cpu"), ...))]); an empty tuple: nobody holds it now."""
        await self._up()
        epoch, seq, resync, keys = self.feed.changes(epoch, since)
        out = []
        for model, gid, h in keys:
            places = set()
            for holder in self.index.table(gid, model).get(h, ()):
                m = self.members.get(holder)
                if m is not None:
                    places.add((m.node_id, CPU if m.kind == "tier" else GPU))
            out.append((model, group_key(gid, h), tuple(places)))
        return pack((epoch, seq, resync, out))

    async def router_report(self, name: str, report: dict) -> None:
        """A Serve router's constants and decisions (``raykv.integrations.serve``), for
        ``raykv status``; kept until it stops reporting for ``ROUTER_REPORT_S``."""
        self.routers[name] = {**report, "name": name, "at": time.time()}

    # --- lookup -------------------------------------------------------------------------

    async def lookup(
        self, model: str, hashes: bytes, node_id: str, limit: int | None = None
    ) -> dict[str, Any]:
        """The longest prefix (<= ``limit`` tokens) every group can serve: ``hit_tokens``,
        and ``runs`` of ``(tier, node_id, num_blocks)`` of the best copies, seen from
        ``node_id``, of the blocks the primary group (full attention / MLA, else the first)
        needs for it. Runs keep the answer small: a 32k-token prompt is 2048 blocks.

        ``hashes`` is the request's chain (``BlockHasher.hash_blocks``, one hash per hash
        block) joined into one bytes blob: one object on the wire; group ``g``'s key of
        block ``j`` is hash ``(j + 1) * k - 1`` (``k = block_size // hash_block_size``), so
        every group is probed from the same blob, one dict probe per slot. Every slot a hit
        needs is probed: the index is not prefix-closed (a member may hold block ``j`` and
        not ``j - 1``: evicted, or out of a sliding window), so no slot is inferred from
        another."""
        await self._up()
        return self._lookup(model, hashes, node_id, limit)

    @ray.method(max_task_retries=0, enable_task_events=False)
    async def lookup_packed(self, request: bytes) -> bytes:
        """``lookup`` as clients call it: the arguments packed into one bytes object and the
        answer packed into another (``raykv.service.control.index.pack``), so Ray moves two bytes
        objects instead of serializing five values. Ray does not retry it (the client
        retries through a coordinator restart itself) nor record it as a task event (the
        metrics count lookups): both cost every call."""
        await self._up()
        return pack(self._lookup(*unpack(request, 4, "Coordinator.lookup_packed")))

    def _lookup(self, model: str, hashes: bytes, node_id: str, limit: int | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        _, plan = self.model(model)
        if not isinstance(hashes, bytes):
            raise InvalidInput(
                f"lookup takes the chained hashes as one bytes blob, got {type(hashes).__name__}"
                "; pass b''.join(BlockHasher(plan.hash_block_size).hash_blocks(token_ids))"
            )
        mgrs = self._managers.get(model)
        if mgrs is None:
            mgrs = self._managers[model] = managers(plan)
        split: dict[int, list[bytes]] = {}
        keys = []
        for g in plan.groups:
            k = g.block_size // plan.hash_block_size
            if k not in split:
                split[k] = split_hashes(hashes, k)
            keys.append(split[k])
        probes = [
            self.index.probe(g.group_id, gk, m, model)
            for g, gk, m in zip(plan.groups, keys, mgrs, strict=True)
        ]
        cap = key_limit(plan, keys)
        cap = cap if limit is None else min(cap, limit)
        hit = common_hit(probes, lambda gi, j: probes[gi](j) is not None, cap)
        p = primary_group(plan)
        slots = needed_slots(mgrs[p], hit)
        runs = self._runs(probes[p], keys[p][slots.start : slots.stop], node_id)
        for tier, node, n in runs:
            self.metrics.hit(model, f"{'local' if node == node_id else 'remote'}_{tier}", n)
        looked = cap // plan.groups[p].block_size
        self.metrics.miss(model, "all", looked - hit // plan.groups[p].block_size)
        self.metrics.lookup_ms(model, (time.perf_counter() - t0) * 1e3)
        return {"hit_tokens": hit, "runs": runs}

    def _runs(self, probe: Any, keys: list[bytes], node_id: str) -> list[tuple[str, str, int]]:
        """Runs of ``(tier, node, blocks)`` of the best copy of each of ``keys`` (all held).
        A slot whose best holder is the run's is counted without ranking its copies."""
        where = {n: (CPU if m.kind == "tier" else GPU, m.node_id) for n, m in self.members.items()}
        ranks = {n: rank(nd, tier, node_id) for n, (tier, nd) in where.items()}
        runs: list[tuple[str, str, int]] = []
        cur, cur_at, n = None, None, 0
        for copies in map(probe.table.__getitem__, keys):
            if cur in copies and (len(copies) == 1 or ranks.get(cur) == 0):
                n += 1
                continue
            best = next(iter(copies)) if len(copies) == 1 else min(copies, key=ranks.__getitem__)
            at = where[best]
            if at != cur_at:
                if n:
                    runs.append((*cur_at, n))
                cur_at, n = at, 0
            cur, n = best, n + 1
        if n:
            runs.append((*cur_at, n))
        return runs

    def _route(self, holder: Member, reader: str | None) -> tuple[str, Any]:
        """The transport ``reader`` uses to fetch from ``holder`` (the fastest both
        offer), and the holder's endpoint for it; remembered for ``raykv status``."""
        r = self.members.get(reader) if reader else None
        theirs = r.transports if r else {OBJECT_STORE: None}
        name, ep = route(holder.transports, theirs, lambda n: self._endpoint(holder, n))
        if reader:
            self.routes[(holder.name, reader)] = name
        return name, ep

    def _endpoint(self, holder: Member, name: str) -> Any:
        ep = holder.transports.get(name)
        if name in COLLECTIVE:  # pairs of registered pools meet at our store
            if self._rendezvous is None:
                from raykv.transport.collective.pair import serve_rendezvous

                self._rendezvous = serve_rendezvous(ray.util.get_node_ip_address())
            ep = {**(ep or {}), "store": self._rendezvous[1:]}
        return ep

    async def locate(
        self, model: str, block_hashes: list[Hashable], node_id: str, reader: str | None = None
    ) -> Located:
        """Every copy of each block (by group key), best first (a loader falls back when one
        fails), each with the transport ``reader`` (a member's name) fetches it over. A
        member's route is worked out once per call and all its copies are one shared
        ``Location`` (a 32k-token prompt names 2048 blocks, mostly of one or two members: the
        answer pickles each member once, ~10 KB, where a Location per block was ~110 KB, over
        Ray's 100 KiB inline limit; ``Located`` keeps it one pickle)."""
        await self._up()
        out: list[list[Location]] = []
        routed: dict[str, tuple[int, Location] | None] = {}  # member -> (rank, its Location)
        tables: dict[int, Any] = {}
        for key in block_hashes:
            gid, h = split_key(key)
            table = tables.get(gid)
            if table is None:
                table = tables[gid] = self.index.table(gid, model)
            ranked = []
            for name in table.get(h, ()):
                if name not in routed:
                    m = self.members.get(name)
                    routed[name] = None if m is None else self._routed(m, reader, node_id)
                r = routed[name]
                if r is not None:
                    ranked.append(r)
            if len(ranked) > 1:
                ranked.sort(key=lambda x: x[0])  # stable: equal ranks keep the index's order
            out.append([loc for _, loc in ranked])
        return Located(out)

    def _routed(self, m: Member, reader: str | None, node_id: str) -> tuple[int, Location]:
        """(rank seen from ``node_id``, the Location) of member ``m``'s copies for
        ``reader``."""
        t, ep = self._route(m, reader)
        loc = Location(m.name, m.node_id, CPU if m.kind == "tier" else GPU, t, ep)
        return loc.rank(node_id), loc

    # --- stats and shutdown -------------------------------------------------------------

    async def stats(self) -> dict:
        """The cluster's status (``raykv.service.control.status``): what ``raykv status`` prints."""
        await self._up()
        return status.cluster(
            ray_nodes=ray.nodes(),
            members_=self.members.values(),
            index=self.index,
            served=self.models,
            plans=self.plans,
            tally=self.metrics.tally,
            started=self.started,
            restarted=self.restarts,
            routes=self.routes,
            routers=[r for r in self.routers.values() if time.time() - r["at"] < ROUTER_REPORT_S],
        )

    async def shutdown_service(self, admin: str | None = None) -> int:
        """Kill every pool, TP rank and tier and remove the TP placement groups (``raykv
        down``, with the admin key: ``raykv.service.control.admin``); the caller then kills this
        actor. Returns the actors killed."""
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        from raykv.service.control.admin import admin_key, check_admin

        check_admin(admin, admin_key(), "shutdown_service")

        if self._placing is not None:  # a re-placement must not start members after this
            self._placing.cancel()
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == NAMESPACE
            and a["name"].startswith((*_MEMBER_PREFIXES, "raykv-rank-"))
        ]
        for name in names:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except ValueError:  # gone already
                pass
            except Exception as e:
                log.warning("shutdown: could not kill %s: %r", name, e)
                self.metrics.failed("shutdown_kill")
        for pg_id, pg in ray.util.placement_group_table().items():
            if pg.get("name", "").startswith("raykv-tp-") and pg.get("state") != "REMOVED":
                try:
                    remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
                except Exception as e:  # removed meanwhile
                    log.warning("shutdown: could not remove placement group %s: %r", pg_id, e)
                    self.metrics.failed("shutdown_remove_group")
        self.members.clear()
        self.placer.clear()
        self.index = PrefixIndex(journal=True)
        self.feed = IndexFeed(self.index)  # its changes, for the nodes' replicas
        self.models.clear()
        self.plans.clear()
        self._managers.clear()
        return len(names)


def coordinator_actor(max_restarts: int = -1):
    """The ``ray.remote`` form, created by ``raykv.service.control.calls.ensure_service``."""
    return ray.remote(Coordinator).options(
        name=COORDINATOR,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=max_restarts,
        max_task_retries=3,
        num_cpus=0,
    )

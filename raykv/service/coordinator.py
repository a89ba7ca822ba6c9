"""The coordinator: one named, detached actor that knows who holds which block.

It keeps membership (pools and tiers register, then heartbeat), one ``Plan`` per served
model, the cluster-wide prefix index fed by the members' KV events, placement of pools and
tiers on nodes, and cluster stats. It holds NO block data: every byte lives in the pools and
tiers, which are detached actors of their own. When Ray restarts the coordinator it asks
every live member (found by name) for a snapshot, so the index comes back whole; a member
that talks to it first just re-registers (its heartbeat or event sequence says "unknown").
A member that dies on a live node (or a TP group that lost a rank: its leader leaves) is
dropped from the index at once and started afresh under its name: its blocks are misses.
The coordinator keeps one long call open on every member (``Member.watch``), so a death is
seen when Ray reports it, not only when heartbeats stop; the fresh member is placed on the
next health tick (a second), on the same node (and so the same GPU slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from raykv.errors import ConfigError, InsufficientMemoryError, InvalidInput, ServiceError
from raykv.service.groups import (
    check_servable,
    common_hit,
    key_limit,
    managers,
    needed_slots,
    primary_group,
)
from raykv.service.index import CPU, GPU, Location, PrefixIndex
from raykv.service.metrics import ServiceMetrics
from raykv.service.spec import (
    COORDINATOR,
    DEFAULT_POOL_BYTES,
    NAMESPACE,
    ServedModel,
    group_name,
    pool_name,
    rank_name,
    tier_name,
)

HEARTBEAT_S = 1.0
WATCH_S = 30.0  # how long one watch call stays open before the next replaces it
DEAD_AFTER_S = 6.0  # missed heartbeats before a member's blocks stop being hits
CALL_TIMEOUT_S = 10.0
PLACE_TIMEOUT_S = 60.0
CPU_POOL_SLIVER = 0.01  # CPU share a CPU-device pool's bundle reserves (bundles can't be empty)
NODE_LABEL = "ray.io/node-id"  # Ray's built-in node label: pins a TP group's bundles
_DETACHED = dict(
    namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=0, num_cpus=0
)
_MEMBER_PREFIXES = ("raykv-pool-", "raykv-tier-")


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


def engine_groups(nodes: list[dict], models: dict[str, ServedModel]) -> list[dict[str, int]]:
    """Per node (``ray.nodes()`` entries): how many TP groups of each model it hosts. With
    GPUs in the cluster, ``num_gpus // tp_size`` on each node (none on CPU-only nodes: a
    CPU-device pool there would take the GPU plan's bytes of host memory); without, one
    group of CPU-device pools per node (development and CI)."""
    gpus = [int(n["Resources"].get("GPU", 0)) for n in nodes]
    return [{name: g // m.tp_size if any(gpus) else 1 for name, m in models.items()} for g in gpus]


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
        raise InsufficientMemoryError(
            f"model {model.name!r}: one request of max_model_len={model.max_model_len} tokens "
            f"needs {e.need_bytes / 2**20:.0f} MiB of KV per pool, but this cluster has no GPUs "
            f"and its pools hold {pool_bytes / 2**20:.0f} MiB of host memory each; fix: raise "
            f"the pool size to at least {-(-e.need_bytes // 2**20)} MiB (raykv up --pool-mem "
            f"{-(-e.need_bytes // 2**20)}MiB, or pool_bytes= in add_model){shorter}",
            need_bytes=e.need_bytes,
            fits_len=e.fits_len,
        ) from None


def _gpu_bytes_probe(fraction: float) -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(min(free, total * fraction))


class Coordinator:
    def __init__(self) -> None:
        self.models: dict[str, ServedModel] = {}
        self.plans: dict[str, Any] = {}
        self.members: dict[str, Member] = {}
        self.index = PrefixIndex()
        self.metrics = ServiceMetrics("coordinator")
        self.started = time.time()
        self.restarts = ray.get_runtime_context().was_current_actor_reconstructed
        self._ready: asyncio.Event | None = None
        self._health: asyncio.Task | None = None
        self._placed_on: set[str] = set()  # nodes _place has seen (new ones get placed)
        self._expected: dict[str, str] = {}  # member name -> node: what _place started
        self._placing: asyncio.Task | None = None
        self._place_lock = asyncio.Lock()  # one _place at a time (TP placement groups by name)
        self._managers: dict[str, Any] = {}  # model -> its group managers (hit rules)
        self._watches: dict[str, tuple[str, asyncio.Task]] = {}  # name -> (actor id, watch)

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
            except Exception:  # dead or dying: it holds nothing we can serve
                pass

        await asyncio.gather(*(snap(n) for n in names))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            with contextlib.suppress(Exception):  # the loop must outlive a bad tick
                alive = self._drop_dead()
                gone = [n for n, nid in self._expected.items() if nid in alive]
                gone = [n for n in gone if n not in self.members]
                idle = self._placing is None or self._placing.done()
                if self.models and idle and (alive - self._placed_on or gone):
                    # a node joined (give it a tier and pools), or a member on a live node
                    # died (start a fresh one: its blocks are misses, its name serves again)
                    self._placing = asyncio.get_running_loop().create_task(self._replace())

    async def _replace(self) -> None:
        with contextlib.suppress(Exception):  # e.g. no free GPU yet: the next tick retries
            await self._place()

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
            except Exception:  # e.g. an older member without ``watch``: heartbeats decide
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
            gpus = [int(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]]
            if any(gpus) and self.models:
                raise ConfigError(
                    f"cannot serve model {model.name!r} next to {sorted(self.models)} on GPUs: "
                    "a GPU pool takes a whole GPU (num_gpus=1) and the served model's pools "
                    "hold every GPU of the cluster; serve one model per raykv service on GPUs "
                    "(raykv down first, or run another Ray cluster)"
                )
            if any(gpus) and max(gpus) < model.tp_size:
                raise ConfigError(
                    f"model {model.name!r} has tp_size={model.tp_size}, but the largest node "
                    f"has {max(gpus)} GPU(s) and a TP group lives on one node; lower tp_size "
                    f"to at most {max(gpus)} or add a node with {model.tp_size} GPUs"
                )
            gpu_bytes = model.pool_bytes or await self._probe_gpu_bytes(model)
            plan = _plan_or_explain(model, gpu_bytes, on_gpus=any(gpus))
            check_servable(plan)
            self.plans[model.name] = plan
            self.models[model.name] = model
        await self._place()
        return self.plans[model.name]

    async def _probe_gpu_bytes(self, model: ServedModel) -> int:
        if not any(n["Alive"] and n["Resources"].get("GPU", 0) for n in ray.nodes()):
            return DEFAULT_POOL_BYTES
        ref = ray.remote(num_gpus=1, num_cpus=0)(_gpu_bytes_probe).remote(model.gpu_mem_fraction)
        try:
            return await asyncio.wait_for(ref, PLACE_TIMEOUT_S)
        except TimeoutError:
            ray.cancel(ref, force=True)
            raise ServiceError(
                f"no GPU was free within {PLACE_TIMEOUT_S:.0f}s to size model {model.name!r}'s "
                "pools (a GPU pool takes a whole GPU); free one, or pass pool_bytes "
                "(raykv up --pool-mem)"
            ) from None

    async def _place(self) -> None:
        """Start whatever is missing on every alive node that runs engines: its CPU tier and
        the TP groups of every model. On a cluster with GPUs only GPU nodes run engines (a
        CPU-only node, e.g. a KubeRay head, gets nothing: a CPU-device pool there would take
        the GPU plan's bytes of host memory); without GPUs every node gets CPU-device pools."""
        async with self._place_lock:
            await self._place_all()

    async def _place_all(self) -> None:
        from raykv.service.cpu_tier import CpuTierActor

        nodes = [n for n in ray.nodes() if n["Alive"]]
        starting = []
        for node, groups in zip(nodes, engine_groups(nodes, self.models), strict=True):
            nid = node["NodeID"]
            self._placed_on.add(nid)
            num_gpus = int(node["Resources"].get("GPU", 0))
            if not any(groups.values()):
                continue
            pin = NodeAffinitySchedulingStrategy(nid, soft=False)
            tier = (
                ray.remote(CpuTierActor)
                .options(name=tier_name(nid), scheduling_strategy=pin, **_DETACHED)
                .remote(nid, dict(self.plans))
            )
            self._expected[tier_name(nid)] = nid
            starting.append(self._started(tier, tier_name(nid), nid))
            for name, n in groups.items():
                for i in range(n):
                    self._expected[pool_name(name, nid, i)] = nid
                    starting.append(self._place_group(name, nid, i, num_gpus > 0))
        await asyncio.gather(*starting)

    async def _started(self, actor: Any, name: str, nid: str) -> str:
        """``actor.start()``, or ServiceError (and the actor killed) if Ray cannot run it
        within PLACE_TIMEOUT_S: a request that can never be scheduled must not hang."""
        try:
            return await asyncio.wait_for(actor.start.remote(), PLACE_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise ServiceError(
                f"{name} did not start on node {nid[:12]} within {PLACE_TIMEOUT_S:.0f}s; "
                "check that node's free resources (a GPU pool needs a whole free GPU)"
            ) from None

    async def _place_group(self, model: str, nid: str, index: int, gpu: bool) -> str:
        """One TP group of ``model`` on node ``nid``: tp_size=1 is one pool pinned to the
        node; more ranks share a STRICT_PACK placement group on that node (one GPU per
        bundle, or a sliver of CPU for CPU-device pools: bundles cannot be empty)."""
        from raykv.service.gpu_pool import GpuPool
        from raykv.service.rank import RankPool

        m, plan = self.models[model], self.plans[model]
        pname, device = pool_name(model, nid, index), "cuda" if gpu else "cpu"
        if m.tp_size == 1:
            pin = NodeAffinitySchedulingStrategy(nid, soft=False)
            pool = (
                ray.remote(GpuPool)
                .options(name=pname, num_gpus=int(gpu), scheduling_strategy=pin, **_DETACHED)
                .remote(pname, m, plan, nid, device)
            )
            return await self._started(pool, pname, nid)
        pg = await self._tp_placement(pname, nid, m.tp_size, gpu)
        ranks = [rank_name(pname, r) for r in range(1, m.tp_size)]

        def in_bundle(r: int) -> dict:
            return dict(
                num_gpus=int(gpu),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r),
                **_DETACHED,
            )

        for r, rname in enumerate(ranks, start=1):
            ray.remote(RankPool).options(name=rname, **in_bundle(r)).remote(rname, plan, r, device)
        pool = (
            ray.remote(GpuPool)
            .options(name=pname, **in_bundle(0))
            .remote(pname, m, plan, nid, device, ranks)
        )
        return await self._started(pool, pname, nid)

    async def _tp_placement(self, pool: str, nid: str, tp: int, gpu: bool) -> Any:
        from ray.util.placement_group import get_placement_group, placement_group

        name = group_name(pool)
        try:
            pg = get_placement_group(name)
            if ray.util.placement_group_table(pg).get("state") == "REMOVED":
                raise ValueError(name)  # left by an earlier ``raykv down``: make a new one
        except ValueError:
            bundle = {"GPU": 1} if gpu else {"CPU": CPU_POOL_SLIVER}
            pg = placement_group(
                [dict(bundle) for _ in range(tp)],
                strategy="STRICT_PACK",
                name=name,
                lifetime="detached",
                bundle_label_selector=[{NODE_LABEL: nid} for _ in range(tp)],
            )
        try:
            await asyncio.wait_for(pg.ready(), PLACE_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(pg)
            raise ServiceError(
                f"could not place a TP group of {tp} ranks on node {nid[:12]} within "
                f"{PLACE_TIMEOUT_S:.0f}s (placement group {name!r}); check its free "
                f"{'GPUs' if gpu else 'CPUs'}"
            ) from None
        return pg

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
        self.model(model)
        pools = [m for m in self.members.values() if m.kind == "pool" and m.model == model]
        if node_id is None:
            return sorted(m.name for m in pools)
        names = sorted(m.name for m in pools if m.node_id == node_id)
        if names:
            return names
        nodes = [n for n in ray.nodes() if n["Alive"]]
        groups = dict(
            zip((n["NodeID"] for n in nodes), engine_groups(nodes, self.models), strict=True)
        )
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
        self._forget(name)
        for model, plan in snap.get("models", {}).items():
            if model not in self.models:
                self.models[model], self.plans[model] = plan
        tier = CPU if snap["kind"] == "tier" else GPU
        self.members[name] = Member(
            name,
            snap["kind"],
            snap["node_id"],
            snap.get("model"),
            snap["seq"],
            stats=snap.get("stats", {}),
            actor_id=snap.get("actor_id"),
        )
        self._watch(name, snap.get("actor_id"))
        for model, blocks in snap["blocks"].items():
            for h, b in blocks:
                self.index.add(model, Location(name, snap["node_id"], tier, b), h)

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
        stored: list[tuple[Hashable, int]],
        removed: list[Hashable],
    ) -> bool:
        """Apply one batch of KV events; False when a batch is missing (send a snapshot)."""
        await self._up()
        m = self.members.get(name)
        if m is None or seq != m.seq + 1:
            return False
        m.seq, m.last_seen = seq, time.monotonic()
        tier = CPU if m.kind == "tier" else GPU
        for h in removed:
            self.index.remove(model, name, h)
        for h, b in stored:
            self.index.add(model, Location(name, m.node_id, tier, b), h)
        return True

    async def member_failed(self, name: str) -> None:
        """A caller could not reach ``name``: stop pointing lookups at it until it
        re-registers (a live member does so on its next heartbeat)."""
        await self._up()
        self._forget(name)

    # --- lookup -------------------------------------------------------------------------

    async def lookup(
        self, model: str, keys: list, node_id: str, limit: int | None = None
    ) -> dict[str, Any]:
        """The longest prefix (<= ``limit`` tokens) every group can serve, with ``keys`` per
        group (a one-group model also takes a flat list): ``hit_tokens``, and ``runs`` of
        ``(tier, node_id, num_blocks)`` of the best copies, seen from ``node_id``, of the
        blocks the primary group (full attention / MLA, else the first) needs for it. Runs
        keep the answer small: a 32k-token prompt is 2048 blocks."""
        await self._up()
        t0 = time.perf_counter()
        _, plan = self.model(model)
        if keys and not isinstance(keys[0], list):
            keys = [keys]
        if len(keys) != len(plan.groups):
            raise InvalidInput(
                f"model {model!r} has {len(plan.groups)} KV groups, lookup got keys for {len(keys)}"
            )
        mgrs = self._managers.get(model)
        if mgrs is None:
            mgrs = self._managers[model] = managers(plan)
        best: dict[tuple[int, int], Location | None] = {}

        def where(gi: int, j: int) -> Location | None:
            if (gi, j) not in best:
                copies = self.index.copies(model, keys[gi][j])
                best[gi, j] = min(copies, key=lambda c: c.rank(node_id)) if copies else None
            return best[gi, j]

        cap = key_limit(plan, keys)
        cap = cap if limit is None else min(cap, limit)
        hit = common_hit(mgrs, lambda gi, j: where(gi, j) is not None, cap)
        p = primary_group(plan)
        runs: list[list] = []
        for j in needed_slots(mgrs[p], hit):
            loc = where(p, j)
            if runs and runs[-1][0] == loc.tier and runs[-1][1] == loc.node_id:
                runs[-1][2] += 1
            else:
                runs.append([loc.tier, loc.node_id, 1])
        for tier, node, n in runs:
            self.metrics.hit(model, f"{'local' if node == node_id else 'remote'}_{tier}", n)
        looked = cap // plan.groups[p].block_size
        self.metrics.miss(model, "all", looked - hit // plan.groups[p].block_size)
        self.metrics.lookup_ms(model, (time.perf_counter() - t0) * 1e3)
        return {"hit_tokens": hit, "runs": [tuple(r) for r in runs]}

    async def locate(self, model: str, block_hashes: list[Hashable], node_id: str) -> list:
        """Every copy of each block, best first (a loader falls back when one fails)."""
        await self._up()
        return [
            sorted(self.index.copies(model, h), key=lambda loc: loc.rank(node_id))
            for h in block_hashes
        ]

    # --- stats and shutdown -------------------------------------------------------------

    async def stats(self) -> dict:
        await self._up()
        nodes = {
            n["NodeID"]: {
                "node_id": n["NodeID"],
                "address": n["NodeManagerAddress"],
                "alive": n["Alive"],
                "gpus": int(n["Resources"].get("GPU", 0)),
            }
            for n in ray.nodes()
        }
        members = [
            {
                "name": m.name,
                "kind": m.kind,
                "node_id": m.node_id,
                "model": m.model,
                "indexed_blocks": self.index.blocks_of(m.name),
                "heartbeat_age_s": round(time.monotonic() - m.last_seen, 2),
                **m.stats,
            }
            for m in sorted(self.members.values(), key=lambda m: (m.node_id, m.kind, m.name))
        ]
        tally = self.metrics.tally
        hits = sum(v for k, v in tally.items() if k.startswith("hits_"))
        looked = hits + tally["misses_all"]
        return {
            "nodes": list(nodes.values()),
            "models": {
                name: {
                    "max_model_len": m.max_model_len,
                    "block_size": m.block_size,
                    "tp_size": m.tp_size,
                    "groups": [
                        [g.spec.kind, g.block_size, len(g.layer_names)]
                        for g in self.plans[name].groups
                    ],
                    "num_gpu_blocks": self.plans[name].num_gpu_blocks,
                    "cpu_num_blocks": self.plans[name].cpu_num_blocks,
                    "cpu_bytes_per_block": self.plans[name].cpu_bytes_per_block,
                    "block_size_factor": self.plans[name].block_size_factor,
                }
                for name, m in self.models.items()
            },
            "members": members,
            "indexed_blocks": len(self.index),
            "lookups": tally["lookups"],
            "hit_rate": hits / looked if looked else 0.0,
            "hits": {k.removeprefix("hits_"): v for k, v in tally.items() if k.startswith("hits_")},
            "misses": tally["misses_all"],
            # copies that failed their checksum (invariant 12: served as misses), per member
            "checksum_errors": sum(m.get("checksum_errors", 0) for m in members),
            "uptime_s": round(time.time() - self.started, 1),
            "restarted": self.restarts,
        }

    async def shutdown_service(self, admin: str | None = None) -> int:
        """Kill every pool, TP rank and tier and remove the TP placement groups (``raykv
        down``, with the admin key: ``raykv.service.admin``); the caller then kills this
        actor. Returns the actors killed."""
        from ray.util.placement_group import PlacementGroup, remove_placement_group

        from raykv.service.admin import admin_key, check_admin

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
            with contextlib.suppress(Exception):  # gone already
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
        for pg_id, pg in ray.util.placement_group_table().items():
            if pg.get("name", "").startswith("raykv-tp-") and pg.get("state") != "REMOVED":
                with contextlib.suppress(Exception):  # removed meanwhile
                    remove_placement_group(PlacementGroup(ray.PlacementGroupID.from_hex(pg_id)))
        self.members.clear()
        self._expected.clear()
        self._placed_on.clear()
        self.index = PrefixIndex()
        self.models.clear()
        self.plans.clear()
        self._managers.clear()
        return len(names)


def coordinator_actor(max_restarts: int = -1):
    """The ``ray.remote`` form, created by ``raykv.client.ensure_service``."""
    return ray.remote(Coordinator).options(
        name=COORDINATOR,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=max_restarts,
        max_task_retries=3,
        num_cpus=0,
    )

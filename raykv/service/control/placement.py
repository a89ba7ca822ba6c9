"""Placement: where the service's members run, and starting the ones that are missing.

On a cluster with GPUs only GPU nodes run engines: each gets ``num_gpus // tp_size`` TP
groups of a model (a CPU-only node, e.g. a KubeRay head, gets nothing: a CPU-device pool
there would take the GPU plan's bytes of host memory); without GPUs every node gets one
group of CPU-device pools (development and CI); a model served without pools
(``ServedModel.pools`` False: its engines keep their own KV) gets none. Every node that
runs engines gets a CPU tier. A TP group of ``tp_size`` ranks lives on one node: tp_size=1
is one pool pinned to the node; more ranks share a STRICT_PACK placement group there (one
GPU per bundle, or a sliver of CPU for CPU-device pools: bundles cannot be empty). Members
are detached actors named after their slot (``raykv.service.served``), so a fresh one
placed after a death serves under the same name on the same node (and GPU slot). Every
wait is bounded by PLACE_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from raykv.errors import ConfigError, RaykvError, ServiceError
from raykv.service.served import (
    DEFAULT_POOL_BYTES,
    NAMESPACE,
    ServedModel,
    group_name,
    pool_name,
    rank_name,
    tier_name,
)

PLACE_TIMEOUT_S = 60.0
CPU_POOL_SLIVER = 0.01  # CPU share a CPU-device pool's bundle reserves (bundles can't be empty)
NODE_LABEL = "ray.io/node-id"  # Ray's built-in node label: pins a TP group's bundles
DETACHED = dict(
    namespace=NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=0, num_cpus=0
)


def alive_nodes() -> list[dict]:
    return [n for n in ray.nodes() if n["Alive"]]


def node_gpus(node: dict) -> int:
    return int(node["Resources"].get("GPU", 0))


def engine_groups(nodes: list[dict], models: dict[str, ServedModel]) -> list[dict[str, int]]:
    """Per node (``ray.nodes()`` entries): how many TP groups of each model it hosts. With
    GPUs in the cluster, ``num_gpus // tp_size`` on each node (none on CPU-only nodes: a
    CPU-device pool there would take the GPU plan's bytes of host memory); without, one
    group of CPU-device pools per node (development and CI)."""
    gpus = [node_gpus(n) for n in nodes]
    return [
        {name: (g // m.tp_size if any(gpus) else 1) if m.pools else 0 for name, m in models.items()}
        for g in gpus
    ]


def runs_engines(node: dict, nodes: list[dict]) -> bool:
    """Whether engines run on ``node`` (then it gets a CPU tier, and with it the node agent
    engines connect to, before any model is served): every GPU node, or every node of a
    cluster without GPUs."""
    return node_gpus(node) > 0 or not any(node_gpus(n) for n in nodes)


def node_groups(models: dict[str, ServedModel]) -> dict[str, dict[str, int]]:
    """``engine_groups`` of the alive nodes, by node id."""
    nodes = alive_nodes()
    return dict(zip((n["NodeID"] for n in nodes), engine_groups(nodes, models), strict=True))


def check_placeable(model: ServedModel, served: dict[str, ServedModel]) -> bool:
    """ConfigError if ``model`` cannot be placed beside ``served`` on this cluster; returns
    whether the cluster has GPUs (its pools then live on GPUs)."""
    gpus = [node_gpus(n) for n in alive_nodes()]
    if not model.pools:  # holds no GPU
        return any(gpus)
    pooled = sorted(name for name, m in served.items() if m.pools)
    if any(gpus) and pooled:
        raise ConfigError(
            f"cannot serve model {model.name!r} next to {pooled} on GPUs: "
            "a GPU pool takes a whole GPU (num_gpus=1) and the served model's pools "
            "hold every GPU of the cluster; serve one model with pools per raykv service on "
            "GPUs (raykv down first, or run another Ray cluster), or this one with "
            "pools=False (its engines keep their own KV)"
        )
    if any(gpus) and max(gpus) < model.tp_size:
        raise ConfigError(
            f"model {model.name!r} has tp_size={model.tp_size}, but the largest node "
            f"has {max(gpus)} GPU(s) and a TP group lives on one node; lower tp_size "
            f"to at most {max(gpus)} or add a node with {model.tp_size} GPUs"
        )
    return any(gpus)


def _gpu_bytes_probe(fraction: float) -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return int(min(free, total * fraction))


async def probe_gpu_bytes(model: ServedModel) -> int:
    """KV bytes of one GPU pool (``gpu_mem_fraction`` of a free GPU's memory, measured on a
    GPU), or DEFAULT_POOL_BYTES on a cluster without GPUs or for a model without pools."""
    if not model.pools or not any(node_gpus(n) for n in alive_nodes()):
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


def _why(error: BaseException) -> str:
    """The cause of a member's failed start, in one line: a raykv error's message, else the
    last line Ray gives (an actor that died in its constructor: that exception)."""
    cause = getattr(error, "cause", None)
    if isinstance(error, RaykvError) or isinstance(cause, RaykvError):
        return str(error if isinstance(error, RaykvError) else cause)
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    text = lines[-1] if lines else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class PlacementFailed(ServiceError):
    """Members ``place`` could not start: ``failed`` lists (member name, its model, or None
    for a CPU tier, and the error); the others started."""

    def __init__(self, failed: list[tuple[str, str | None, BaseException]]) -> None:
        self.failed = failed
        name, _, error = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        super().__init__(f"{name} could not start{more}: {_why(error)}")


class Placer:
    """Starts whatever is missing on every alive node that runs engines, one placement at a
    time, and remembers what it started (``expected``, and each pool's model) and which nodes
    it has seen (``placed_on``), so the coordinator's health loop knows when to place again."""

    def __init__(self) -> None:
        self.placed_on: set[str] = set()  # nodes place() has seen (new ones get placed)
        self.expected: dict[str, str] = {}  # member name -> node: what place() started
        self.model_of: dict[str, tuple[str, int]] = {}  # pool name -> (model, tp_size)
        self._lock = asyncio.Lock()  # one place() at a time (TP placement groups by name)

    def missing(self, alive: set[str], members: dict[str, Any]) -> bool:
        """A node joined (give it a tier and pools), or a member on a live node died
        (start a fresh one: its blocks are misses, its name serves again)."""
        gone = [n for n, nid in self.expected.items() if nid in alive and n not in members]
        return bool(alive - self.placed_on or gone)

    def clear(self) -> None:
        self.expected.clear()
        self.model_of.clear()
        self.placed_on.clear()

    async def place(self, models: dict[str, ServedModel], plans: dict[str, Any]) -> None:
        """Start what is missing; PlacementFailed names every member that did not start."""
        async with self._lock:
            await self._place_all(models, plans)

    async def withdraw(self, model: str) -> list[str]:
        """Stop placing ``model`` and kill what ``place`` started of it: its pools, their TP
        ranks and placement groups (after any placement under way). Returns the pools."""
        from ray.util.placement_group import get_placement_group, remove_placement_group

        async with self._lock:
            pools = [(n, tp) for n, (m, tp) in self.model_of.items() if m == model]
            for name, tp in pools:
                self.expected.pop(name, None)
                self.model_of.pop(name, None)
                for actor in [name, *(rank_name(name, r) for r in range(1, tp))]:
                    with contextlib.suppress(ValueError):  # never started, or gone already
                        ray.kill(ray.get_actor(actor, namespace=NAMESPACE), no_restart=True)
                if tp > 1:
                    with contextlib.suppress(ValueError):  # never made
                        remove_placement_group(get_placement_group(group_name(name)))
        return [n for n, _ in pools]

    async def _place_all(self, models: dict[str, ServedModel], plans: dict[str, Any]) -> None:
        from raykv.service.tier.actor import CpuTierActor

        nodes = alive_nodes()
        starting: list[tuple[str, str | None, Any]] = []  # (member, its model, its start)
        for node, groups in zip(nodes, engine_groups(nodes, models), strict=True):
            nid = node["NodeID"]
            self.placed_on.add(nid)
            if not runs_engines(node, nodes):
                continue
            pin = NodeAffinitySchedulingStrategy(nid, soft=False)
            tier = (
                ray.remote(CpuTierActor)
                .options(name=tier_name(nid), scheduling_strategy=pin, **DETACHED)
                .remote(nid, dict(plans))
            )
            self.expected[tier_name(nid)] = nid
            starting.append((tier_name(nid), None, self._tier_started(tier, nid, plans)))
            for name, n in groups.items():
                for i in range(n):
                    pname = pool_name(name, nid, i)
                    self.expected[pname] = nid
                    self.model_of[pname] = (name, models[name].tp_size)
                    group = self._place_group(models[name], plans[name], nid, i, node_gpus(node))
                    starting.append((pname, name, group))
        done = await asyncio.gather(*(start for *_, start in starting), return_exceptions=True)
        failed = [
            (name, model, e)
            for (name, model, _), e in zip(starting, done, strict=True)
            if isinstance(e, BaseException)
        ]
        if failed:
            raise PlacementFailed(failed)

    async def _started(self, actor: Any, name: str, nid: str) -> str:
        """``actor.start()``, or ServiceError (and the actor killed) if Ray cannot run it
        within PLACE_TIMEOUT_S: a request that can never be scheduled must not hang."""
        try:
            return await asyncio.wait_for(actor.start.remote(), PLACE_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(Exception):  # dead already: nothing left to stop
                ray.kill(actor, no_restart=True)
            raise ServiceError(
                f"{name} did not start on node {nid[:12]} within {PLACE_TIMEOUT_S:.0f}s; "
                "check that node's free resources (a GPU pool needs a whole free GPU)"
            ) from None

    async def _tier_started(self, tier: Any, nid: str, plans: dict[str, Any]) -> str:
        """A node's tier started, with an arena for every model (idempotent: a tier that was
        running keeps its arenas): a model without pools has no pool to add it."""
        started = await self._started(tier, tier_name(nid), nid)
        await asyncio.gather(*(tier.add_model.remote(m, plan) for m, plan in plans.items()))
        return started

    async def _place_group(
        self, m: ServedModel, plan: Any, nid: str, index: int, num_gpus: int
    ) -> str:
        """One TP group of ``m`` on node ``nid`` (see the module docstring)."""
        from raykv.service.pool.gpu_pool import GpuPool
        from raykv.service.pool.rank import RankPool

        gpu = num_gpus > 0
        pname, device = pool_name(m.name, nid, index), "cuda" if gpu else "cpu"
        if m.tp_size == 1:
            pin = NodeAffinitySchedulingStrategy(nid, soft=False)
            pool = (
                ray.remote(GpuPool)
                .options(name=pname, num_gpus=int(gpu), scheduling_strategy=pin, **DETACHED)
                .remote(pname, m, plan, nid, device)
            )
            return await self._started(pool, pname, nid)
        pg = await tp_placement(pname, nid, m.tp_size, gpu)
        ranks = [rank_name(pname, r) for r in range(1, m.tp_size)]

        def in_bundle(r: int) -> dict:
            return dict(
                num_gpus=int(gpu),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r),
                **DETACHED,
            )

        for r, rname in enumerate(ranks, start=1):
            ray.remote(RankPool).options(name=rname, **in_bundle(r)).remote(rname, plan, r, device)
        pool = (
            ray.remote(GpuPool)
            .options(name=pname, **in_bundle(0))
            .remote(pname, m, plan, nid, device, ranks)
        )
        return await self._started(pool, pname, nid)


async def tp_placement(pool: str, nid: str, tp: int, gpu: bool) -> Any:
    """The STRICT_PACK placement group of pool ``pool``'s TP group on node ``nid`` (made if
    missing, or if an earlier ``raykv down`` removed it), ready."""
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
        with contextlib.suppress(Exception):  # removed meanwhile: nothing left to remove
            ray.util.remove_placement_group(pg)
        raise ServiceError(
            f"could not place a TP group of {tp} ranks on node {nid[:12]} within "
            f"{PLACE_TIMEOUT_S:.0f}s (placement group {name!r}); check its free "
            f"{'GPUs' if gpu else 'CPUs'}"
        ) from None
    return pg

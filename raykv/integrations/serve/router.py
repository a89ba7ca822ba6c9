"""``RaykvRouter``: a Ray Serve request router that ranks replicas by expected time to first
token, from where raykv holds each request's prefix.

    serve.deployment(..., request_router_config=RequestRouterConfig(
        request_router_class="raykv.integrations.serve.router.RaykvRouter",
        request_router_kwargs={"model": "llama"},        # the raykv model the replicas serve
    ))

For each request (its prompt's token ids: the first argument with a ``prompt_token_ids``
attribute or key), the router hashes the prompt's blocks as the engines do and looks them up
once in its own replica of the cluster's prefix index (``PlacementView``: no call on the
request's path), which says, for every candidate replica's node, how many leading tokens it
would load from its GPU pools, its CPU tier, or pull from another node. It ranks the
candidates by ``RouteCosts.ttft_s``: the prefill tokens queued ahead on the replica (what
this router sent it whose prefills should not be done yet, at the measured costs, and the rest
of its queue at the mean request size), the prompt's uncached tokens, and the loads. So a
request goes where its prefix is while that replica is not busier than the prefix is worth,
and otherwise to a less busy replica, whose engine then pulls the blocks (route-or-pull).
Serve takes the first ranked replica whose queue has room.

Failures never fail a request: with no token ids, no raykv service, or an index that has
not answered for ``PlacementView.STALE_S``, the router picks as Serve's default does (the
less loaded of two random replicas), logged once per cause and counted. A stale index only
misranks (the engine loads what is really there, verified). Every ``REPORT_S`` the router
reports its constants and decisions to the coordinator: ``raykv status`` lists them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import ray
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from raykv.blocks.hashing import BlockHasher, Tenant
from raykv.integrations.serve.costs import RouteCosts
from raykv.integrations.serve.placement import NodeHit, PlacementView
from raykv.integrations.vllm.config import request_tenant
from raykv.service.groups import group_keys, primary_group
from raykv.service.served import COORDINATOR, NAMESPACE

log = logging.getLogger(__name__)
REPORT_S = 5.0  # how often a router tells the coordinator its constants and decisions
COSTS_S = 1.0  # how long the replicas' measured costs are reused before they are read again
PLAN_RETRY_S = 1.0  # the model's plan not got: asked again after this long (not per request)
SENT_KEEP = 100_000  # requests remembered until completed (a lost completion ages out)


def routed_prompt(request: PendingRequest | None) -> tuple[list[int], Tenant] | None:
    """The token ids of ``request``'s prompt and its tenant (its ``cache_salt``, keyed as the
    connector keys the engine's request: ``request_tenant``), from the first argument
    (positional, then keyword) with a ``prompt_token_ids`` attribute or key; None if none
    has."""
    if request is None:
        return None
    for arg in (*(request.args or ()), *(request.kwargs or {}).values()):
        if isinstance(arg, Mapping):
            ids, arg = arg.get("prompt_token_ids"), SimpleNamespace(**arg)
        else:
            ids = getattr(arg, "prompt_token_ids", None)
        if ids is not None:
            return [int(t) for t in ids], request_tenant(arg)
    return None


class RaykvRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Serve's ``RequestRouter`` over raykv's prefix index (see the module docstring)."""

    def initialize_state(
        self,
        model: str,
        costs: Mapping[str, Any] | None = None,
        namespace: str = NAMESPACE,
        refresh_s: float = 0.1,
        replica_cache_tokens: int | None = None,
    ) -> None:
        """``model``: the raykv model the replicas serve; ``costs``: fixed constants
        (``RouteCosts.configured``) instead of the replicas' measurements; ``refresh_s``:
        how often the index replica takes the coordinator's changes;
        ``replica_cache_tokens``: the size of a replica's own KV cache, where the replicas do
        not report it (``kv_cache_tokens`` in their routing stats; neither: not counted)."""
        self._model, self._namespace = model, namespace
        self._fixed = RouteCosts.configured(costs) if costs else None
        self._costs, self._costs_at = RouteCosts(), 0.0
        self._view = PlacementView(refresh_s, namespace)  # started with the first request
        self._plan: Any = None
        self._hasher: BlockHasher | None = None
        self._plan_failed_at = -PLAN_RETRY_S
        # tokens to compute this router sent each replica that have not finished
        self._queued: Counter[ReplicaID] = Counter()
        self._in_flight: Counter[ReplicaID] = Counter()
        # once costs are known, per replica when the prefills (and loads) this router sent it
        # should be done (monotonic s): a prefill is over at its first token, long before
        # its request completes (decode), so a completion comes too late to say it
        self._busy_until: dict[ReplicaID, float] = {}
        self._sent: dict[str, tuple[ReplicaID, int]] = {}  # request id -> (replica, tokens)
        self._mean_tokens = 0.0  # of the requests routed: a queued request it did not send
        # request id -> per candidate (tokens it would compute, its hit): for on_request_routed
        self._ranked: dict[str, tuple[list[bytes], dict[ReplicaID, tuple[int, NodeHit, int]]]] = {}
        # per replica, the block keys of the prompts sent to it, oldest first: what its own
        # KV cache (vLLM's prefix cache) likely holds, kept to the size it reports
        self._recent: dict[ReplicaID, OrderedDict[bytes, None]] = {}
        self._cache_tokens = replica_cache_tokens
        self.decisions: Counter[str] = Counter()
        self._warned: set[str] = set()
        self._reporter: asyncio.Task[None] | None = None

    def _start(self) -> None:
        """The index replica's refreshes and the reports to ``raykv status``, as tasks on
        the router's own event loop (from the first request on: Serve builds routers in
        processes that may never route). Not threads: a thread inside a Ray call while the
        process shuts Ray down crashes it; the loop makes its calls as Serve's own do."""
        self._view.start()
        loop = asyncio.get_running_loop()
        self._reporter = loop.create_task(_report_while_used(weakref.ref(self)))

    # --- ranking --------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """The candidates, best first (one per rank), or two random ones where the index
        cannot rank them."""
        if not candidate_replicas:
            return []
        if self._reporter is None:
            self._start()
        prompt = routed_prompt(pending_request)
        if prompt is None:
            return self._fall_back(candidate_replicas, "no_token_ids")
        ids, tenant = prompt
        if not await self._view.ready():
            return self._fall_back(candidate_replicas, "index_unavailable")
        try:
            keys = await self._keys(ids, tenant)
        except Exception as e:  # the service is down or does not serve the model
            return self._fall_back(candidate_replicas, "no_plan", e)
        nodes = {r.node_id for r in candidate_replicas}
        hits = self._view.hits(self._model, keys, nodes, self._block_size())
        costs = self.costs()
        n = max(len(ids) - 1, 0)  # an engine computes the last token whatever it holds

        bs = self._block_size()
        own = {r.replica_id: self._own(r.replica_id, keys) * bs for r in candidate_replicas}

        def ttft(r: RunningReplica) -> tuple[float, int, int, int]:
            # ties (loads not measured yet: free) go to fewer pulled, more GPU-held tokens
            hit, mine = hits[r.node_id], own[r.replica_id]
            queued = self._queued_tokens(r.replica_id)
            t = costs.ttft_s(queued, n, hit, mine)
            return t, hit.remote, -max(hit.gpu, mine), self._queue_len(r.replica_id)

        ranked = sorted(candidate_replicas, key=ttft)
        rid = pending_request.metadata.internal_request_id
        self._ranked[rid] = (
            keys,
            {
                r.replica_id: (
                    max(n - max(hits[r.node_id].tokens, own[r.replica_id]), 0),
                    hits[r.node_id],
                    own[r.replica_id],
                )
                for r in candidate_replicas
            },
        )
        return [[r] for r in ranked]

    def _own(self, replica: ReplicaID, keys: list[bytes]) -> int:
        """Leading ``keys`` sent to ``replica`` lately (its own KV cache likely holds them)."""
        recent = self._recent.get(replica)
        if not recent:
            return 0
        n = 0
        for k in keys:
            if k not in recent:
                break
            n += 1
        return n

    def _remember(self, replica: ReplicaID, keys: list[bytes]) -> None:
        """``replica`` computes or loads ``keys`` now: its own cache holds them, newest last,
        as many as fit in the cache size it reports."""
        wrapper = self._replicas.get(replica)
        stats = (wrapper.routing_stats or {}) if wrapper is not None else {}
        size = stats.get("kv_cache_tokens", self._cache_tokens)
        if not isinstance(size, int) or size <= 0 or not keys:
            return
        recent = self._recent.setdefault(replica, OrderedDict())
        for k in keys:
            recent[k] = None
            recent.move_to_end(k)
        for _ in range(len(recent) - size // self._block_size()):
            recent.popitem(last=False)

    async def _keys(self, ids: Sequence[int], tenant: Tenant = None) -> list[bytes]:
        """The prompt's block keys of the plan's primary group (whole blocks, all but the
        last token, as an engine's lookup takes them), under its tenant."""
        if self._plan is None:
            if time.monotonic() - self._plan_failed_at < PLAN_RETRY_S:
                raise LookupError(f"no plan of {self._model!r} yet")
            try:
                coordinator = ray.get_actor(COORDINATOR, namespace=self._namespace)
                _, plan = await coordinator.get_model.remote(self._model)
            except Exception:
                self._plan_failed_at = time.monotonic()
                raise
            self._plan, self._hasher = plan, BlockHasher(plan.hash_block_size)
        plan, hbs = self._plan, self._plan.hash_block_size
        end = max(len(ids) - 1, 0) // hbs
        if end == 0:
            return []
        blob = self._hasher.hash_blocks_joined(ids, end_block=end, tenant=tenant)
        return group_keys(plan, blob)[primary_group(plan)]

    def _block_size(self) -> int:
        return self._plan.groups[primary_group(self._plan)].block_size

    def _queue_len(self, replica: ReplicaID) -> int:
        got = self._replica_queue_len_cache.get(replica)
        return self._in_flight[replica] if got is None else got

    def _queued_tokens(self, replica: ReplicaID) -> float:
        """Prefill tokens ahead of a new request: what this router sent and is not done (with
        measured costs: the time left until its prefills should be done, in tokens; before:
        until the requests complete), and the rest of the replica's queue (other routers'
        requests) at the mean size."""
        others = max(self._queue_len(replica) - self._in_flight[replica], 0)
        p = self.costs().prefill_s_per_token
        if p:
            left = self._busy_until.get(replica, 0.0) - time.monotonic()
            return max(left, 0.0) / p + others * self._mean_tokens
        return self._queued[replica] + others * self._mean_tokens

    def costs(self) -> RouteCosts:
        """The configured constants, else the replicas' measurements (re-read every
        ``COSTS_S``)."""
        if self._fixed is not None:
            return self._fixed
        now = time.monotonic()
        if now - self._costs_at > COSTS_S:
            stats = [r.routing_stats or {} for r in self._replicas.values()]
            self._costs, self._costs_at = RouteCosts.measured(stats), now
        return self._costs

    def _fall_back(
        self, candidates: list[RunningReplica], why: str, error: Exception | None = None
    ) -> list[list[RunningReplica]]:
        """Serve's default choice: the less loaded of two random candidates."""
        self.decisions[f"fell_back_{why}"] += 1
        if why not in self._warned:
            self._warned.add(why)
            log.warning(
                "raykv router (%s): routing without the prefix index (%s%s); counted in "
                "raykv status", self._model, why, f": {error}" if error else "",
            )  # fmt: skip
        return [random.sample(candidates, min(2, len(candidates)))]

    # --- Serve's callbacks ------------------------------------------------------------------

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        """Count the decision and what the replica now has to compute."""
        rid = pending_request.metadata.internal_request_id
        got = self._ranked.pop(rid, None)
        if got is None or replica_id not in got[1]:
            return
        keys, ranked = got
        tokens, hit, own = ranked[replica_id]
        self._remember(replica_id, keys)
        best_local = max(max(h.local, o) for _, h, o in ranked.values())
        if best_local and max(hit.local, own) >= best_local:
            self.decisions["routed_for_cache"] += 1
        elif best_local:
            self.decisions["routed_for_load"] += 1
        else:
            self.decisions["routed_no_local_prefix"] += 1
        if hit.remote:
            self.decisions["pulls"] += 1
        self.decisions["hit_tokens_replica"] += own
        for path in ("gpu", "cpu", "remote"):  # what it loads, its own cache's part aside
            share = 1 - min(own, hit.tokens) / hit.tokens if hit.tokens else 0
            self.decisions[f"hit_tokens_{path}"] += round(getattr(hit, path) * share)
        self.decisions["prompt_tokens"] += tokens + max(hit.tokens, own)
        self.decisions["routed"] += 1
        self._mean_tokens += (tokens - self._mean_tokens) / self.decisions["routed"]
        if len(self._sent) >= SENT_KEEP:  # completions lost: forget the oldest
            old, (r, t) = next(iter(self._sent.items()))
            del self._sent[old]
            self._done(r, t)
        self._sent[rid] = (replica_id, tokens)
        self._queued[replica_id] += tokens
        self._in_flight[replica_id] += 1
        costs = self.costs()
        if costs.prefill_s_per_token:  # its prefill runs after those already sent there
            now = time.monotonic()
            start = max(self._busy_until.get(replica_id, now), now)
            self._busy_until[replica_id] = start + costs.ttft_s(0, tokens + hit.tokens, hit, own)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        sent = self._sent.pop(internal_request_id, None)
        if sent is not None:
            self._done(*sent)

    def _done(self, replica: ReplicaID, tokens: int) -> None:
        self._queued[replica] = max(self._queued[replica] - tokens, 0)
        self._in_flight[replica] = max(self._in_flight[replica] - 1, 0)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._queued.pop(replica_id, None)
        self._in_flight.pop(replica_id, None)
        self._busy_until.pop(replica_id, None)
        self._recent.pop(replica_id, None)

    # --- raykv status -------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """What ``raykv status`` shows of this router."""
        return {
            "model": self._model,
            "deployment": str(self._deployment_id),
            "costs": self.costs().report(),
            "index_fresh": self._view.fresh,
            "decisions": dict(self.decisions),
            "replicas": [
                {
                    "replica": r.replica_id.unique_id,
                    "node_id": r.node_id,
                    "queued_tokens": round(self._queued_tokens(r.replica_id)),
                }
                for r in self._replicas.values()
            ],
        }


async def _report_while_used(ref: weakref.ref[RaykvRouter]) -> None:
    """Every ``REPORT_S``, the router's ``report`` to the coordinator, until the router is
    dropped or Ray shuts down here."""
    name = f"@{socket.gethostname()}:{os.getpid()}"
    while True:
        await asyncio.sleep(REPORT_S)
        router = ref()
        if router is None or not ray.is_initialized():  # a call would start a new Ray
            return
        try:
            coordinator = ray.get_actor(COORDINATOR, namespace=router._namespace)
            coordinator.router_report.remote(f"{router._deployment_id}{name}", router.report())
        except Exception as e:  # the service is down: the next report may land
            log.debug("raykv router: report not sent (%s)", e)
        del router

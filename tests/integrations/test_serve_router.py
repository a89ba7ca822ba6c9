"""raykv's Ray Serve router: the cost model, the cluster index replica's answers, and the
ranking (route to the prefix while it is worth it, else to a less busy replica that pulls),
without a cluster; the index feed end to end is in test_serve_router_cluster.py."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import ray
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.errors import InvalidInput
from raykv.integrations.serve.costs import RouteCosts
from raykv.integrations.serve.placement import NodeHit, PlacementView
from raykv.integrations.serve.router import RaykvRouter, routed_prompt
from raykv.service.control.index import CPU, GPU

pytestmark = pytest.mark.timeout(120)


def _view(places: dict[bytes, tuple]) -> PlacementView:
    view = PlacementView()
    view.places = {"m": dict(places)}
    view._answered = math.inf  # fresh without a coordinator
    return view


@settings(max_examples=200, deadline=None)
@given(
    held=st.lists(
        st.sets(st.tuples(st.sampled_from("abc"), st.sampled_from((GPU, CPU))), max_size=4),
        max_size=12,
    ),
    block=st.integers(1, 64),
)
def test_a_node_gets_the_leading_held_blocks_from_the_nearest_place(held, block) -> None:
    """Invariant: every node is offered the same prefix (up to the first block nobody
    holds), each block from its own GPU pools before its CPU tier before another node."""
    keys = [bytes([i]) for i in range(len(held))]
    view = _view({k: tuple(p) for k, p in zip(keys, held, strict=True) if p})
    run = next((i for i, p in enumerate(held) if not p), len(held))
    hits = view.hits("m", keys, "abcd", block)
    for node, hit in hits.items():
        assert hit.tokens == run * block
        assert hit.gpu == block * sum((node, GPU) in p for p in held[:run])
        assert hit.cpu == block * sum((node, CPU) in p and (node, GPU) not in p for p in held[:run])
    assert hits["d"] == NodeHit(remote=run * block)
    assert view.hits("other", keys, "a")["a"] == NodeHit()


def test_route_costs_take_the_replicas_median_and_refuse_bad_constants() -> None:
    stats = [
        {"prefill_s_per_token": 2e-4, "load_s_per_token": {"cpu": 1e-6, "remote": 5e-6}},
        {"prefill_s_per_token": 4e-4, "load_s_per_token": {"cpu": 3e-6}},
        {"prefill_s_per_token": 3e-4},
        {},
    ]
    got = RouteCosts.measured(stats)
    assert got.prefill_s_per_token == 3e-4
    assert got.load_s_per_token == {"cpu": 2e-6, "remote": 5e-6}
    assert got.source == "measured by 3 replicas"
    assert RouteCosts.measured([{}, {}]) == RouteCosts()
    # unmeasured: loads free, a prefill token one unit: ranks by tokens to compute
    assert RouteCosts().ttft_s(100, 1000, NodeHit(cpu=600)) == 500
    c = RouteCosts.configured({"prefill_s_per_token": 1e-3, "load_s_per_token": {"remote": 1e-4}})
    assert c.ttft_s(0, 1000, NodeHit(remote=1000)) == pytest.approx(0.1)
    for bad in (
        {"prefill_s_per_token": -1.0},
        {"prefill_s_per_token": float("nan")},
        {"load_s_per_token": {"disk": 1e-6}},
        {"prefill": 1e-3},
    ):
        with pytest.raises(InvalidInput, match="router cost"):
            RouteCosts.configured(bad)


@dataclass
class _Prompt:
    prompt: str
    prompt_token_ids: list[int] = field(default_factory=list)


def test_the_prompt_and_its_tenant_come_from_the_first_argument_that_has_ids() -> None:
    from raykv.blocks import tenant_key
    from raykv.integrations.serve.deployments import RoutedRequest

    def req(*args, **kwargs) -> SimpleNamespace:
        return SimpleNamespace(args=list(args), kwargs=kwargs)

    assert routed_prompt(req("x", _Prompt("p", [1, 2]))) == ([1, 2], None)
    assert routed_prompt(req({"prompt_token_ids": (3, 4)})) == ([3, 4], None)
    assert routed_prompt(req(body={"prompt_token_ids": [5]})) == ([5], None)
    assert routed_prompt(req("text only")) is None
    assert routed_prompt(None) is None
    # a salted request is ranked by its tenant's keys, as its engine stores them
    salted = RoutedRequest("completions", {"prompt": [6], "cache_salt": "t1"}, [6], [[6]])
    assert routed_prompt(req(salted)) == ([6], tenant_key("t1"))
    assert routed_prompt(req({"prompt_token_ids": [7], "cache_salt": ""})) == ([7], None)


@dataclass(eq=False)
class _Replica:
    """What the router reads of Serve's ``RunningReplica``."""

    replica_id: str
    node_id: str
    routing_stats: dict = field(default_factory=dict)
    max_ongoing_requests: int = 8


def _router(places: dict[bytes, tuple], costs: dict | None, block: int = 16) -> RaykvRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    r = RaykvRouter(
        deployment_id=DeploymentID("llm", "app"), handle_source=DeploymentHandleSource.UNKNOWN
    )
    r.initialize_state(model="m", costs=costs)
    r._view, r._reporter = _view(places), object()  # no coordinator, no threads

    async def keys(ids, tenant=None):  # one key per block of ``block`` tokens: the ids
        n = (len(ids) - 1) // block
        return [bytes([ids[i * block]]) for i in range(n)]

    r._keys, r._block_size = keys, lambda: block
    return r


def _request(rid: str, ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        args=[_Prompt(" ".join(map(str, ids)), ids)],
        kwargs={},
        metadata=SimpleNamespace(internal_request_id=rid),
    )


def _route(router: RaykvRouter, replicas: list[_Replica], rid: str, ids: list[int]) -> _Replica:
    pending = _request(rid, ids)
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    chosen = ranks[0][0]
    router.on_request_routed(pending, chosen.replica_id, None)
    return chosen


def test_a_request_goes_to_its_prefix_until_that_replica_is_busier_than_the_prefix_is_worth():
    """Replica a's node holds the prompt's first 48 of 64 tokens in its CPU tier. While a is
    idle the request goes there; once a has more tokens queued than the prefix saves (and a
    pull costs less than recomputing), requests go to b, which pulls: routed for load. With
    measured costs a replica's queue is the time its prefills sent should take."""
    ids = list(range(65))  # 4 blocks of 16, and the last token
    held = {bytes([i * 16]): (("A", CPU),) for i in range(3)}
    # slow enough that what a was sent is still queued there on a loaded box
    costs = {"prefill_s_per_token": 0.1, "load_s_per_token": {"cpu": 1e-3, "remote": 1e-2}}
    router = _router(held, costs)
    a, b = _Replica("a", "A"), _Replica("b", "B")
    assert _route(router, [a, b], "r1", ids) is a  # a computes 16 tokens, b would 16 + pull
    assert router.decisions["routed_for_cache"] == 1
    assert _route(router, [a, b], "r2", ids) is b  # a has 16 queued: b pulls 48, computes 16
    assert router.decisions["routed_for_load"] == 1 and router.decisions["pulls"] == 1
    assert router.decisions["hit_tokens_cpu"] == 48 and router.decisions["hit_tokens_remote"] == 48
    router.on_request_completed("a", "r1")
    assert router._queued["a"] == 0 and router._queued["b"] == 16
    assert _route(router, [a, b], "r3", ids) is a  # b's prefill and pull end later than a's
    for rid, r in (("r2", "b"), ("r3", "a")):
        router.on_request_completed(r, rid)
    router._busy_until = {}  # their prefills are done: a, the prefix's holder, again
    assert _route(router, [a, b], "r4", ids) is a
    assert router.report()["decisions"]["routed"] == 4


def test_without_measured_costs_replicas_rank_by_the_tokens_they_would_compute() -> None:
    ids = list(range(65))
    held = {bytes([i * 16]): (("B", GPU),) for i in range(4)}
    router = _router(held, None)
    replicas = [_Replica("a", "A"), _Replica("b", "B"), _Replica("c", "C")]
    assert _route(router, replicas, "r1", ids) is replicas[1]
    assert router.costs().source == "not measured yet"
    replicas[0].routing_stats = {"prefill_s_per_token": 1e-3, "load_s_per_token": {"gpu": 0.0}}
    router._replicas = {r.replica_id: r for r in replicas}
    router._costs_at = -math.inf
    assert router.costs().source == "measured by 1 replica"


def test_the_router_falls_back_to_two_random_replicas_and_counts_why(caplog) -> None:
    router = _router({}, None)
    replicas = [_Replica(x, x.upper()) for x in "abc"]
    ranks = asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=["hi"], kwargs={})))
    assert len(ranks) == 1 and len(ranks[0]) == 2 and set(ranks[0]) <= set(replicas)
    router._view._answered = -math.inf  # the index has not answered for a while
    for _ in range(3):
        asyncio.run(router.choose_replicas(replicas, _request("r", list(range(40)))))
    assert router.decisions["fell_back_no_token_ids"] == 1
    assert router.decisions["fell_back_index_unavailable"] == 3
    assert sum("routing without the prefix index" in m for m in caplog.messages) == 2


def test_a_replica_keeps_what_it_was_sent_until_its_cache_is_full() -> None:
    """Two replicas of one node see the same tier; the router remembers what it sent each
    (up to the cache size the replica reports), so a repeated prompt goes back to the
    replica that holds it in its own cache while that one is not busier than it is worth,
    and a replica whose cache has been filled with other prompts no longer counts it."""
    ids = list(range(65))
    held = {bytes([i * 16]): (("A", CPU),) for i in range(4)}
    costs = {"prefill_s_per_token": 1e-3, "load_s_per_token": {"cpu": 1e-4}}
    router = _router(held, costs)
    a = _Replica("a", "A", {"kv_cache_tokens": 64})
    b = _Replica("b", "A", {"kv_cache_tokens": 64})
    router._replicas = {"a": a, "b": b}
    first = _route(router, [a, b], "r1", ids)
    router.on_request_completed(first.replica_id, "r1")
    assert _route(router, [a, b], "r2", ids) is first  # nothing to load there
    assert router.decisions["hit_tokens_replica"] == 64
    router.on_request_completed(first.replica_id, "r2")
    other = list(range(100, 165))  # fills first's cache (64 tokens): the prompt is gone
    router._remember(first.replica_id, [bytes([200 + i]) for i in range(4)])
    assert router._own(first.replica_id, [bytes([i * 16]) for i in range(4)]) == 0
    assert _route(router, [a, b], "r3", other) in (a, b)


def test_the_first_requests_wait_for_the_index_and_later_ones_never_do() -> None:
    """A router's first requests are ranked where the coordinator answers within
    ``FIRST_ANSWER_S`` of the start; after that (an outage) nothing waits."""
    view = PlacementView()
    view.FIRST_ANSWER_S = 0.5
    view._started_at = time.monotonic()

    def answer() -> None:
        view._answered = time.monotonic()
        view._first_answer.set()

    threading.Timer(0.1, answer).start()
    assert asyncio.run(view.ready())
    view._answered = -math.inf  # the coordinator went away
    t0 = time.monotonic()
    assert not asyncio.run(view.ready()) and time.monotonic() - t0 < 0.05

    never = PlacementView()
    never.FIRST_ANSWER_S = 0.3
    never._started_at = time.monotonic()
    t0 = time.monotonic()
    assert not asyncio.run(never.ready())
    assert 0.2 < time.monotonic() - t0 < 1.0
    assert not asyncio.run(never.ready())  # the wait is spent


def test_the_index_refreshes_run_on_the_loop_until_the_view_is_dropped_or_ray_stops(
    monkeypatch,
) -> None:
    """No thread of the router makes a Ray call (one inside a call while the process shuts
    Ray down crashes it): the refreshes are a task on the router's loop, which ends when
    Serve drops the router's view or Ray shuts down in this process."""
    calls = []

    async def refresh(self, timeout_s: float = 5.0) -> int:
        calls.append(1)  # not the view: the test drops it
        return 0

    monkeypatch.setattr(PlacementView, "refresh", refresh)
    up = [True]
    monkeypatch.setattr(ray, "is_initialized", lambda: up[0])

    async def run(drop: bool) -> tuple[int, bool]:
        view = PlacementView(interval_s=0.01)
        view.start()
        task = view._task
        await asyncio.sleep(0.1)
        n = len(calls)
        if drop:
            del view
        else:
            up[0] = False
        await asyncio.sleep(0.1)
        return n, task.done()

    refreshes, ended = asyncio.run(run(drop=True))  # the task holds the view weakly
    assert refreshes >= 3 and ended
    refreshes, ended = asyncio.run(run(drop=False))  # kept, but Ray shut down here
    assert refreshes >= 3 and ended

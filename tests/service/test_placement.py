"""Where the service places each model's TP groups (pure: from ``ray.nodes()`` entries)."""

from raykv.layout import FullAttention
from raykv.service.control.placement import engine_groups
from raykv.service.served import ServedModel

LAYERS = {"l0": FullAttention(dtype="bfloat16", num_kv_heads=8, head_dim=128)}


def node(gpus: int) -> dict:
    return {"NodeID": f"n{gpus}", "Alive": True, "Resources": {"CPU": 8.0, "GPU": float(gpus)}}


def test_gpu_clusters_place_tp_groups_on_gpu_nodes_only() -> None:
    tp1 = ServedModel("a", LAYERS, max_model_len=1024)
    tp2 = ServedModel("b", LAYERS, max_model_len=1024, tp_size=2)
    # a KubeRay-style CPU head next to GPU workers: no CPU-device pool on the head (it would
    # take the GPU plan's bytes of host memory)
    assert engine_groups([node(0), node(8), node(3)], {"a": tp1}) == [{"a": 0}, {"a": 8}, {"a": 3}]
    assert engine_groups([node(0), node(8), node(3)], {"b": tp2}) == [{"b": 0}, {"b": 4}, {"b": 1}]


def test_clusters_without_gpus_get_one_cpu_device_group_per_node_and_model() -> None:
    models = {
        "a": ServedModel("a", LAYERS, max_model_len=1024),
        "b": ServedModel("b", LAYERS, max_model_len=1024, tp_size=2),
    }
    assert engine_groups([node(0), node(0)], models) == [{"a": 1, "b": 1}] * 2


def test_the_placer_places_again_for_a_new_node_or_a_dead_member() -> None:
    from raykv.service.control.placement import Placer

    placer = Placer()
    placer.placed_on.update({"n1", "n2"})
    placer.expected.update({"pool-a": "n1", "tier-a": "n1", "pool-b": "n2"})
    members = {"pool-a": 1, "tier-a": 1, "pool-b": 1}
    assert not placer.missing({"n1", "n2"}, members)
    assert placer.missing({"n1", "n2", "n3"}, members)  # a node joined
    assert placer.missing({"n1", "n2"}, {"tier-a": 1, "pool-b": 1})  # pool-a died on a live node
    assert not placer.missing({"n2"}, {"pool-b": 1})  # n1 left: its members are not replaced
    placer.clear()
    assert placer.missing({"n1"}, {}) and not placer.expected


def test_a_model_without_pools_gets_no_group_anywhere() -> None:
    bare = ServedModel("v", LAYERS, max_model_len=1024, pools=False)
    pooled = ServedModel("a", LAYERS, max_model_len=1024)
    models = {"v": bare, "a": pooled}
    assert engine_groups([node(0), node(8)], models) == [{"v": 0, "a": 0}, {"v": 0, "a": 8}]
    assert engine_groups([node(0), node(0)], models) == [{"v": 0, "a": 1}] * 2

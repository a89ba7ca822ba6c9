"""The status ``raykv status`` prints, assembled from the coordinator's state (pure)."""

from __future__ import annotations

import time
from collections import Counter

from raykv.blocks import PrefixIndex
from raykv.layout import FullAttention, plan
from raykv.service.control import status
from raykv.service.control.coordinator import Member
from raykv.service.served import ServedModel


def test_the_status_counts_nodes_members_models_and_lookups() -> None:
    layers = {"l0": FullAttention("float32", 1, 8)}
    model = ServedModel("m", layers, max_model_len=64, cpu_bytes=1 << 16)
    p = plan(layers, num_gpu_blocks=9, max_model_len=64, max_num_batched_tokens=64)
    index = PrefixIndex()
    index.add(0, b"h1", 3, holder="pool", scope="m")
    index.add(0, b"h1", 0, holder="tier", scope="m")
    index.add(0, b"h2", 4, holder="pool", scope="m")
    members = [
        Member("tier", "tier", "n1", None, stats={"blocks_used": 1}),
        Member("pool", "pool", "n1", "m", stats={"blocks_used": 2}),
    ]
    tally = Counter(lookups=3, hits_local_gpu=6, misses_all=2, failures_watch=1)
    nodes = [
        {"NodeID": "n1", "NodeManagerAddress": "127.0.0.1", "Alive": True, "Resources": {}},
        {
            "NodeID": "n2",
            "NodeManagerAddress": "127.0.0.1",
            "Alive": False,
            "Resources": {"GPU": 2},
        },
    ]
    s = status.cluster(
        ray_nodes=nodes,
        members_=members,
        index=index,
        served={"m": model},
        plans={"m": p},
        tally=tally,
        started=time.time() - 5,
        restarted=False,
    )
    assert [(n["node_id"], n["alive"], n["gpus"]) for n in s["nodes"]] == [
        ("n1", True, 0),
        ("n2", False, 2),
    ]
    assert [(m["name"], m["indexed_blocks"], m["blocks_used"]) for m in s["members"]] == [
        ("pool", 2, 2),  # sorted by node, kind, name
        ("tier", 1, 1),
    ]
    assert s["models"]["m"]["num_gpu_blocks"] == p.num_gpu_blocks == 9
    assert s["models"]["m"]["groups"] == [["full", 16, 1]]
    assert s["indexed_blocks"] == 2 and s["lookups"] == 3
    assert s["hit_rate"] == 6 / 8 and s["hits"] == {"local_gpu": 6} and s["misses"] == 2
    assert s["failures"] == {"watch": 1} and 4 < s["uptime_s"] < 60

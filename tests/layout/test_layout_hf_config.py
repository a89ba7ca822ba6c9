"""Presets and Hugging Face config.json reading."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from raykv.errors import ConfigError
from raykv.layout import plan
from raykv.layout.hf_config import layers_from_hf_config, max_model_len_from_hf_config
from raykv.layout.presets import PRESETS, get_preset

GiB = 1 << 30


def _write(tmp_path, cfg: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _kinds(layers) -> Counter:
    return Counter(s.kind for s in layers.values())


LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def test_llama_config_file_and_folder(tmp_path):
    path = _write(tmp_path, LLAMA)
    for source in (path, tmp_path, str(path)):
        layers = layers_from_hf_config(source)
        assert _kinds(layers) == {"full": 32}
        spec = layers["layers.0.attn"]
        assert (spec.num_kv_heads, spec.head_dim, spec.dtype) == (8, 128, "bfloat16")
    assert max_model_len_from_hf_config(path) == 8192
    assert layers_from_hf_config(path, dtype="float8_e4m3fn")["layers.3.attn"].dtype == (
        "float8_e4m3fn"
    )


@pytest.mark.parametrize(
    ("extra", "kinds", "first_sliding"),
    [
        (  # explicit layer_types (Gemma 3, Qwen 3, gpt-oss)
            {
                "model_type": "gemma3_text",
                "sliding_window": 512,
                "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
                "num_hidden_layers": 6,
            },
            {"sliding_window": 5, "full": 1},
            True,
        ),
        (  # Gemma 3 sliding_window_pattern: every 6th layer full
            {"model_type": "gemma3", "sliding_window": 1024, "sliding_window_pattern": 6},
            {"sliding_window": 27, "full": 5},
            True,
        ),
        (
            {"model_type": "gemma2", "sliding_window": 4096},
            {"sliding_window": 16, "full": 16},
            True,
        ),
        ({"model_type": "mistral", "sliding_window": 4096}, {"sliding_window": 32}, True),
        ({"model_type": "qwen2", "sliding_window": 4096}, {"full": 32}, False),  # not in use
    ],
)
def test_sliding_window_patterns(tmp_path, extra, kinds, first_sliding):
    layers = layers_from_hf_config(_write(tmp_path, {**LLAMA, **extra}))
    assert _kinds(layers) == kinds
    assert (layers["layers.0.attn"].kind == "sliding_window") == first_sliding


def test_gemma3_multimodal_wrapper_reads_text_config(tmp_path):
    cfg = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {
            **LLAMA,
            "model_type": "gemma3_text",
            "sliding_window": 1024,
            "sliding_window_pattern": 6,
            "head_dim": 256,
        },
    }
    layers = layers_from_hf_config(_write(tmp_path, cfg))
    assert _kinds(layers) == {"sliding_window": 27, "full": 5}
    assert layers["layers.0.attn"].window == 1024 and layers["layers.0.attn"].head_dim == 256


def test_deepseek_mla(tmp_path):
    cfg = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "architectures": ["DeepseekV3ForCausalLM"],
    }
    layers = layers_from_hf_config(_write(tmp_path, cfg))
    assert _kinds(layers) == {"mla": 61}
    assert layers["layers.0.attn"].page_bytes(16, tp_size=8) == 16 * 576 * 2


def test_jamba_and_nemotron_h(tmp_path):
    jamba = {**get_preset("jamba-v0.1").config, "layers_block_type": None}
    assert _kinds(layers_from_hf_config(jamba)) == {"mamba": 28, "full": 4}
    nemo = layers_from_hf_config(_write(tmp_path, get_preset("nemotron-h-8b").config))
    assert _kinds(nemo) == {"mamba": 24, "full": 4}
    mamba = next(s for s in nemo.values() if s.kind == "mamba")
    assert mamba.state_shapes == ((10240, 3), (128, 64, 128))


@pytest.mark.parametrize(
    "cfg",
    [
        {"model_type": "mamba", "architectures": ["MambaForCausalLM"]},
        {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"]},
        {"architectures": ["SomethingNew"]},
    ],
)
def test_unknown_architecture_is_a_clear_error(tmp_path, cfg):
    with pytest.raises(ConfigError, match="unknown architecture"):
        layers_from_hf_config(_write(tmp_path, cfg))


def test_missing_or_broken_config(tmp_path):
    with pytest.raises(ConfigError, match="no Hugging Face config"):
        layers_from_hf_config(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        layers_from_hf_config(tmp_path)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        layers_from_hf_config({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="unknown preset 'gpt-5'"):
        get_preset("gpt-5")


EXPECTED_KINDS = {
    "llama-3-8b": {"full": 32},
    "llama-3-70b": {"full": 80},
    "gemma-3-27b": {"sliding_window": 52, "full": 10},
    "deepseek-v3": {"mla": 61},
    "jamba-v0.1": {"mamba": 28, "full": 4},
    "nemotron-h-8b": {"mamba": 24, "full": 4},
}


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tp", [1, 4, 8])
def test_every_preset_plans_at_every_tp(name, tp):
    preset = get_preset(name)
    layers = preset.layers()
    assert _kinds(layers) == EXPECTED_KINDS[name]
    p = plan(
        layers,
        gpu_bytes=60 * GiB,
        cpu_bytes=256 * GiB,
        tp_size=tp,
        max_model_len=preset.max_model_len,
        max_num_batched_tokens=8192,
        kernel_block_sizes=[16, 32, 64],
    )
    copies = 1 if name == "deepseek-v3" else tp
    assert p.distinct_copies == copies
    assert p.cpu_bytes_per_block == p.gpu_bytes_per_block * copies
    assert p.max_concurrent_requests() >= 1
    if name == "deepseek-v3":  # MLA is not split: the same page on every rank
        assert p.gpu_bytes_per_block == 61 * 16 * 576 * 2

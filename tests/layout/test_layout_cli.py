"""`raykv plan` through click's test runner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from raykv.cli import main
from raykv.errors import ConfigError
from raykv.layout.report import format_bytes, parse_size


def _run(*args: str):
    return CliRunner().invoke(main, ["plan", *args])


def test_plan_with_defaults_prints_the_table():
    r = _run()
    assert r.exit_code == 0, r.output
    for row in (
        "blocks per GPU",
        "tokens per GPU",
        "CPU-tier blocks",
        "CPU-tier tokens",
        "bytes per block, 1 rank",
        "bytes per block, TP 1",
        "admission cap",
        "padding waste",
        "llama-3-8b",
    ):
        assert row in r.output
    assert "30720 (30719 usable + null)" in r.output  # 60 GiB / 2 MiB per block


def test_plan_json_tp4_with_cpu_tier():
    r = _run(
        "--preset",
        "gemma-3-27b",
        "--gpu-mem",
        "60GiB",
        "--tp",
        "4",
        "--cpu-mem",
        "256GiB",
        "--kernel-block-sizes",
        "16,32,64",
        "--offload-block-size",
        "32",
        "--json",
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["model"] == "gemma-3-27b" and d["tp_size"] == 4 and d["block_size_factor"] == 2
    assert d["num_gpu_blocks"] == 60 * (1 << 30) // d["gpu_bytes_per_block"]
    assert d["cpu_bytes_per_block"] == d["gpu_bytes_per_block"] * 4 * 2
    assert d["cpu_num_blocks"] == 256 * (1 << 30) // d["cpu_bytes_per_block"]
    caps = {g["kind"]: g["admission_blocks"] for g in d["groups"]}
    # the window (1024) plus one in-flight chunk of max_num_batched_tokens (8192), from
    # anywhere in a block of 16 (invariant 2)
    assert caps == {"sliding_window": -(-(1023 + 8192 + 15) // 16), "full": 32768 // 16}


def test_plan_hf_config(tmp_path):
    cfg = {
        "model_type": "deepseek_v3",
        "num_hidden_layers": 4,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = _run(
        "--hf-config", str(tmp_path / "config.json"), "--tp", "8", "--gpu-mem", "1GiB", "--json"
    )
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["max_model_len"] == 4096 and d["distinct_copies"] == 1
    assert d["groups"][0]["kind"] == "mla"


def test_list_presets():
    r = _run("--list-presets")
    assert r.exit_code == 0
    for name in (
        "llama-3-8b",
        "llama-3-70b",
        "gemma-3-27b",
        "deepseek-v3",
        "jamba-v0.1",
        "nemotron-h-8b",
    ):
        assert name in r.output


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (
            ["--preset", "llama-3-70b", "--gpu-mem", "1GiB", "--max-model-len", "131072"],
            "lower max_model_len",
        ),
        (["--preset", "nope"], "unknown preset"),
        (["--gpu-mem", "lots"], "cannot read size"),
        (["--kernel-block-sizes", "48"], "kernel block size"),
        (["--preset", "llama-3-8b", "--hf-config", "."], "not both"),
    ],
)
def test_plan_errors_exit_nonzero_with_the_fix(args, text):
    r = _run(*args)
    assert r.exit_code != 0
    assert text in r.output


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("60GiB", 60 << 30),
        ("512 MiB", 512 << 20),
        ("80GB", 80 * 10**9),
        ("4096", 4096),
        ("1.5gib", 3 << 29),
        (123, 123),
    ],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_parse_size_rejects_and_format_bytes():
    with pytest.raises(ConfigError):
        parse_size("12 parsecs")
    assert format_bytes(2 << 20) == "2.00 MiB" and format_bytes(100) == "100 B"

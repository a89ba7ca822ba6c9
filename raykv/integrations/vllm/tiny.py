"""A tiny random-weight Llama and a locally trained tokenizer, saved for vLLM to load.

Tests, the vLLM snippet of docs/vllm.md and ``raykv bench vllm`` need a model vLLM can
serve on a machine with no network: ``build_tiny_llama(path)`` writes one with
``transformers``' ``save_pretrained`` (random weights, seeded) and a word-level tokenizer
trained here with ``tokenizers``. ``sliding_window`` makes every other layer a sliding-window
layer (Llama's ``layer_types``), so vLLM's hybrid KV cache manager serves it as two KV groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyLlama:
    """The shape of the tiny model (defaults: prefill dominates, KV stays small)."""

    vocab_size: int = 1024
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 16384
    sliding_window: int | None = None  # tokens; every other layer slides when set
    seed: int = 0


def build_tiny_llama(path: str | Path, shape: TinyLlama | None = None) -> Path:
    """Write the model and its tokenizer to ``path`` (created); returns it. Idempotent."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    shape = shape or TinyLlama()
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    extra = {}
    if shape.sliding_window:
        kinds = ("sliding_attention", "full_attention")
        extra = {
            "sliding_window": shape.sliding_window,
            "layer_types": [kinds[i % 2] for i in range(shape.num_layers)],
        }
    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        torch_dtype="float32",
        **extra,
    )
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a wider spread than the init's: greedy picks are clear-cut
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)

    special = ["<pad>", "<s>", "</s>", "<unk>"]
    words = [f"w{i}" for i in range(shape.vocab_size - len(special))]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=shape.vocab_size, special_tokens=special)
    tok.train_from_iterator([" ".join(words)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>",
    )  # fmt: skip
    fast.save_pretrained(path)
    return path


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny model's vocabulary (from 4: past its special tokens, below
    1000 of the default 1024), the same for the same seed: prompts whose prefixes are shared
    only where a caller shares them."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(n)]

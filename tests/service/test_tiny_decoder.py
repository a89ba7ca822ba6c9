"""The demo's decoder: paged KV through a block table gives the logits of a full pass."""

import torch

from raykv.errors import InvalidInput
from raykv.models import TinyConfig, TinyDecoder

CFG = TinyConfig(
    vocab_size=97, hidden=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, ffn=96
)


def test_prefix_then_suffix_equals_one_pass_with_shuffled_blocks() -> None:
    m = TinyDecoder(CFG)
    ids = torch.randint(0, 97, (75,)).tolist()
    full = m(ids, 0, m.new_kv_cache(16, 8), list(range(1, 11)))
    table = torch.randperm(15)[:10].add(1).tolist()  # any blocks, any order
    cache = m.new_kv_cache(16, 8)
    m(ids[:40], 0, cache, table)
    part = m(ids[40:], 40, cache, table)
    assert torch.allclose(full[40:], part, atol=1e-5)


def test_logical_blocks_over_smaller_kernel_blocks() -> None:
    m = TinyDecoder(CFG)
    ids = torch.randint(0, 97, (50,)).tolist()
    a = m(ids, 0, m.new_kv_cache(8, 16), [3, 1, 5, 2])
    b = m(ids, 0, m.new_kv_cache(16, 8), [3, 1, 5, 2], block_size=16)
    assert torch.allclose(a, b, atol=1e-5)


def test_same_seed_same_weights_and_bad_input() -> None:
    a, b = TinyDecoder(CFG), TinyDecoder(CFG)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    try:
        a([1, 2, 3], 0, a.new_kv_cache(2, 2), [1])
    except InvalidInput as e:
        assert "allocate more" in str(e)
    else:
        raise AssertionError("a short block table must be refused")

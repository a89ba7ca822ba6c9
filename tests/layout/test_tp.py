"""TP world-size scaling (``raykv.layout.tp``, invariant 5): which rank holds and which rank
writes each distinct copy agrees with the bytes a CPU-tier block holds, for every spec kind
and tp size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.errors import ConfigError
from raykv.layout import (
    MLA,
    ChunkedLocal,
    CrossAttention,
    FullAttention,
    Mamba,
    SlidingWindow,
    plan,
    tp,
)
from raykv.tiers.cpu_tier import CpuTier

TP_SIZES = (1, 2, 4, 8)


@st.composite
def models(draw) -> tuple[dict, int]:
    """(layers, tp_size): one or two layer kinds, heads that divide or are divided by tp."""
    tp_size = draw(st.sampled_from(TP_SIZES))
    heads = draw(
        st.sampled_from([h for h in (1, 2, 4, 8, 16) if h % tp_size == 0 or tp_size % h == 0])
    )
    kinds = {
        "full": FullAttention("float32", heads, 8),
        "sliding": SlidingWindow("float32", heads, 8, window=32),
        "chunked": ChunkedLocal("float32", heads, 8, chunk=32),
        "cross": CrossAttention("float32", heads, 8, max_encoder_len=32),
        "mla": MLA("float32", 16, 8),
        "mamba": Mamba("float32", ((8 * tp_size, 3),)),
    }
    first = draw(st.sampled_from(sorted(kinds)))
    layers = {"a": kinds[first]}
    if draw(st.booleans()):  # a hybrid: the copies are the most of any layer's
        layers["b"] = kinds[draw(st.sampled_from(["full", "mla"]))]
    return layers, tp_size


def held_by(spec, rank: int, tp_size: int) -> tuple:
    """What slice of one layer's page rank ``rank`` holds (equal slices: equal bytes)."""
    if isinstance(spec, MLA):
        return ("latent",)  # every rank holds the whole latent
    if isinstance(spec, Mamba):
        return ("state", rank)  # the split dim: one slice per rank
    per = spec.kv_heads_per_rank(tp_size)
    if spec.num_kv_heads >= tp_size:
        return tuple(range(rank * per, (rank + 1) * per))
    return (rank * spec.num_kv_heads // tp_size,)  # a replica of one head


def build(layers: dict, tp_size: int, factor: int):
    try:
        return plan(
            layers,
            num_gpu_blocks=9,
            max_model_len=64,
            max_num_batched_tokens=64,
            tp_size=tp_size,
            offload_block_size=16 * factor,
            cpu_bytes=1 << 20,
        )
    except ConfigError:
        return None  # a mix the planner refuses (e.g. pages that do not unify)


@settings(max_examples=150, deadline=None)
@given(models(), st.sampled_from([1, 2]))
def test_copy_to_rank_mapping_matches_the_cpu_tier_bytes(model, factor) -> None:
    layers, tp_size = model
    p = build(layers, tp_size, factor)
    if p is None:
        return
    copies = tp.model_copies(layers.values(), tp_size)
    # one number of copies everywhere: planner, plan read-back, CPU tier
    assert p.distinct_copies == copies == tp.plan_copies(p)
    assert p.cpu_bytes_per_block == p.gpu_bytes_per_block * copies * p.block_size_factor
    assert p.cpu_bytes_per_block == tp.cpu_bytes_per_block(
        p.gpu_bytes_per_block * p.num_gpu_blocks, p.num_gpu_blocks, copies, p.block_size_factor
    )
    tier = CpuTier(p, pin_memory=False)
    assert tier.copies == copies and tier.arena.shape[0] == copies
    assert tier.arena.numel() == p.cpu_num_blocks * p.cpu_bytes_per_block <= 1 << 20

    # ranks holding one copy hold the same bytes in every layer; different copies differ
    ranks = tp.copy_ranks(p)
    assert len(ranks) == tp_size and sorted(set(ranks)) == list(range(copies))
    for r1 in range(tp_size):
        for r2 in range(tp_size):
            same = all(held_by(s, r1, tp_size) == held_by(s, r2, tp_size) for s in layers.values())
            assert same == (ranks[r1] == ranks[r2]), (r1, r2, ranks)

    # each copy is written once, by its first rank; every rank knows whether it writes
    writers = tp.writer_ranks(p)
    assert len(writers) == copies
    for c, w in enumerate(writers):
        assert ranks[w] == c and w == min(r for r in range(tp_size) if ranks[r] == c)
    assert [tp.writes(r, tp_size, copies) for r in range(tp_size)] == [
        r in writers for r in range(tp_size)
    ]


def test_known_groups() -> None:
    """2 heads: 1 rank is 1 copy, 2 ranks 2, 4 ranks 2 (replicas on ranks 0-1, 2-3); MLA 1."""
    for heads, tp_size, ranks, writers in [
        (2, 1, (0,), (0,)),
        (2, 2, (0, 1), (0, 1)),
        (2, 4, (0, 0, 1, 1), (0, 2)),
    ]:
        p = build({"a": FullAttention("float32", heads, 16)}, tp_size, 1)
        assert tp.copy_ranks(p) == ranks and tp.writer_ranks(p) == writers
        assert p.cpu_bytes_per_block == len(writers) * p.gpu_bytes_per_block
    mla = build({"a": MLA("float32", 32, 8)}, 2, 1)
    assert tp.copy_ranks(mla) == (0, 0) and tp.writer_ranks(mla) == (0,)  # MLA: stored once
    assert mla.cpu_bytes_per_block == mla.gpu_bytes_per_block


def test_copies_that_do_not_divide_tp_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"3 distinct copies do not divide tp_size=4"):
        tp.copy_of_rank(0, 4, 3)
    with pytest.raises(ConfigError, match=r"rank 4 is outside tp_size=4"):
        tp.copy_of_rank(4, 4, 2)
    with pytest.raises(ConfigError, match=r"tp_size must be an integer >= 1, got 0"):
        tp.split_heads(8, 0)

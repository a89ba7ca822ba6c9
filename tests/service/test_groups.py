"""What the service derives from a plan (pure, no Ray): chunks with null slots and partial
tails, the common hit of a sliding-window + full hybrid, caller input forms (TP copies:
tests/layout/test_tp.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.blocks import BlockHasher, BlockManager
from raykv.errors import ConfigError, InvalidInput
from raykv.layout import MLA, FullAttention, Mamba, SlidingWindow, plan
from raykv.service.groups import (
    as_tables,
    check_servable,
    common_hit,
    complete_chunks,
    group_keys,
    managers,
    row_widths,
)
from raykv.service.pool.rows import as_rank_rows

SW, FULL = SlidingWindow("float32", 1, 16, window=32), FullAttention("float32", 1, 16)
HYBRID = {"s0": SW, "s1": SW, "f0": FULL, "s2": SW, "s3": SW, "f1": FULL}


def hybrid_plan(offload: int | None = 32, tp: int = 1, layers=None):
    return plan(
        layers or HYBRID,
        num_gpu_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=256,
        cpu_bytes=1 << 20,
        offload_block_size=offload,
        tp_size=tp,
    )


def test_chunks_skip_null_slots_and_partial_tails() -> None:
    p = hybrid_plan()
    assert [g.spec.kind for g in p.groups] == ["sliding_window", "sliding_window", "full"]
    keys = [[bytes([g, j]) for j in range(13)] for g in range(3)]  # 13 full blocks
    sw = [0] * 11 + [5, 6, 7]  # 11 null slots: chunk (10, 11) straddles the window edge
    tables = [sw, [x + 10 for x in sw], list(range(20, 34))]
    chunks = complete_chunks(p, tables, keys)
    by_group = [[c for c in chunks if c.group == g] for g in range(3)]
    assert [c.members for c in by_group[0]] == [(None, keys[0][11])]  # all-null chunks: none
    assert by_group[0][0].key == keys[0][11]
    assert len(by_group[2]) == 6  # block 12's chunk needs block 13's key: partial, left out
    assert all(None not in c.members for c in by_group[2])
    assert row_widths(p) == (p.gpu_bytes_per_block,) * 3


def test_common_hit_needs_only_the_window_of_a_sliding_group() -> None:
    p = hybrid_plan()
    mgrs = managers(p)
    held = {0: set(range(10, 13)), 1: set(range(10, 13)), 2: set(range(13))}
    assert common_hit(mgrs, lambda g, j: j in held[g], 208) == 208  # needs SW slots 11, 12
    held[0].discard(12)
    assert common_hit(mgrs, lambda g, j: j in held[g], 208) == 192  # SW slots 10, 11
    held[2].discard(5)  # full attention stops at 80 tokens, where SW needs slots 3, 4
    assert common_hit(mgrs, lambda g, j: j in held[g], 208) == 0
    held[0].update((3, 4)), held[1].update((3, 4))
    assert common_hit(mgrs, lambda g, j: j in held[g], 208) == 80


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 250), st.integers(0, 12), st.booleans())
def test_common_hit_matches_the_block_manager(n: int, cut: int, drop_sw: bool) -> None:
    """The service's hit rule over its index == BlockManager.cached_prefix over its pool."""
    p = hybrid_plan(offload=None)
    bm = BlockManager(p)
    ids = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    assert bm.admit("r", n, ids) and bm.allocate("r", n, ids) is not None
    bm.free("r")
    keys = group_keys(p, BlockHasher(p.hash_block_size).hash_blocks(ids[: n - 1]))
    cached = {bytes(k) for g in p.groups for (gid, k) in bm.pool.cached if gid == g.group_id}

    def has(g: int, j: int) -> bool:
        if j >= cut and (g == 2 or drop_sw):
            return False
        return keys[g][j][4:] in cached

    for g in range(3):  # evict what has() hides, in the pool too
        for j in range(cut, len(keys[g])):
            if g == 2 or drop_sw:
                bm.pool.cached.pop((g, keys[g][j][4:]), None)
    assert common_hit(managers(p), has, n - 1) == bm.cached_prefix(ids)


def test_unservable_plans_are_refused() -> None:
    mixed = {"a": FULL, "m": Mamba("float32", ((4, 4),))}
    with pytest.raises(ConfigError, match="not a function of the token prefix"):
        check_servable(plan(mixed, num_gpu_blocks=64, max_model_len=64, max_num_batched_tokens=64))


def test_tables_and_rows_forms() -> None:
    p = hybrid_plan()
    assert as_tables(hybrid_plan(layers={"a": FULL}), [1, 2]) == [[1, 2]]
    with pytest.raises(InvalidInput, match="per group"):
        as_tables(p, [1, 2])
    with pytest.raises(InvalidInput, match="3 KV group"):
        as_tables(p, [[1], [2]])
    tables = [[0, 3], [0, 4], [5, 6]]
    w = row_widths(p)
    aligned = [torch.full((2, w[0]), g, dtype=torch.uint8) for g in range(3)]
    out = as_rank_rows(p, aligned, tables, w)  # rows of null ids are dropped
    assert [t.shape[0] for t in out[0]] == [1, 1, 2]
    compact = [aligned[0][:1], aligned[1][:1], aligned[2]]
    again = as_rank_rows(p, compact, tables, w)[0]
    assert all(torch.equal(a, b) for a, b in zip(again, out[0], strict=True))
    with pytest.raises(InvalidInput, match=r"group 2, must have shape \[2, 4096\]"):
        as_rank_rows(p, [aligned[0], aligned[1], aligned[2][:1]], tables, w)
    tp = plan(
        {"a": FullAttention("float32", 2, 16)},
        num_gpu_blocks=8, max_model_len=64, max_num_batched_tokens=64, tp_size=2,
    )  # fmt: skip
    rw = row_widths(tp)
    stacked = torch.zeros((2, 3, rw[0]), dtype=torch.uint8)
    assert len(as_rank_rows(tp, stacked, [[1, 2, 3]], rw)) == 2
    with pytest.raises(InvalidInput, match="tp_size=2"):
        as_rank_rows(tp, stacked[0], [[1, 2, 3]], rw)


def test_ranks_replicating_one_copy_must_be_given_the_same_rows() -> None:
    """An MLA latent (and a KV head on several ranks) is one copy on every rank of it: a
    load reads each share of the copy from a different replica, so a store whose replicas
    differ is refused before a byte moves; distinct copies may differ."""
    common = dict(num_gpu_blocks=8, max_model_len=64, max_num_batched_tokens=64, tp_size=4)
    mla = plan({"a": MLA("float16", kv_lora_rank=32, qk_rope_head_dim=8)}, **common)
    rw = row_widths(mla)
    latent = torch.randint(0, 256, (3, rw[0]), dtype=torch.uint8)
    assert len(as_rank_rows(mla, [latent.clone() for _ in range(4)], [[1, 2, 3]], rw)) == 4
    other = latent.clone()
    other[2, 5] ^= 1
    with pytest.raises(InvalidInput, match=r"ranks 0 and 3 hold the same copy.*pass rank 3"):
        as_rank_rows(mla, [latent, latent, latent, other], [[1, 2, 3]], rw)
    heads = plan({"a": FullAttention("float32", 2, 16)}, **common)  # 2 heads on 4 ranks
    hw = row_widths(heads)
    k = [torch.full((3, hw[0]), c, dtype=torch.uint8) for c in range(2)]
    assert len(as_rank_rows(heads, [k[0], k[0], k[1], k[1]], [[1, 2, 3]], hw)) == 4
    with pytest.raises(InvalidInput, match="ranks 2 and 3 hold the same copy"):
        as_rank_rows(heads, [k[0], k[0], k[1], k[0]], [[1, 2, 3]], hw)


@settings(max_examples=60, deadline=None)
@given(
    which=st.sampled_from(["full", "coarse"]),
    n=st.integers(0, 40),
    width=st.sampled_from([32, 32, 31, 33]),
)
def test_group_keys_are_the_group_id_then_each_blocks_last_hash(which, n, width) -> None:
    """Per group, key ``j`` is the group id (4 bytes, little endian) + the chain's hash at the
    end of block ``j``, however the keys are cut (one numpy pass for the hasher's 32-byte
    hashes, key by key for any other length)."""
    from tests.blocks.helpers import make_plan

    p = (
        make_plan([FULL], 64, 2)
        if which == "full"
        else make_plan([FULL, SlidingWindow(window=4)], 64, 4, hash_block_size=2)
    )
    hashes = [bytes([j % 256]) * width for j in range(n)]
    for g, keys in zip(p.groups, group_keys(p, hashes), strict=True):
        per = g.block_size // p.hash_block_size
        prefix = g.group_id.to_bytes(4, "little")
        assert keys == [prefix + hashes[i] for i in range(per - 1, n, per)]
        assert all(type(k) is bytes for k in keys)

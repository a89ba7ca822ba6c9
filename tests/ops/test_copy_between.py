"""CPU tests of ``raykv.ops.pools.PoolCopy`` (block to block between two pools of one layout, the
peer-read path, and a pool's block sums alone): the torch reference against the byte oracle,
its sums against the gather's, and bad ids refused before anything moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paged_copy_cases import DTYPES, kv_entries, oracle_rows

from raykv import ops
from raykv.errors import InvalidInput, TransportError
from raykv.ops.pools import PoolCopy

FAST = settings(max_examples=25, deadline=None)
layouts = st.fixed_dictionaries(
    {
        "kind": st.sampled_from(["kv", "mla", "interleaved"]),
        "block_size": st.sampled_from([16, 64]),
        "dtype": st.sampled_from(sorted(DTYPES)),
        "layers": st.integers(1, 3),
        "src_blocks": st.integers(1, 10),
        "dst_blocks": st.integers(1, 10),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def pools(case):
    gen = torch.Generator().manual_seed(case["seed"])
    args = case["kind"], case["block_size"], DTYPES[case["dtype"]], case["layers"]
    src, _ = kv_entries(args[0], case["src_blocks"], *args[1:], gen)
    dst, _ = kv_entries(args[0], case["dst_blocks"], *args[1:], gen)
    return src, dst


def gathered_sums(entries, ids: list[int]) -> list[int]:
    rows = torch.zeros((len(ids), ops.row_bytes(entries)), dtype=torch.uint8)
    ops.gather_blocks(entries, torch.tensor(ids, dtype=torch.long), rows)
    return ops.row_sums(rows).tolist()


@FAST
@given(case=layouts, data=st.data())
def test_pool_copy_moves_exactly_the_listed_blocks_with_the_gathers_sums(case, data):
    src, dst = pools(case)
    n = data.draw(st.integers(0, min(case["src_blocks"], case["dst_blocks"])))
    src_ids = data.draw(st.lists(st.integers(0, case["src_blocks"] - 1), min_size=n, max_size=n))
    dst_ids = data.draw(st.permutations(range(case["dst_blocks"])))[:n]
    keep = sorted(set(range(case["dst_blocks"])) - set(dst_ids))
    before, want = oracle_rows(dst, keep), oracle_rows(src, src_ids)
    copy, alone = PoolCopy(src, dst), PoolCopy(src)
    sums = copy.sums(copy.start(src_ids, dst_ids))
    assert oracle_rows(dst, dst_ids) == want
    assert oracle_rows(dst, keep) == before  # nothing else written
    assert sums.tolist() == gathered_sums(src, src_ids)  # what the holder states
    assert alone.sums(alone.start(src_ids)).tolist() == sums.tolist()


def leading_good_by_hand(sums, flags, sent) -> int:
    i = 0
    while i < min(len(sums), len(sent)) and flags[i] and sums[i] == sent[i]:
        i += 1
    return i


@FAST
@given(
    rows=st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), st.booleans(), st.booleans()),
                  max_size=40),
    cut=st.integers(0, 45),
)  # fmt: skip
def test_leading_good_counts_rows_back_with_the_stated_sum(rows, cut):
    """Only leading rows whose sum came back (flag set) and equals the stated one count; the
    holder may state fewer rows than were copied."""
    sums = [s for s, _, _ in rows]
    flags = [int(f) for _, f, _ in rows]
    sent = [s if same else s ^ 1 for s, _, same in rows][:cut]
    got = torch.tensor(sums + flags, dtype=torch.int64)
    src, _ = pools({"kind": "kv", "block_size": 16, "dtype": "u8", "layers": 1,
                    "src_blocks": 1, "dst_blocks": 1, "seed": 0})  # fmt: skip
    want = leading_good_by_hand(sums, flags, sent)
    assert PoolCopy(src).leading_good(got, sent) == want
    assert PoolCopy(src).leading_good(got, np.array(sent, dtype=np.int64)) == want


def test_a_row_whose_sum_never_came_back_fails_the_batch():
    """A row whose flag the copy did not set (a kernel fault) fails the whole batch: a sum
    left in the result's memory from an earlier batch never passes for this one's."""
    case = {"kind": "kv", "block_size": 16, "dtype": "u8", "layers": 2, "src_blocks": 4,
            "dst_blocks": 4, "seed": 5}  # fmt: skip
    src, dst = pools(case)
    copy = PoolCopy(src, dst)
    got = copy.start([0, 1, 2], [3, 2, 1])
    stated = copy.sums(got).copy()
    assert stated.tolist() == gathered_sums(src, [0, 1, 2])
    assert copy.leading_good(got, stated) == 3
    got[4] = 0  # row 1's flag
    with pytest.raises(TransportError, match="handed back 2 of 3 rows' sums"):
        copy.sums(got)
    assert copy.leading_good(got, stated) == 1  # row 0 only


def test_block_sums_change_with_any_word_of_a_block():
    case = {"kind": "kv", "block_size": 16, "dtype": "u8", "layers": 2, "src_blocks": 4,
            "dst_blocks": 1, "seed": 3}  # fmt: skip
    src, _ = pools(case)
    copy = PoolCopy(src)
    before = copy.sums(copy.start([0, 1, 2, 3])).copy()
    src[3][2].view(-1)[5] ^= 1  # one bit of block 2, in the second layer's V
    after = copy.sums(copy.start([0, 1, 2, 3]))
    assert [int(a != b) for a, b in zip(before, after, strict=True)] == [0, 0, 1, 0]


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "match"),
    [
        ([0, 1], [2], "2 source ids but 1 destination ids"),
        ([0, 9], [2, 0], r"\(source\): block id 9 \(position 1\) is outside the pool's 4 blocks"),
        ([0, 1], [1, 1], r"\(destination\): block id 1 appears more than once"),
        ([0, 1.5], [2, 0], r"\(source\): block id at position 1 is not an int"),
        ([0, 1], [-1, 0], r"\(destination\): block id -1 \(position 0\) is outside"),
    ],
)
def test_bad_ids_raise_before_anything_moves(src_ids, dst_ids, match):
    case = {"kind": "kv", "block_size": 16, "dtype": "bf16", "layers": 2, "src_blocks": 4,
            "dst_blocks": 3, "seed": 1}  # fmt: skip
    src, dst = pools(case)
    before = oracle_rows(dst, [0, 1, 2])
    with pytest.raises(InvalidInput, match=match):
        PoolCopy(src, dst).start(src_ids, dst_ids)
    assert oracle_rows(dst, [0, 1, 2]) == before


def test_pools_of_another_layout_are_refused():
    case = {"kind": "kv", "block_size": 16, "dtype": "bf16", "layers": 2, "src_blocks": 4,
            "dst_blocks": 3, "seed": 1}  # fmt: skip
    src, dst = pools(case)
    with pytest.raises(InvalidInput, match="the pools' rows differ"):
        PoolCopy(src, dst[:-1])

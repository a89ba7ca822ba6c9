"""Invariant 7: kernel id = b * (block_size // kernel_block_size) + k."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.layout import LogicalBlockId, kernel_block_ids, logical_block_id


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 1 << 20), max_size=64), k=st.integers(1, 16))
def test_kernel_ids_expand_each_logical_block_in_order(ids, k):
    kernel = kernel_block_ids([LogicalBlockId(b) for b in ids], k)
    assert len(kernel) == k * len(ids)
    for i, b in enumerate(ids):
        assert kernel[i * k : (i + 1) * k] == [b * k + j for j in range(k)]
    assert [logical_block_id(x, k) for x in kernel[::k]] == ids
    if len(set(ids)) == len(ids):
        assert len(set(kernel)) == len(kernel)  # distinct blocks never share a kernel block


def test_one_kernel_block_per_block_is_the_identity():
    assert kernel_block_ids([3, 1, 2], 1) == [3, 1, 2]

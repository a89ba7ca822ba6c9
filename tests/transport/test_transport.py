"""``raykv.transport``: a batch is one buffer; the receiver's ``verify`` keeps exactly the
leading blocks whose every copy matches its stored checksum."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.tiers.checksum import row_checksums
from raykv.transport import BlockBatch, export_rows, verify


def _batch(copies: int, n: int, seed: int) -> BlockBatch:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 256, (copies, n, 64), generator=g, dtype=torch.uint8)
    sums = tuple(row_checksums(rows[c]) for c in range(copies))
    return BlockBatch(n, rows, sums)


@settings(max_examples=40, deadline=None)
@given(
    copies=st.integers(1, 3),
    n=st.integers(0, 12),
    flips=st.sets(st.tuples(st.integers(0, 2), st.integers(0, 11), st.integers(0, 63))),
)
def test_verify_keeps_the_prefix_before_the_first_corrupt_row(copies, n, flips) -> None:
    b = _batch(copies, n, 1)
    bad = set()
    for c, i, j in flips:
        if c < copies and i < n:
            b.rows[c, i, j] ^= 0x80
            bad.add(i)
    want = min(bad, default=n)
    assert verify(b) == want
    # a head of the batch is the batch of its first blocks
    assert verify(b.head(want)) == want


def test_the_wire_buffer_is_one_array_without_copies() -> None:
    b = _batch(2, 5, 2)
    wire = export_rows(b.rows)
    assert wire.shape == (2, 5, 64) and wire.ctypes.data == b.rows.data_ptr()
    assert b.nbytes == 2 * 5 * 64

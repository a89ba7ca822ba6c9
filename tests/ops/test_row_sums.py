"""The row sum, raykv's one checksum (``kernels/row_sum.h``): the host's native sums equal the
torch reference bit for bit, on random rows of every odd width, and any single-bit flip (at
every position class of a row: the first word, the middle, the last whole word, a partial
tail word; every bit of a word) changes the sum. GPU: ``test_paged_copy_gpu.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.ops import row_sums
from raykv.tiers import checksum


def host_sums(rows: torch.Tensor) -> list[int]:
    return list(checksum.row_checksums(rows))


def flip_positions(width: int) -> list[int]:
    """Byte positions of every class: first word, middle, last whole word, the tail."""
    words = width // 8
    at = {0, 7, width - 1, width // 2}
    if words:
        at |= {8 * (words - 1), 8 * words - 1}
    if width % 8:
        at |= {8 * words, width - 1}
    return sorted(p for p in at if 0 <= p < width)


@pytest.mark.parametrize("width", [*range(0, 41), 63, 64, 65, 127, 1000, 4099, 65536 + 5])
def test_native_sums_equal_the_reference(native, width) -> None:
    g = torch.Generator().manual_seed(width)
    rows = torch.randint(0, 256, (7, width), generator=g, dtype=torch.uint8)
    assert host_sums(rows) == row_sums(rows).tolist()


def test_native_sums_of_picked_rows_equal_the_reference(native) -> None:
    g = torch.Generator().manual_seed(3)
    table = torch.randint(0, 256, (20, 96), generator=g, dtype=torch.uint8).numpy()
    picked = [5, 0, 19, 5, 7]
    want = row_sums(torch.from_numpy(table[picked, :40])).tolist()
    assert checksum.checksums_at(table, picked, 40) == want


def test_native_sums_refuse_rows_outside_the_table(native) -> None:
    table = np.zeros((4, 16), np.uint8)
    with pytest.raises(ValueError, match="outside the table"):
        native.row_sums(table, np.array([4], np.int64), 16, np.empty(1, np.int64))
    with pytest.raises(ValueError, match="at least width"):
        native.row_sums(table, np.array([0], np.int64), 17, np.empty(1, np.int64))


@pytest.mark.parametrize("width", [8, 13, 64, 1029])
def test_every_single_bit_flip_changes_the_sum(native, width) -> None:
    g = torch.Generator().manual_seed(width)
    row = torch.randint(0, 256, (1, width), generator=g, dtype=torch.uint8)
    flipped = []
    for p in flip_positions(width):
        for bit in range(8):
            bad = row.clone()
            bad[0, p] ^= 1 << bit
            flipped.append(bad)
    bad = torch.cat(flipped)
    sums = row_sums(bad)
    assert host_sums(bad) == sums.tolist()
    assert (sums != row_sums(row)[0]).all()


def test_flips_of_two_words_top_bits_change_the_sum(native) -> None:
    """A sum of odd-weighted words (the wire sum before) missed every such pair."""
    g = torch.Generator().manual_seed(1)
    row = torch.randint(0, 256, (1, 256), generator=g, dtype=torch.uint8)
    pairs = []
    for a, b in [(0, 1), (0, 31), (5, 17), (30, 31)]:
        bad = row.clone()
        bad[0, 8 * a + 7] ^= 0x80
        bad[0, 8 * b + 7] ^= 0x80
        pairs.append(bad)
    sums = row_sums(torch.cat(pairs))
    assert (sums != row_sums(row)[0]).all()


def test_moved_words_change_the_sum(native) -> None:
    g = torch.Generator().manual_seed(2)
    row = torch.randint(0, 256, (1, 64), generator=g, dtype=torch.uint8)
    swapped = row.clone()
    swapped[0, :8], swapped[0, 8:16] = row[0, 8:16], row[0, :8]
    assert host_sums(swapped) != host_sums(row)


@settings(max_examples=80, deadline=None)
@given(
    width=st.integers(1, 300),
    seed=st.integers(0, 2**31),
    at=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
)
def test_the_host_sum_is_the_reference_and_sees_any_flip(width, seed, at, bit) -> None:
    """The CPU path's property: whichever sum runs (native, or the reference while it is not
    built), it is the reference's value, and one flipped bit anywhere changes it."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(0, 256, (1, width), generator=g, dtype=torch.uint8)
    bad = row.clone()
    bad[0, int(at * width)] ^= 1 << bit
    both = torch.cat([row, bad])
    assert host_sums(both) == row_sums(both).tolist()
    assert checksum.verified_prefix(both, host_sums(torch.cat([row, row]))) == 1

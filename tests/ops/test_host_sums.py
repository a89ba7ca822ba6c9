"""Host paged copies with row sums (``sums=`` of ``raykv.ops`` on CPU): the native fused copy
(``copy_rows`` of ``kernels/block_hash.cpp``: each word's row-sum term added as it is copied)
moves the same bytes and gives the same sums as the torch reference, for random shapes, dtypes
and odd widths (entries that do not start a row's 64-bit word, a partial last word), both
directions, split over the host threads or not, with cached or streamed stores; and the
reference path (no extension) gives them too."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv import ops
from raykv.ops import reference as ops_reference
from raykv.ops.reference import row_sums

DTYPES = (torch.uint8, torch.bfloat16, torch.float32, torch.int64)


@st.composite
def paged(draw):
    """Entries of ``blocks`` blocks each (1-4 of them, any dtype, any odd inner width), a
    batch of distinct block ids, and a seed for the bytes."""
    blocks = draw(st.integers(1, 12))
    shapes = draw(
        st.lists(
            st.tuples(
                st.sampled_from(DTYPES),
                st.lists(st.integers(1, 9), min_size=0, max_size=2),
                st.integers(0, 300),
            ),
            min_size=1,
            max_size=4,
        )
    )
    entries = []
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    for dtype, inner, extra in shapes:
        shape = (blocks, *inner, extra) if extra else (blocks, *inner)
        raw = torch.randint(0, 256, (*shape, torch.empty((), dtype=dtype).element_size()),
                            generator=g, dtype=torch.uint8)  # fmt: skip
        entries.append(raw.view(dtype).reshape(shape))
    n = draw(st.integers(0, blocks))
    ids = torch.tensor(draw(st.permutations(range(blocks)))[:n], dtype=torch.int64)
    return entries, ids


def oracle_rows(entries: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """Each block's bytes, entry after entry: what a gathered row holds."""
    if not len(ids):
        return torch.empty((0, ops.row_bytes(entries)), dtype=torch.uint8)
    parts = [e[ids].contiguous().view(torch.uint8).reshape(len(ids), ops.row_bytes([e]))
             for e in entries]  # fmt: skip
    return torch.cat(parts, dim=1)


@settings(max_examples=150, deadline=None)
@given(case=paged(), split=st.booleans(), stream=st.booleans(), native_path=st.booleans())
def test_host_copy_with_sums_moves_the_reference_bytes_and_sums(
    native, case, split, stream, native_path
):
    entries, ids = case
    width = ops.row_bytes(entries)
    want = oracle_rows(entries, ids)
    want_sums = row_sums(want)
    piece = max(1, width) if split else ops_reference.PARALLEL_PIECE_BYTES  # a row a thread
    with (
        mock.patch.object(ops_reference, "PARALLEL_PIECE_BYTES", piece),
        mock.patch.object(ops_reference, "STREAM_BYTES", 0 if stream else 1 << 40),
        mock.patch.object(ops_reference, "native_module", lambda: native if native_path else None),
    ):
        dst = torch.full((len(ids), width), 0xA5, dtype=torch.uint8)
        sums = torch.full((len(ids),), -1, dtype=torch.int64)
        ops.gather_blocks(entries, ids, dst, sums=sums)
        assert torch.equal(dst, want)
        assert torch.equal(sums, want_sums)

        # back into blocks of the same shapes, every other block left as it was
        back = [torch.zeros_like(e) for e in entries]
        got = torch.full((len(ids),), -1, dtype=torch.int64)
        assert ops.scatter_blocks(dst, back, ids, sums=got) == len(ids)
        assert torch.equal(got, want_sums)
        untouched = torch.ones(entries[0].shape[0], dtype=torch.bool)
        untouched[ids] = False
        for e, b in zip(entries, back, strict=True):
            e, b = (t.view(torch.uint8).reshape(t.shape[0], -1) for t in (e, b))
            assert torch.equal(b[ids], e[ids])
            assert not b[untouched].any()


@pytest.mark.parametrize("width", [1, 7, 8, 9, 31, 32, 33, 63, 65, 200, 4099])
@pytest.mark.parametrize("stream", [False, True])
def test_fused_copy_of_every_alignment_equals_the_reference(native, width, stream) -> None:
    """Rows and blocks at every byte offset from a 32-byte boundary (the streamed stores' head
    and tail words), one entry of ``width`` bytes: the bytes and sums of the reference."""
    g = torch.Generator().manual_seed(width)
    for shift in range(0, 40, 3):
        pool = torch.randint(0, 256, (shift + 5 * width,), generator=g, dtype=torch.uint8)
        blocks = pool[shift:].view(5, width).numpy()
        rows = np.zeros((3, width + 11), np.uint8)[:, 11 - shift % 11 :][:, :width]
        ids = np.array([4, 0, 2], np.int64)
        sums = np.zeros(3, np.int64)
        native.copy_rows(rows, [blocks], ids, True, sums, 0, 3, stream)
        assert (rows == blocks[ids]).all()
        assert sums.tolist() == row_sums(torch.from_numpy(blocks[ids].copy())).tolist()


def test_fused_copy_refuses_what_does_not_fit_before_copying(native) -> None:
    blocks = np.arange(64, dtype=np.uint8).reshape(4, 16)
    rows = np.zeros((2, 16), np.uint8)
    sums = np.zeros(2, np.int64)
    with pytest.raises(ValueError, match="outside"):
        native.copy_rows(rows, [blocks], np.array([1, 4], np.int64), True, sums, 0, 2, False)
    assert not rows.any()  # the first row, whose id is fine, was not copied either
    with pytest.raises(ValueError, match="as wide"):
        native.copy_rows(rows[:, :8], [blocks], np.array([0, 1], np.int64), True, sums, 0, 2, False)
    with pytest.raises(ValueError, match="range"):
        native.copy_rows(rows, [blocks], np.array([0, 1], np.int64), True, sums, 1, 3, False)
    with pytest.raises(ValueError, match="one per row"):
        native.copy_rows(rows, [blocks], np.array([0, 1], np.int64), True, sums[:1], 0, 2, False)

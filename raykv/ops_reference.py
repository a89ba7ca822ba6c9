"""The torch reference of ``raykv.ops``' paged copies: what runs without CUDA (CI, CPU-device
pools) and what the CUDA kernel must match bit for bit. Rows are moved as same-size integer
words (no float canonicalization), runs of consecutive block ids as one strided copy.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _block_bytes(entry: torch.Tensor) -> int:
    return math.prod(entry.shape[1:]) * entry.element_size()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(e: torch.Tensor) -> torch.Tensor:
    """`e` reinterpreted as an integer type of the same size: bit-exact copies for every dtype
    (no NaN canonicalization) and index ops that fp8 lacks."""
    int_dtype = _SAME_SIZE_INT.get(e.element_size())
    return e if int_dtype is None or e.dtype == int_dtype else e.view(int_dtype)


def _words(rows: torch.Tensor) -> torch.Tensor | None:
    """``[n, bytes]`` uint8 rows (last dim contiguous) as the widest integer words that
    tile them (int64 where the bytes, row stride and offset allow): the reference copies
    move words, not bytes (2-4 x faster on CPU, still bit-exact). None: not expressible."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return rows.view(dtype)
        except RuntimeError:
            continue
    return None


def _block_rows(e: torch.Tensor) -> torch.Tensor | None:
    """An entry as ``[num_blocks, block bytes]`` uint8 (each block is contiguous)."""
    per = math.prod(e.shape[1:])
    try:
        flat = e.as_strided((e.shape[0], per), (e.stride(0), 1))
        return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    except RuntimeError:
        return None


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """(position, first id, length) of each run of consecutive CPU ids, when runs are few
    (a run is one strided copy with no temporary); None: index ops are cheaper."""
    if ids.device.type != "cpu" or ids.numel() < 2:
        return None
    a = ids.numpy()
    breaks = np.flatnonzero(np.diff(a) != 1) + 1
    if len(breaks) + 1 > max(1, a.size // 8):
        return None
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [a.size]))
    return [(int(s), int(a[s]), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def _gather_reference(entries: list[torch.Tensor], ids: torch.Tensor, dst: torch.Tensor) -> None:
    n, offset = ids.numel(), 0
    runs = _runs(ids) if dst.device.type == "cpu" else None
    for e in entries:
        width = _block_bytes(e)
        out = dst[:, offset : offset + width]
        rows = _block_rows(e) if e.device == dst.device else None
        src_w, dst_w = (_words(rows), _words(out)) if rows is not None else (None, None)
        if src_w is not None and dst_w is not None and src_w.dtype == dst_w.dtype:
            if runs is not None:
                for at, first, length in runs:
                    dst_w[at : at + length].copy_(src_w[first : first + length])
            elif len(entries) == 1 and dst_w.is_contiguous():
                torch.index_select(src_w, 0, ids.to(e.device), out=dst_w)
            else:
                dst_w.copy_(src_w.index_select(0, ids.to(e.device)))
        else:
            picked = _as_int(e).index_select(0, ids.to(e.device)).contiguous()
            out.copy_(picked.view(-1).view(torch.uint8).view(n, width))
        offset += width


def _scatter_reference(src: torch.Tensor, entries: list[torch.Tensor], ids: torch.Tensor) -> None:
    n, offset = ids.numel(), 0
    runs = _runs(ids) if src.device.type == "cpu" else None
    for e in entries:
        width, target = _block_bytes(e), _as_int(e)
        part = src[:, offset : offset + width]
        rows = _block_rows(e) if e.device == src.device else None
        dst_w, src_w = (_words(rows), _words(part)) if rows is not None else (None, None)
        if dst_w is not None and src_w is not None and src_w.dtype == dst_w.dtype:
            if runs is not None:
                for at, first, length in runs:
                    dst_w[first : first + length].copy_(src_w[at : at + length])
            else:
                dst_w.index_copy_(0, ids.to(e.device), src_w)
        else:
            raw = part.to(e.device).contiguous()
            values = raw.view(-1).view(target.dtype).view(n, *e.shape[1:])
            target.index_copy_(0, ids.to(e.device), values)
        offset += width


# --- wire sums -----------------------------------------------------------------------------

# word_weight in kernels/paged_copy.cu: (j * _WORD_MUL + _WORD_ADD) | 1, wrapping 64-bit
_WORD_MUL = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_WORD_ADD = 0x632BE59BD9B4E019
_SUM_CHUNK_BYTES = 256 << 20  # rows summed per step: bounded scratch for 2 GiB batches
_weights: dict[tuple[int, str], torch.Tensor] = {}


def word_weights(n: int, device: torch.device) -> torch.Tensor:
    """int64 ``[n]``: the odd weight of each 64-bit word position of a row."""
    key = (n, str(device))
    w = _weights.get(key)
    if w is None:
        j = torch.arange(n, dtype=torch.int64, device=device)
        w = _weights[key] = (j * _WORD_MUL + _WORD_ADD) | 1
        if len(_weights) > 64:
            _weights.pop(next(iter(_weights)))
    return w


def row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Each uint8 row's wire sum (int64 ``[n]`` on the rows' device): the wrapping sum of its
    little-endian 64-bit words times their position's odd weight (a row whose width is not a
    multiple of 8 counts as zero-padded). A change of any one word changes the sum; the
    paged-copy kernel computes the same sums while it copies (``sums=`` of ``raykv.ops``)."""
    n, width = rows.shape
    if width % 8:
        rows = torch.nn.functional.pad(rows, (0, 8 - width % 8))
    out = torch.empty(n, dtype=torch.int64, device=rows.device)
    words = rows.shape[1] // 8
    weights = word_weights(words, rows.device)
    step = max(1, _SUM_CHUNK_BYTES // max(rows.shape[1], 1))
    for i in range(0, n, step):
        part = rows[i : i + step].contiguous().view(torch.int64)
        torch.sum(part * weights, dim=1, out=out[i : i + step])
    return out

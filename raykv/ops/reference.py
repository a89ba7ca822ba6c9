"""The torch reference of ``raykv.ops``' paged copies: what runs without CUDA (CI, CPU-device
pools) and what the CUDA kernel must match bit for bit. Host rows and host entries move through
numpy as bytes (runs of consecutive block ids, up or down, as one slice copy per entry), or,
where the rows' sums are asked for (``sums=``: a CPU engine's tier jobs, a CPU pool's
transfers), natively: ``copy_rows`` of ``kernels/block_hash.cpp`` adds each word's row-sum
term as it copies the word, so every byte is read once (the CPU engine's tier jobs, which
summed the rows on a thread beside the copy, ran at 0.6-0.7 x a plain copy; fused, on the
host threads, at 0.8-1.1 x on the 2-core box and ~3.5 x on the 16-core H200 host). Anything
else moves as same-size integer words (no float canonicalization).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np
import torch

from raykv.blocks.hashing import native_module
from raykv.ops.threads import side_by_side


def block_bytes(entry: torch.Tensor) -> int:
    return math.prod(entry.shape[1:]) * entry.element_size()


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_int(e: torch.Tensor) -> torch.Tensor:
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


# A check (scatter only) sees the source rows in spans just before they are written, on the
# thread that writes them: each host thread walks its piece of the rows in spans, the first of
# about CHECK_SPAN_BYTES, each next one twice the last up to CHECK_SPAN_MAX_BYTES. So a check
# that hashes its rows makes one pass per thread with the copy, not a round of threads of its
# own before it (a fetched chunk verified and scattered: 0.71-0.87 x raw ucxx against
# 0.59-0.75 x hashed first, then copied; 16-core H100 host, 16 MiB chunks, 2 MiB per thread).
# Small first spans let the first rows go early; large later spans cost fewer Python rounds (a
# span costs ~4 us per entry: ~8 ms per 128 MiB of 16 entries in 1 MiB spans; spans of one
# 256 KiB row made that fetch 0.40-0.47 x).
CHECK_SPAN_BYTES = 1 << 20
CHECK_SPAN_MAX_BYTES = 8 << 20
# A host copy of many rows is cut into pieces of at least this many bytes, copied side by side
# on the host threads (``raykv.ops.threads``): one thread moves a fetched 16 MiB chunk into a
# tier's scattered rows in 2.5-4 ms on the 16-core H100 host while UCX lands the next one in ~4.
PARALLEL_PIECE_BYTES = 2 << 20
# A host copy with sums from this size on stores past the cache (``copy_rows``' stream): its
# destination would mostly be evicted before anyone reads it (the 2-core box's EPYC has 32 MiB
# of last-level cache), and a cached store first reads each line it writes: 128 MiB with sums
# took 12-13 ms streamed against 16-18 cached there (two threads). Smaller copies keep their
# rows in cache for the reader (the forward that reads a loaded block).
STREAM_BYTES = 16 << 20

Check = Callable[[int, int], int]  # (lo, hi) -> leading rows of src[lo:hi] that may be written


def _host_blocks(rows: torch.Tensor, entries: list[torch.Tensor]) -> list | None:
    """Every entry as numpy ``[num_blocks, block bytes]`` uint8 with its byte offset in a row,
    when rows and entries are all host memory (the host path below); else None."""
    if rows.device.type != "cpu" or any(e.device.type != "cpu" for e in entries):
        return None
    out, offset = [], 0
    for e in entries:
        b = _block_rows(e.detach())
        if b is None:
            return None
        out.append((b.numpy(), offset, offset + b.shape[1]))
        offset += b.shape[1]
    return out


def _pieces(ids: np.ndarray) -> list[tuple[int, int, int]] | None:
    """(position, length, step) of each maximal run of ``ids`` stepping by +1 or
    -1 (a freed-then-reused block list often runs downwards), when runs are few (each is one
    slice copy per entry); None: fancy indexing is cheaper. Computed once per copy."""
    n = ids.size
    if n == 1:
        return [(0, 1, 1)]
    d = np.diff(ids)
    link = np.abs(d) == 1  # ids[i] and ids[i + 1] may share a run
    # a run ends where a link is missing or where two links in a row change direction
    turn = np.concatenate(([False], link[1:] & link[:-1] & (d[1:] != d[:-1])))
    cut = np.flatnonzero(~link | turn) + 1
    if len(cut) + 1 > max(1, n // 4):
        return None
    out = []
    for lo, hi in zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [n])).tolist(),
                      strict=True):  # fmt: skip
        step = 1 if hi - lo == 1 or ids[lo + 1] > ids[lo] else -1
        out.append((lo, hi - lo, step))
    return out


def _host_copy(
    rows: np.ndarray, blocks: list, ids: np.ndarray, pieces: list | None, lo: int, hi: int,
    scatter: bool,
) -> None:  # fmt: skip
    """rows[i] <-> the blocks ``ids[i]`` of every entry for i in lo..hi-1, on the host: one
    slice copy per entry and run of consecutive ids (``pieces`` of all of ``ids``, either
    direction), else one fancy-indexed copy per entry."""
    for b, start, end in blocks:
        part = rows[:, start:end]
        if pieces is None:
            if scatter:
                b[ids[lo:hi]] = part[lo:hi]
            else:  # ids were range-checked
                np.take(b, ids[lo:hi], axis=0, out=part[lo:hi], mode="clip")
            continue
        for at, length, step in pieces:
            s, e = max(at, lo), min(at + length, hi)
            if s >= e:
                continue
            first = int(min(ids[s], ids[e - 1]))
            dst = b[first : first + e - s][::step]
            if scatter:
                dst[...] = part[s:e]
            else:
                part[s:e] = dst


def _host_rows(
    rows: torch.Tensor,
    blocks: list,
    ids: torch.Tensor,
    scatter: bool,
    check: Check | None,
    sums: torch.Tensor | None = None,
) -> int:
    """The host path of both directions (numpy moves host rows at memcpy speed, torch's
    strided row copies at about half of it here; many rows on several threads, a piece each).
    With ``sums`` each row's sum lands in it (``_summed``). A scatter with ``check``: each
    thread copies its piece span by span (growing, ``CHECK_SPAN_BYTES``), each right after
    ``check`` passed it, and stops at a row it refuses or once a thread found a refused row
    before its span. Returns the rows before the first refused one (all: none was); a row
    refused is never written, rows after it may have been (only ones ``check`` passed)."""
    r, a = rows.numpy(), ids.numpy()
    n, width = a.size, max(1, r.shape[1])
    if sums is not None:  # (ops refuses sums with a check)
        _summed(r, blocks, a, scatter, sums.numpy())
        return n
    pieces = _pieces(a) if n else None

    def copy(lo: int, hi: int) -> None:
        _host_copy(r, blocks, a, pieces, lo, hi, scatter)

    if check is None:
        side_by_side(copy, 0, n, PARALLEL_PIECE_BYTES // width)
        return n
    first_bad, lock = [n], threading.Lock()  # the lowest row refused so far, on any thread
    first, top = max(1, CHECK_SPAN_BYTES // width), max(1, CHECK_SPAN_MAX_BYTES // width)

    def checked(lo: int, end: int) -> None:
        span = first
        while lo < end and lo < first_bad[0]:  # a row refused before this span: stop
            hi = min(lo + span, end)
            ok = lo + check(lo, hi)
            if ok > lo:
                copy(lo, ok)
            if ok < hi:
                with lock:
                    first_bad[0] = min(first_bad[0], ok)
                return
            lo, span = hi, min(top, 2 * span)

    side_by_side(checked, 0, n, PARALLEL_PIECE_BYTES // width)
    return first_bad[0]


def _summed(r: np.ndarray, blocks: list, ids: np.ndarray, scatter: bool, sums: np.ndarray) -> None:
    """The host copy of rows ``r`` <-> ``blocks`` (``_host_blocks``) with each row's sum into
    ``sums``: natively, the sums taken as the words are copied (``copy_rows``, on the host
    threads, a piece each, without the GIL); the reference's copy, then ``row_sums`` of the
    rows, where the extension is not loaded (the same sums)."""
    n, width = ids.size, max(1, r.shape[1])
    piece = PARALLEL_PIECE_BYTES // width
    native = native_module()
    if native is None:
        pieces = _pieces(ids) if n else None

        def copy(lo: int, hi: int) -> None:
            _host_copy(r, blocks, ids, pieces, lo, hi, scatter)

        side_by_side(copy, 0, n, piece)
        sums[:] = row_sums(torch.from_numpy(r)).numpy()
        return
    arrays = [b for b, _, _ in blocks]
    at = np.ascontiguousarray(ids, np.int64)
    stream = n * width >= STREAM_BYTES

    def fused(lo: int, hi: int) -> None:
        native.copy_rows(r, arrays, at, not scatter, sums, lo, hi, stream)

    side_by_side(fused, 0, n, piece)


def gather_reference(
    entries: list[torch.Tensor],
    ids: torch.Tensor,
    dst: torch.Tensor,
    sums: torch.Tensor | None = None,
) -> None:
    """dst[i] = the blocks ``ids[i]`` of ``entries``; with ``sums`` each row's sum too."""
    blocks = _host_blocks(dst, entries)
    if blocks is not None:
        _host_rows(dst, blocks, ids, False, None, sums)
        return
    n, offset = ids.numel(), 0
    for e in entries:
        width = block_bytes(e)
        out = dst[:, offset : offset + width]
        rows = _block_rows(e) if e.device == dst.device else None
        src_w, dst_w = (_words(rows), _words(out)) if rows is not None else (None, None)
        if src_w is not None and dst_w is not None and src_w.dtype == dst_w.dtype:
            if len(entries) == 1 and dst_w.is_contiguous():
                torch.index_select(src_w, 0, ids.to(e.device), out=dst_w)
            else:
                dst_w.copy_(src_w.index_select(0, ids.to(e.device)))
        else:
            picked = as_int(e).index_select(0, ids.to(e.device)).contiguous()
            out.copy_(picked.view(-1).view(torch.uint8).view(n, width))
        offset += width
    if sums is not None:
        sums.copy_(row_sums(dst))


def scatter_reference(
    src: torch.Tensor,
    entries: list[torch.Tensor],
    ids: torch.Tensor,
    check: Check | None = None,
    sums: torch.Tensor | None = None,
) -> int:
    """The blocks ``ids[i]`` of ``entries`` = src[i]; with ``sums`` (not with ``check``) each
    row's sum too. Returns the rows written: all, or those before the first row ``check``
    refused."""
    blocks = _host_blocks(src, entries)
    if blocks is not None:
        return _host_rows(src, blocks, ids, True, check, sums)
    if sums is not None:
        sums.copy_(row_sums(src))
    n = ids.numel() if check is None else check(0, ids.numel())
    src, ids, offset = src[:n], ids[:n], 0
    for e in entries:
        width, target = block_bytes(e), as_int(e)
        part = src[:, offset : offset + width]
        rows = _block_rows(e) if e.device == src.device else None
        dst_w, src_w = (_words(rows), _words(part)) if rows is not None else (None, None)
        if dst_w is not None and src_w is not None and src_w.dtype == dst_w.dtype:
            dst_w.index_copy_(0, ids.to(e.device), src_w)
        else:
            raw = part.to(e.device).contiguous()
            values = raw.view(-1).view(target.dtype).view(n, *e.shape[1:])
            target.index_copy_(0, ids.to(e.device), values)
        offset += width
    return n


# --- wire sums -----------------------------------------------------------------------------

# kernels/row_sum.h, as signed int64: word j's key is j * _KEY_MUL + _KEY_ADD (wrapping), its
# term mixes the word plus its key with _MIX
_KEY_MUL = 0x9E3779B97F4A7C15 - (1 << 64)
_KEY_ADD = 0x632BE59BD9B4E019
_MIX = 0xD6E8FEB86659FD93 - (1 << 64)
_LOW = 0xFFFFFFFF  # an arithmetic >> 32 masked to its low half: the logical shift
_SUM_CHUNK_BYTES = 64 << 20  # rows summed per step: bounded scratch for 2 GiB batches
_keys: dict[tuple[int, str], torch.Tensor] = {}


def word_keys(n: int, device: torch.device) -> torch.Tensor:
    """int64 ``[n]``: the key of each 64-bit word position of a row."""
    key = (n, str(device))
    k = _keys.get(key)
    if k is None:
        j = torch.arange(n, dtype=torch.int64, device=device)
        k = _keys[key] = j * _KEY_MUL + _KEY_ADD
        if len(_keys) > 64:
            _keys.pop(next(iter(_keys)))
    return k


def row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Each uint8 row's sum (int64 ``[n]`` on the rows' device), raykv's one checksum
    (``kernels/row_sum.h`` defines it): the wrapping sum over the row's little-endian 64-bit
    words of each word plus its position's key, mixed (a row whose width is not a multiple of
    8 counts as zero-padded). Any change of one word (any single-bit flip) changes the sum.
    The reference of the paged-copy kernel, which takes the same sums while it copies
    (``sums=`` of ``raykv.ops``), and of the host's native ``raykv.tiers.checksum``."""
    n, width = rows.shape
    if width % 8:
        rows = torch.nn.functional.pad(rows, (0, 8 - width % 8))
    out = torch.zeros(n, dtype=torch.int64, device=rows.device)  # an empty row sums to 0
    if not rows.shape[1]:
        return out
    keys = word_keys(rows.shape[1] // 8, rows.device)
    step = max(1, _SUM_CHUNK_BYTES // max(rows.shape[1], 1))
    for i in range(0, n, step):
        z = rows[i : i + step].contiguous().view(torch.int64) + keys
        z ^= (z >> 32) & _LOW
        z *= _MIX
        z ^= (z >> 32) & _LOW
        torch.sum(z, dim=1, out=out[i : i + step])
    return out

"""Paged KV gather / scatter: blocks of many paged tensors <-> contiguous byte rows.

`gather_blocks` packs, for each requested block, the bytes of that block in every entry (a
layer's K half, V half, an MLA latent...) into one contiguous uint8 row; `scatter_blocks` is
its inverse. The CUDA kernel in `kernels/` does all entries and many blocks per launch: GPU <->
GPU directly, GPU <-> pinned host either pipelined through device chunks that the copy engine
moves ("staged", the default; one C++ call enqueues the whole pipeline) or through mapped (UVA)
host pointers ("direct"); the torch reference below runs everywhere else and gives the same
bytes.

Logical vs kernel blocks (invariant 7): a logical block b covers the ADJACENT kernel blocks
b*k .. b*k+k-1 (k = block_size // kernel_block_size), so `logical_view(t, k)` regroups dim 0
of a paged tensor into logical blocks for free; pass logical views and logical block ids here,
and the kernel block expansion costs nothing. `raykv.layout.kernel_block_ids` spells the id
mapping out.

Copies are asynchronous on the current CUDA stream of the entries' device, like any torch op:
synchronize before reading a host `dst` or handing `src` back to the allocator.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from raykv.errors import InvalidInput
from raykv.ops.checks import (  # argument validation: before anything is touched
    _check,
    _check_chunks,
    _check_distinct,
    _check_sums,
    _entries_key,
    _entries_shape,
    bad_ids,  # the wording of a bad block id, for the C++ callers above ops
    row_bytes,
)
from raykv.ops.kernel import (  # the CUDA extension: built on first use, or ruled out
    kernel_available,
    kernel_module,
    kernel_sources_dir,
    kernel_status,
)
from raykv.ops.kernel import load as _load
from raykv.ops.reference import (  # the torch reference path, bit-exact with the kernel
    as_int,  # rows as same-size ints (the benches read them so)
    block_bytes,
    gather_reference,
    row_sums,
    scatter_reference,
)

__all__ = [
    "MAX_SEGMENT_BYTES",
    "MODES",
    "as_int",
    "bad_ids",
    "block_bytes",
    "gather_blocks",
    "gather_reference",
    "kernel_available",
    "kernel_module",
    "kernel_sources_dir",
    "kernel_status",
    "logical_view",
    "row_bytes",
    "row_segments",
    "row_sums",
    "scatter_blocks",
    "scatter_reference",
]

# Mirrors RAYKV_MAX_SEGMENT_BYTES in kernels/paged_copy.h: larger per-block spans are split so
# one group of the kernel's threads never copies more than this, and it can index with 32 bits.
MAX_SEGMENT_BYTES = 1 << 20
# Spans are split at this size so a few large blocks still spread over every SM.
_PIECE_BYTES = 32 << 10


# --- shapes and ids ------------------------------------------------------------------------


def logical_view(t: torch.Tensor, blocks_per_block: int) -> torch.Tensor:
    """`t` ([num_kernel_blocks, kernel_block_size, ...]) regrouped so dim 0 is logical blocks.

    Logical block b is kernel blocks b*k .. b*k+k-1 (k = blocks_per_block), which are adjacent
    in a paged tensor, so this is a view: [num_kernel_blocks // k, k * kernel_block_size, ...].
    A 1-D tensor of per-block scalars becomes [num_kernel_blocks // k, k]. Works on K/V halves
    (`t[0]`, `t[1]` of a [2, num_kernel_blocks, ...] layer).
    """
    k = blocks_per_block
    n = t.shape[0] if t.dim() else 0
    if k < 1 or t.dim() < 1 or n % k:
        raise InvalidInput(
            f"logical_view: {n} kernel blocks (shape {tuple(t.shape)}) do not group into logical "
            f"blocks of {k}; num_kernel_blocks must be a multiple of "
            "block_size // kernel_block_size (take num_blocks from the plan)"
        )
    if k == 1:
        return t
    inner = t.stride(1) * t.shape[1] if t.dim() > 1 else 1
    if n > k and t.stride(0) != inner:
        raise InvalidInput(
            f"logical_view: kernel blocks of shape {tuple(t.shape)} are not adjacent "
            f"(stride(0)={t.stride(0)}, a block spans {inner} elements); pass a tensor whose "
            "blocks are packed along dim 0, e.g. t[0] of a [2, num_blocks, ...] layer"
        )
    if t.dim() == 1:
        return t.view(n // k, k)
    return t.view(n // k, k * t.shape[1], *t.shape[2:])


# --- CUDA kernel: built just in time, loaded once (raykv.ops.kernel) ------------------------

_lock = threading.Lock()  # the caches below: store and load jobs copy from several threads
_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # segment tables per entries key, LRU
_chunk_counts_cache: dict[tuple, list[int]] = {}  # staged plans per (rows, width, direction...)
_upload_streams: dict[int, torch.cuda.Stream] = {}  # per device: segment table uploads
_aligned: dict[tuple, bool] = {}  # entries key -> every span 8-byte aligned (fused sums)


def row_segments(entries: Sequence[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """The kernel's segment table: (paged base address, block stride, bytes, row offset) per span.

    One span per entry, split into pieces of at most 32 KiB (at 16-byte multiples, so vector
    alignment survives) so that a few large blocks still spread over every SM.
    """
    segments, offset = [], 0
    for e in entries:
        width, stride = block_bytes(e), e.stride(0) * e.element_size()
        for start in range(0, width, _PIECE_BYTES):
            size = min(_PIECE_BYTES, width - start)
            segments.append((e.data_ptr() + start, stride, size, offset + start))
        offset += width
    return segments


def _upload_table(segments: list[tuple[int, int, int, int]], device: torch.device) -> torch.Tensor:
    """The segment table on `device`, complete when this returns. Uploaded on a stream of its
    own and only that stream is waited for: a blocking copy on the caller's stream would hold
    the host until everything queued there before ran (a load queued behind a long-running
    stream would hold back a store issued next on another stream, measured on H100)."""
    host = torch.tensor(segments, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    with torch.cuda.device(device):
        stream = _upload_streams.get(device.index)
        if stream is None:
            stream = _upload_streams.setdefault(device.index, torch.cuda.Stream(device))
        with torch.cuda.stream(stream):
            table = host.to(device)
        stream.synchronize()
    return table


def _segment_table(entries: list[torch.Tensor], key: tuple) -> torch.Tensor:
    device = entries[0].device
    with _lock:  # store and load jobs may copy from several threads
        table = _tables.get(key)
        if table is None:
            table = _upload_table(row_segments(entries), device)
            _tables[key] = table
            if len(_tables) > 256:
                _tables.popitem(last=False)
        else:
            _tables.move_to_end(key)
    return table


def _rows_pointer(module: ModuleType, device: torch.device, rows: torch.Tensor) -> int:
    """Address the kernel on `device` can dereference for `rows`, or 0 where it cannot."""
    if rows.device == device:
        return rows.data_ptr()
    if rows.device.type == "cpu":
        return module.mapped_pointer(rows.data_ptr()) if rows.is_pinned() else 0
    if module.enable_peer_access(device.index, rows.device.index):
        return rows.data_ptr()
    return 0


def _spans_aligned(entries: list[torch.Tensor], key: tuple) -> bool:
    """Whether every span of ``entries`` is 8-byte aligned (64-bit words for the wire sums)."""
    ok = _aligned.get(key)
    if ok is None:
        ok = _aligned[key] = all(
            v % 8 == 0 for seg in row_segments(entries) for v in (seg[0], seg[1], seg[2], seg[3])
        )
    return ok


def _summable(entries: list[torch.Tensor], key: tuple, rows: torch.Tensor) -> bool:
    """Whether the kernel can take the row sums while it copies: every span, the rows and
    so the row width 8-byte aligned (64-bit words); the rows anywhere the kernel reaches."""
    return _spans_aligned(entries, key) and rows.data_ptr() % 8 == 0


def _launch(
    entries: list[torch.Tensor],
    key: tuple,
    ids: torch.Tensor,
    rows: torch.Tensor,
    gather: bool,
    sums: torch.Tensor | None = None,
    chunks: Sequence[int] | None = None,
    each: Callable[[int, int], None] | None = None,
) -> bool:
    """Runs the CUDA kernel, one launch per chunk of rows (rows on a GPU, or pinned host memory
    through UVA); False, before anything ran, where it cannot serve this call (the caller falls
    back to the reference). With ``sums`` the kernel takes the rows' wire sums as it copies,
    where it can (else the reference sums each chunk after its copy)."""
    device = entries[0].device
    if device.type != "cuda" or rows.shape[1] == 0:
        return False
    module = _load()
    if module is None:
        return False
    pointer = _rows_pointer(module, device, rows)
    if not pointer:
        return False
    fused, width = sums is not None and _summable(entries, key, rows), rows.shape[1]
    ctas = _CTAS if chunks is None else _pipeline_ctas(device)
    with torch.cuda.device(device):
        table = _segment_table(entries, key)
        ids = ids.to(device, non_blocking=True).contiguous()
        if fused:
            sums.zero_()
        start = 0
        for count in chunks or (ids.numel(),):
            if each is not None and not gather:
                each(start, count)
            at = sums.data_ptr() + 8 * start if fused else 0
            module.paged_copy(table, ids, pointer + start * width, width, gather, ctas, at,
                              start, count)  # fmt: skip
            if sums is not None and not fused:
                if rows.device.type == "cpu":  # host rows: read once the copy landed
                    torch.cuda.current_stream(device).synchronize()
                sums[start : start + count].copy_(row_sums(rows[start : start + count]))
            if each is not None and gather:
                each(start, count)
            start += count
    return True


@dataclass(frozen=True)
class WireTable:
    """A pool's entries as the C++ wire pipeline copies them (``kernels/wire_pipeline.cpp``):
    the extension, the segment table on the device, the blocks every entry holds, the row
    width and the grid of a copy that runs next to NCCL's kernels. Built (and the entries
    checked) once per pool; a batch then passes only its block ids, which the pipeline checks
    against ``num_blocks`` (and for distinctness where it writes) before it enqueues anything."""

    module: ModuleType
    table: torch.Tensor
    num_blocks: int
    width: int
    ctas: int


def wire_table(entries: Sequence[torch.Tensor]) -> WireTable | None:
    """The pipeline's view of ``entries``, or None where it cannot copy them with fused wire
    sums (KV not on a GPU, no kernel or no NCCL in the extension, spans not 8-byte aligned):
    ``raykv.ops``' own paths copy them then."""
    entries = list(entries)
    key = _entries_key(entries, "wire_table")
    width, num_blocks = _entries_shape(entries, key, "wire_table")
    device = entries[0].device
    module = _load() if device.type == "cuda" else None
    if module is None or not getattr(module, "wire_available", lambda: False)():
        return None
    if not _spans_aligned(entries, key):
        return None
    with torch.cuda.device(device):
        table = _segment_table(entries, key)
    return WireTable(module, table, num_blocks, width, _pipeline_ctas(device))


def _pipeline_ctas(device: torch.device) -> int:
    """The grid of a chunked copy: a pipeline runs it next to other kernels (NCCL's), and a full
    persistent grid would hold every SM until it ends, so it takes a few CTAs per SM."""
    sms = _sm_counts.get(device.index)
    if sms is None:
        sms = _sm_counts[device.index] = torch.cuda.get_device_properties(
            device
        ).multi_processor_count
    return _PIPELINE_CTAS if _PIPELINE_CTAS > 0 else sms * _PIPELINE_CTAS_PER_SM


def _reference(
    entries: list[torch.Tensor],
    ids: torch.Tensor,
    rows: torch.Tensor,
    gather: bool,
    sums: torch.Tensor | None,
    chunks: Sequence[int] | None,
    each: Callable[[int, int], None] | None,
) -> None:
    """The torch reference of ``_launch``, chunk by chunk in the same order (host rows and
    blocks: their sums taken natively as they are copied, ``raykv.ops.reference``)."""
    start = 0
    for count in chunks or (ids.numel(),):
        part = slice(start, start + count)
        got = None if sums is None else sums[part]
        if each is not None and not gather:
            each(start, count)
        if gather:
            gather_reference(entries, ids[part], rows[part], got)
        else:
            scatter_reference(rows[part], entries, ids[part], sums=got)
        if each is not None and gather:
            each(start, count)
        start += count


def _chunk_plan(num_rows: int, width: int, gather: bool) -> list[tuple[int, int]]:
    """(start, count) row ranges of a staged copy, in issue order.

    Chunks double from ~_FIRST_CHUNK_BYTES up to half of _STAGING_BYTES (two buffers alternate).
    The gather side's first kernel and the scatter side's last kernel are the only work the copy
    engine cannot hide, so a gather starts with the smallest chunk and a scatter ends with it.
    """
    cap = max(1, _STAGING_BYTES // 2 // max(1, width))
    size, counts, left = max(1, min(cap, _FIRST_CHUNK_BYTES // max(1, width))), [], num_rows
    while left > 0:
        counts.append(min(size, left))
        left -= counts[-1]
        size = min(cap, size * 2)
    if not gather:
        counts.reverse()
    plan, start = [], 0
    for count in counts:
        plan.append((start, count))
        start += count
    return plan


def _chunk_counts(num_rows: int, width: int, gather: bool) -> list[int]:
    """Row counts of `_chunk_plan`, cached (the plan is the same for every call of a size)."""
    key = (num_rows, width, gather, _STAGING_BYTES, _FIRST_CHUNK_BYTES)
    counts = _chunk_counts_cache.get(key)
    if counts is None:
        counts = [count for _, count in _chunk_plan(num_rows, width, gather)]
        if len(_chunk_counts_cache) >= 1024:
            _chunk_counts_cache.clear()
        _chunk_counts_cache[key] = counts
    return counts


def _start_staged(rows: object, entries: list, gather: bool, mode: str):
    """The kernel module's StagedCopy for host `rows`, or None where staged mode cannot serve
    this call. Checks only what it needs itself: it may run before the arguments are validated.

    Staged mode moves host rows through two alternating device chunks: the kernel gathers or
    scatters in HBM (~50x faster than PCIe) on the caller's stream while the copy engine moves
    the neighbouring chunk on a side stream, so PCIe stays busy from the first chunk to the
    last; kernels/paged_copy_binding.cpp enqueues the whole pipeline in one call (`run`) and
    orders it like one op on the caller's stream. A scatter sends its first two chunks at once
    (they write only the device chunks, never the paged tensors): the copy engine starts
    before the ids are checked and uploaded.
    """
    if mode != "staged" or not entries or not isinstance(rows, torch.Tensor):
        return None
    first = entries[0]
    if not isinstance(first, torch.Tensor) or not first.is_cuda:
        return None
    if rows.device.type != "cpu" or rows.dtype != torch.uint8 or rows.dim() != 2:
        return None
    num_rows, width = rows.shape
    if not num_rows or not width or not rows.is_contiguous() or not rows.is_pinned():
        return None
    module = _load()
    if module is None:
        return None
    counts = _chunk_counts(num_rows, width, gather)
    return module.StagedCopy(rows, first.get_device(), counts, gather, 0 if gather else 2)


_CTAS = int(os.environ.get("RAYKV_COPY_CTAS", "0"))  # 0: one full persistent grid
_PIPELINE_CTAS_PER_SM = int(os.environ.get("RAYKV_PIPELINE_CTAS_PER_SM", "2"))  # chunked copies
_PIPELINE_CTAS = int(os.environ.get("RAYKV_PIPELINE_CTAS", "0"))  # > 0: that grid, absolute
_sm_counts: dict[int | None, int] = {}
# staged mode: device memory of its two chunk buffers together (the allocator reuses them), and
# the size the first chunk aims at (the pipeline fills within a few microseconds). On H200 the
# copy engine idles ~1.3 us between chunks; 2 x 64 MiB measured 0.5-1.5 % faster than 2 x 32.
_STAGING_BYTES = int(os.environ.get("RAYKV_STAGING_BYTES", 128 << 20))
_FIRST_CHUNK_BYTES = int(os.environ.get("RAYKV_FIRST_CHUNK_BYTES", 2 << 20))
MODES = ("staged", "direct")
# staged: device chunks + the copy engine, pipelined (measured faster, kernels/README.md);
# direct: the kernel reads/writes pinned host memory through UVA
_DEFAULT_MODE = os.environ.get("RAYKV_COPY_MODE", "staged")


def _sums_pointer(sums: torch.Tensor | None) -> int:
    return 0 if sums is None else sums.data_ptr()


def _mode(mode: str | None, what: str) -> str:
    mode = mode or _DEFAULT_MODE
    if mode not in MODES:
        raise InvalidInput(f"{what}: mode {mode!r} is not one of {MODES} (RAYKV_COPY_MODE)")
    return mode


# --- public API ----------------------------------------------------------------------------


def gather_blocks(
    entries: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    dst: torch.Tensor,
    *,
    mode: str | None = None,
    sums: torch.Tensor | None = None,
    chunks: Sequence[int] | None = None,
    each: Callable[[int, int], None] | None = None,
) -> None:
    """dst[i] = concat over entries e of the bytes of e[block_ids[i]] (row-major, block-major).

    entries: tensors whose dim 0 is the block dim; each e[j] is contiguous in itself (stride(0)
    may be anything, e.g. K and V halves of a [2, num_blocks, bs, heads, hd] layer passed as two
    entries t[0] and t[1]); any dtype, all on one device. block_ids: int64 1-D, on CPU or the
    entries' device (CPU ids avoid a device sync for the range check). dst: contiguous uint8
    [len(block_ids), row_bytes(entries)] on the entries' device, another GPU, pinned host
    memory (the kernel writes it through its mapped UVA pointer), or plain CPU memory.
    mode (pinned host dst only): "staged" (the kernel gathers into device chunks while the copy
    engine moves the previous one) or "direct" (the kernel writes host memory through UVA);
    default $RAYKV_COPY_MODE or "staged". sums (int64 [len(block_ids)] on the entries'
    device): receives each row's sum (``row_sums``), taken by the kernel while it copies, in
    every mode (a staged copy sums each device chunk it fills; the host never reads the rows).
    chunks (row counts summing to len(block_ids)): one launch per chunk, in order, and
    ``each(start, count)`` called after each chunk's copy is queued (a pipeline sends it
    while the next is gathered); pinned host ids keep the host from waiting on the device.
    Raises InvalidInput, before touching anything, on any mismatch.
    """
    mode = _mode(mode, "gather_blocks")
    entries, key = _check(entries, block_ids, dst, "gather_blocks")
    _check_sums(sums, dst, entries, "gather_blocks")
    _check_chunks(chunks, block_ids.numel(), "gather_blocks")
    if not block_ids.numel():
        return
    fuse = sums is None or _spans_aligned(entries, key)
    staged = _start_staged(dst, entries, True, mode) if chunks is None and fuse else None
    if staged is not None:  # after the checks: a gather reads the pool
        staged.run(_segment_table(entries, key), block_ids, _CTAS, _sums_pointer(sums))
    elif not _launch(entries, key, block_ids, dst, True, sums, chunks, each):
        _reference(entries, block_ids, dst, True, sums, chunks, each)


def scatter_blocks(
    src: torch.Tensor,
    entries: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    mode: str | None = None,
    sums: torch.Tensor | None = None,
    chunks: Sequence[int] | None = None,
    each: Callable[[int, int], None] | None = None,
    check: Callable[[int, int], int] | None = None,
) -> int:
    """Inverse of gather_blocks: e[block_ids[i]] = the matching bytes of src[i].

    Same rules as gather_blocks for src (in the role of dst); block ids must also be distinct,
    since two rows written to one block would race. sums: the row sums of the rows as they
    were read and written (a receiver compares them with the sender's, a tier with the
    stored checksums). With chunks, ``each(start, count)`` is called BEFORE each chunk's
    copy is queued (a pipeline makes the copy wait for that chunk's arrival there).
    ``check(lo, hi)`` (optional, not with sums or chunks) is called on the rows
    ``src[lo:hi]`` before any of them is written and returns how many of them (from ``lo``)
    may be, so a caller can verify rows as they go (on the host, span by span on each host
    thread, each span right before that thread copies it, while it is in cache: ``check``
    must be thread-safe; elsewhere all rows first). A row refused is never written; rows
    after it may have been (on the host, by other threads: only rows ``check`` passed).
    Returns the rows before the first refused one (all rows: none was).
    """
    mode = _mode(mode, "scatter_blocks")
    entries = list(entries)
    if check is not None and (sums is not None or chunks is not None):
        raise InvalidInput("scatter_blocks: check cannot be combined with sums or chunks")
    if check is not None and not (src.device.type == "cpu" and entries[0].device.type == "cpu"):
        n = check(0, block_ids.numel())
        src, block_ids, check = src[:n], block_ids[:n], None
    # Host rows start towards the device before the checks (they overlap the first DMA): only
    # device chunks are written until run(), so bad input still leaves the pool untouched.
    plain = sums is None and chunks is None
    staged = _start_staged(src, entries, False, mode) if plain else None
    try:
        entries, key = _check(entries, block_ids, src, "scatter_blocks")
        _check_sums(sums, src, entries, "scatter_blocks")
        _check_chunks(chunks, block_ids.numel(), "scatter_blocks")
        _check_distinct(block_ids, "scatter_blocks")
    except BaseException:
        if staged is not None:
            staged.cancel()
        raise
    if staged is None and chunks is None and sums is not None and _spans_aligned(entries, key):
        staged = _start_staged(src, entries, False, mode)  # with sums: no early chunks
    if staged is not None:
        staged.run(_segment_table(entries, key), block_ids, _CTAS, _sums_pointer(sums))
    elif block_ids.numel() and not _launch(entries, key, block_ids, src, False, sums, chunks, each):
        if check is not None:
            return scatter_reference(src, entries, block_ids, check)
        _reference(entries, block_ids, src, False, sums, chunks, each)
    return block_ids.numel()

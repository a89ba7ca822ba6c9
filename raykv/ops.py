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
and the kernel block expansion costs nothing. `kernel_block_ids` spells the id mapping out.

Copies are asynchronous on the current CUDA stream of the entries' device, like any torch op:
synchronize before reading a host `dst` or handing `src` back to the allocator.
"""

from __future__ import annotations

import importlib.resources
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from raykv.errors import InvalidInput
from raykv.ops_reference import (  # the torch reference path, bit-exact with the kernel
    _as_int,  # noqa: F401  (the benches read rows as same-size ints through ops)
    _block_bytes,
    _gather_reference,
    _scatter_reference,
)

log = logging.getLogger(__name__)

__all__ = [
    "MAX_SEGMENT_BYTES",
    "MODES",
    "gather_blocks",
    "kernel_available",
    "kernel_block_ids",
    "kernel_module",
    "kernel_sources_dir",
    "kernel_status",
    "logical_view",
    "row_bytes",
    "row_segments",
    "scatter_blocks",
]

# Mirrors RAYKV_MAX_SEGMENT_BYTES in kernels/paged_copy.h: larger per-block spans are split so
# one CTA never copies more than this, and the kernel can index with 32 bits.
MAX_SEGMENT_BYTES = 1 << 20
# Spans are split at this size so a few large blocks still spread over every SM.
_PIECE_BYTES = 32 << 10


# --- shapes and ids ------------------------------------------------------------------------


def row_bytes(entries: Sequence[torch.Tensor]) -> int:
    """Bytes of one gathered row: one block of every entry, concatenated."""
    return sum(_block_bytes(e) for e in entries)


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


def kernel_block_ids(logical_ids: torch.Tensor, blocks_per_block: int) -> torch.Tensor:
    """Kernel block ids covered by `logical_ids`, in order: b -> b*k + 0 .. b*k + k-1."""
    k = blocks_per_block
    offsets = torch.arange(k, dtype=torch.int64, device=logical_ids.device)
    return (logical_ids.to(torch.int64)[:, None] * k + offsets).reshape(-1)


# --- validation (before anything is touched) -----------------------------------------------


def _entries_key(entries: list[torch.Tensor], what: str) -> tuple:
    """Everything the entries' validation, row width and segment table depend on (the cache key:
    validating 64 entries from scratch costs ~0.2 ms of Python per call, this ~30 us)."""
    if not entries or not all(isinstance(e, torch.Tensor) for e in entries):
        raise InvalidInput(f"{what}: entries must be a non-empty sequence of tensors")
    return tuple((e.data_ptr(), e.get_device(), e.dtype, e.shape, e.stride()) for e in entries)


def _entries_shape(entries: list[torch.Tensor], key: tuple, what: str) -> tuple[int, int]:
    """(row bytes, blocks every entry holds) of valid entries; raises InvalidInput naming the
    first bad entry."""
    with _lock:
        shape = _shapes.get(key)
        if shape is not None:
            _shapes.move_to_end(key)
            return shape
    _check_entries(entries, what)
    shape = row_bytes(entries), min(e.shape[0] for e in entries)
    with _lock:
        _shapes[key] = shape
        if len(_shapes) > 256:
            _shapes.popitem(last=False)
    return shape


def _check_entries(entries: list[torch.Tensor], what: str) -> None:
    device = entries[0].device
    for j, e in enumerate(entries):
        if e.device != device:
            raise InvalidInput(
                f"{what}: entry {j} is on {e.device} but entry 0 is on {device}; "
                "all entries must live on one device"
            )
        if e.dim() < 1:
            raise InvalidInput(f"{what}: entry {j} is a scalar; dim 0 must be the block dim")
        if not _block_contiguous(e):
            raise InvalidInput(
                f"{what}: entry {j} (shape {tuple(e.shape)}, strides {e.stride()}) is not "
                "contiguous within a block; only dim 0 may be strided (.contiguous() it)"
            )


def _check(
    entries: Sequence[torch.Tensor], block_ids: torch.Tensor, rows: torch.Tensor, what: str
) -> tuple[list[torch.Tensor], tuple]:
    """(entries as a list, their cache key) once every argument is valid."""
    entries = list(entries)
    key = _entries_key(entries, what)
    (width, num_blocks), device = _entries_shape(entries, key, what), entries[0].device
    if not isinstance(block_ids, torch.Tensor) or block_ids.dtype != torch.int64:
        got = block_ids.dtype if isinstance(block_ids, torch.Tensor) else type(block_ids)
        raise InvalidInput(f"{what}: block_ids must be an int64 tensor, got {got}")
    if block_ids.dim() != 1:
        raise InvalidInput(f"{what}: block_ids must be 1-D, got shape {tuple(block_ids.shape)}")
    if block_ids.device.type != "cpu" and block_ids.device != device:
        raise InvalidInput(
            f"{what}: block_ids are on {block_ids.device}; pass them on cpu or on {device}"
        )
    n = block_ids.numel()
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8:
        got = rows.dtype if isinstance(rows, torch.Tensor) else type(rows)
        raise InvalidInput(f"{what}: the row buffer must be a uint8 tensor, got {got}")
    if tuple(rows.shape) != (n, width):
        raise InvalidInput(
            f"{what}: the row buffer has shape {tuple(rows.shape)}, expected ({n}, {width}) "
            f"= (len(block_ids), row_bytes(entries))"
        )
    if not rows.is_contiguous():
        raise InvalidInput(f"{what}: the row buffer must be contiguous")
    if not (
        rows.device == device
        or rows.device.type == "cpu"
        or (rows.device.type == "cuda" and device.type == "cuda")
    ):
        raise InvalidInput(
            f"{what}: entries are on {device} but the row buffer is on {rows.device}; use "
            f"{device}, host memory or another GPU"
        )
    if n:
        lo, hi = int(block_ids.min()), int(block_ids.max())  # a sync for GPU ids: pass cpu ids
        if lo < 0 or hi >= num_blocks:
            raise InvalidInput(
                f"{what}: block ids span [{lo}, {hi}] but the entries hold {num_blocks} blocks; "
                f"ids must lie in [0, {num_blocks - 1}] (logical ids for logical views)"
            )
    return entries, key


def _block_contiguous(e: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(e.shape[1:]), reversed(e.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


# --- CUDA kernel (built just in time, loaded once) -----------------------------------------

# Where the CUDA sources live: the wheel ships the repo's kernels/ folder as raykv/_kernels
# (pyproject.toml maps it); a source checkout or editable install reads kernels/ itself.
_PACKAGED_KERNELS = "_kernels"
_SOURCE_KERNELS = Path(__file__).resolve().parents[1] / "kernels"
_KERNEL_SOURCES = ("paged_copy_binding.cpp", "paged_copy.cu")
_lock = threading.Lock()
_module: ModuleType | None = None
_status: str | None = None  # why the kernel is (not) in use, once decided
_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # segment tables per entries key, LRU
_shapes: OrderedDict[tuple, tuple[int, int]] = OrderedDict()  # entries that passed the checks
_chunk_counts_cache: dict[tuple, list[int]] = {}  # staged plans per (rows, width, direction...)
_upload_streams: dict[int, torch.cuda.Stream] = {}  # per device: segment table uploads


def _load() -> ModuleType | None:
    global _module, _status
    if _status is not None:
        return _module
    with _lock:
        if _status is not None:
            return _module
        module, status, fix = _build()
        if fix:  # a CUDA machine that should run the kernel does not: say so, once per process
            log.warning(
                "raykv paged copy: CUDA is available but the CUDA kernel is not in use, block "
                "copies fall back to the slower torch reference (%s). Fix: %s; or set "
                "RAYKV_DISABLE_KERNEL=1 to use the reference on purpose.",
                status.removeprefix("torch reference: "),
                fix,
            )
        else:
            log.debug("raykv paged copy: %s", status)
        _module, _status = module, status
    return _module


def kernel_sources_dir() -> Path:
    """The folder the CUDA kernel is built from: $RAYKV_KERNELS_DIR when set, else the sources
    installed with the package (raykv/_kernels), else the source checkout's kernels/ folder."""
    override = os.environ.get("RAYKV_KERNELS_DIR", "")
    if override:
        return Path(override)
    packaged = Path(str(importlib.resources.files("raykv") / _PACKAGED_KERNELS))
    if all((packaged / name).is_file() for name in _KERNEL_SOURCES):
        return packaged
    return _SOURCE_KERNELS


def _build() -> tuple[ModuleType | None, str, str]:
    """(module, status, fix): fix is non-empty where CUDA is there but the kernel is not."""
    if os.environ.get("RAYKV_DISABLE_KERNEL", "") not in ("", "0"):
        return None, "torch reference: RAYKV_DISABLE_KERNEL is set", ""
    if not torch.cuda.is_available():
        return None, "torch reference: no CUDA device (or a CPU-only torch build)", ""
    kernel_dir = kernel_sources_dir()
    sources = [kernel_dir / name for name in _KERNEL_SOURCES]
    if not all(p.is_file() for p in sources):
        return (
            None,
            f"torch reference: kernel sources not found under {kernel_dir}",
            "reinstall raykv from a wheel that ships raykv/_kernels, or point "
            "RAYKV_KERNELS_DIR at the kernels/ folder of a raykv checkout",
        )
    try:
        from torch.utils import cpp_extension

        if cpp_extension.CUDA_HOME is None:
            return (
                None,
                "torch reference: CUDA_HOME/nvcc not found, cannot build the kernel",
                "install the CUDA toolkit (nvcc) matching torch's CUDA and set CUDA_HOME",
            )
        cache = Path(os.environ.get("RAYKV_CACHE_DIR", Path.home() / ".cache" / "raykv"))
        build_dir = cache / "torch_extensions" / f"paged_copy_torch{torch.__version__}"
        build_dir.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name="raykv_paged_copy",
            sources=[str(p) for p in sources],
            extra_include_paths=[str(kernel_dir)],
            extra_cflags=["-O3"],
            extra_cuda_cflags=["-O3"],
            build_directory=str(build_dir),
            verbose=os.environ.get("RAYKV_KERNEL_VERBOSE", "") not in ("", "0"),
        )
    except Exception as exc:  # any build/load failure: the reference still gives right bytes
        return (
            None,
            f"torch reference: building the CUDA kernel failed: {exc!s:.2000}",
            "rerun with RAYKV_KERNEL_VERBOSE=1 for the compiler output",
        )
    return module, f"CUDA kernel raykv_paged_copy built in {build_dir}", ""


def kernel_available() -> bool:
    """True when the CUDA extension is built and loaded (building it on first call)."""
    return _load() is not None


def kernel_module() -> ModuleType | None:
    """The loaded extension (paged_copy, mapped_pointer, enable_peer_access, memcpy_loop)."""
    return _load()


def kernel_status() -> str:
    """One line saying whether the CUDA kernel or the torch reference runs, and why."""
    _load()
    return _status or "undecided"


def row_segments(entries: Sequence[torch.Tensor]) -> list[tuple[int, int, int, int]]:
    """The kernel's segment table: (paged base address, block stride, bytes, row offset) per span.

    One span per entry, split into pieces of at most 32 KiB (at 16-byte multiples, so vector
    alignment survives) so that a few large blocks still spread over every SM.
    """
    segments, offset = [], 0
    for e in entries:
        width, stride = _block_bytes(e), e.stride(0) * e.element_size()
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


def _launch(
    entries: list[torch.Tensor],
    key: tuple,
    ids: torch.Tensor,
    rows: torch.Tensor,
    gather: bool,
) -> bool:
    """Runs the CUDA kernel in one launch (rows on a GPU, or pinned host memory through UVA);
    False where it cannot serve this call (the caller falls back to the reference)."""
    device = entries[0].device
    if device.type != "cuda" or rows.shape[1] == 0:
        return False
    module = _load()
    if module is None:
        return False
    pointer = _rows_pointer(module, device, rows)
    if not pointer:
        return False
    with torch.cuda.device(device):
        table = _segment_table(entries, key)
        ids = ids.to(device, non_blocking=True).contiguous()
        module.paged_copy(table, ids, pointer, rows.shape[1], gather, _CTAS)
    return True


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
# staged mode: device memory of its two chunk buffers together (the allocator reuses them), and
# the size the first chunk aims at (the pipeline fills within a few microseconds). On H200 the
# copy engine idles ~1.3 us between chunks; 2 x 64 MiB measured 0.5-1.5 % faster than 2 x 32.
_STAGING_BYTES = int(os.environ.get("RAYKV_STAGING_BYTES", 128 << 20))
_FIRST_CHUNK_BYTES = int(os.environ.get("RAYKV_FIRST_CHUNK_BYTES", 2 << 20))
MODES = ("staged", "direct")
# staged: device chunks + the copy engine, pipelined (measured faster, kernels/README.md);
# direct: the kernel reads/writes pinned host memory through UVA
_DEFAULT_MODE = os.environ.get("RAYKV_COPY_MODE", "staged")


def _mode(mode: str | None, what: str) -> str:
    mode = mode or _DEFAULT_MODE
    if mode not in MODES:
        raise InvalidInput(f"{what}: mode {mode!r} is not one of {MODES} (RAYKV_COPY_MODE)")
    return mode


def _has_duplicates(ids: torch.Tensor) -> bool:
    if ids.numel() < 2:
        return False
    # numpy's sort of host ids costs ~8 us for 1024 of them, torch.unique ~40 (before every copy)
    order = np.sort(ids.numpy()) if ids.device.type == "cpu" else torch.sort(ids).values
    return bool((order[1:] == order[:-1]).any())


# --- public API ----------------------------------------------------------------------------


def gather_blocks(
    entries: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    dst: torch.Tensor,
    *,
    mode: str | None = None,
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
    default $RAYKV_COPY_MODE or "staged". Raises InvalidInput, before touching anything, on
    any mismatch.
    """
    mode = _mode(mode, "gather_blocks")
    entries, key = _check(entries, block_ids, dst, "gather_blocks")
    if not block_ids.numel():
        return
    staged = _start_staged(dst, entries, True, mode)  # after the checks: a gather reads the pool
    if staged is not None:
        staged.run(_segment_table(entries, key), block_ids, _CTAS)
    elif not _launch(entries, key, block_ids, dst, True):
        _gather_reference(entries, block_ids, dst)


def scatter_blocks(
    src: torch.Tensor,
    entries: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    *,
    mode: str | None = None,
    check: Callable[[int, int], int] | None = None,
) -> int:
    """Inverse of gather_blocks: e[block_ids[i]] = the matching bytes of src[i].

    Same rules as gather_blocks for src (in the role of dst); block ids must also be distinct,
    since two rows written to one block would race. ``check(lo, hi)`` (optional) is called on
    the rows ``src[lo:hi]`` before any of them is written and returns how many of them (from
    ``lo``) may be: the copy stops at the first row refused, so a caller can verify rows as
    they go (on the host, span by span, while each span is in cache; elsewhere all rows first).
    Returns the rows written.
    """
    mode = _mode(mode, "scatter_blocks")
    entries = list(entries)
    if check is not None and not (src.device.type == "cpu" and entries[0].device.type == "cpu"):
        n = check(0, block_ids.numel())
        src, block_ids, check = src[:n], block_ids[:n], None
    # Host rows start towards the device before the checks (they overlap the first DMA): only
    # device chunks are written until run(), so bad input still leaves the pool untouched.
    staged = _start_staged(src, entries, False, mode)
    try:
        entries, key = _check(entries, block_ids, src, "scatter_blocks")
        if _has_duplicates(block_ids):
            raise InvalidInput(
                f"scatter_blocks: block_ids hold duplicates ({block_ids.numel()} ids, "
                f"{torch.unique(block_ids).numel()} distinct); each block may be written once"
            )
    except BaseException:
        if staged is not None:
            staged.cancel()
        raise
    if staged is not None:
        staged.run(_segment_table(entries, key), block_ids, _CTAS)
    elif block_ids.numel() and not _launch(entries, key, block_ids, src, False):
        return _scatter_reference(src, entries, block_ids, check)
    return block_ids.numel()

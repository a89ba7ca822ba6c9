"""Argument validation of ``raykv.ops``' paged copies: everything is checked before any byte
moves, and a bad call raises ``InvalidInput`` naming the numbers and the fix. Valid entries
are remembered by their addresses, shapes and strides (validating 64 entries from scratch
costs ~0.2 ms of Python per call, a cache hit ~30 us).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from raykv.errors import InvalidInput
from raykv.ops.reference import block_bytes

_lock = threading.Lock()
_shapes: OrderedDict[tuple, tuple[int, int]] = OrderedDict()  # entries that passed the checks


def row_bytes(entries: Sequence[torch.Tensor]) -> int:
    """Bytes of one gathered row: one block of every entry, concatenated."""
    return sum(block_bytes(e) for e in entries)


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


def _check_sums(
    sums: torch.Tensor | None, rows: torch.Tensor, entries: list[torch.Tensor], what: str
) -> None:
    if sums is None:
        return
    n = rows.shape[0]
    if (
        not isinstance(sums, torch.Tensor)
        or sums.dtype != torch.int64
        or tuple(sums.shape) != (n,)
        or not sums.is_contiguous()
    ):
        got = (sums.dtype, tuple(sums.shape)) if isinstance(sums, torch.Tensor) else type(sums)
        raise InvalidInput(f"{what}: sums must be a contiguous int64 [{n}] tensor, got {got}")
    if sums.device != entries[0].device:
        raise InvalidInput(
            f"{what}: row sums go to the entries' device ({entries[0].device}), got sums on "
            f"{sums.device}"
        )


def _check_chunks(chunks: Sequence[int] | None, n: int, what: str) -> None:
    if chunks is not None and (sum(chunks) != n or any(c <= 0 for c in chunks)):
        raise InvalidInput(
            f"{what}: chunks {list(chunks)[:8]} must be positive row counts summing to the "
            f"{n} block ids"
        )


def _block_contiguous(e: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(e.shape[1:]), reversed(e.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_distinct(ids: torch.Tensor, what: str) -> None:
    if _has_duplicates(ids):
        raise InvalidInput(
            f"{what}: block_ids hold duplicates ({ids.numel()} ids, "
            f"{torch.unique(ids).numel()} distinct); each block may be written once"
        )


def _has_duplicates(ids: torch.Tensor) -> bool:
    if ids.numel() < 2:
        return False
    # numpy's sort of host ids costs ~8 us for 1024 of them, torch.unique ~40 (before every copy)
    order = np.sort(ids.numpy()) if ids.device.type == "cpu" else torch.sort(ids).values
    return bool((order[1:] == order[:-1]).any())


_BAD_ID_REASONS = 4  # kernels/wire_pipeline.cpp: position * 4 + reason


def bad_ids(what: str, block_ids: Sequence[int], num_blocks: int, code: int) -> InvalidInput:
    """The error for the first bad id the C++ pipeline found (``code``, see ``wire_send``;
    ``pool_read`` and ``raykv.ops.pools.PoolCopy`` report theirs alike), worded here: the pipeline
    formats no message and throws nothing for bad input."""
    at, reason = divmod(code, _BAD_ID_REASONS)
    if reason == 1:
        return InvalidInput(f"{what}: block id at position {at} is not an int; pass ints")
    got = block_ids[at]
    if reason == 2:
        return InvalidInput(
            f"{what}: block id {got} (position {at}) is outside the pool's {num_blocks} "
            f"blocks; ids must lie in [0, {num_blocks - 1}]"
        )
    return InvalidInput(
        f"{what}: block id {got} appears more than once; each block can receive only one row"
    )

"""Optional per-block checksums: xxh3-64 of each stored row, checked again before a load.

A mismatch means the CPU copy is not what was stored (bit flip, a stray writer): the loader
treats the block as a miss and counts an error; it never scatters the bad bytes to the GPU.
"""

from __future__ import annotations

import torch
import xxhash


def row_checksums(rows: torch.Tensor) -> tuple[int, ...]:
    """xxh3-64 of each row of a CPU uint8 ``[n, bytes]`` tensor (each row contiguous)."""
    if rows.device.type != "cpu" or rows.dtype != torch.uint8 or rows.dim() != 2:
        raise ValueError(f"checksums need CPU uint8 rows, got {rows.dtype} {rows.device}")
    arr = rows.numpy()
    return tuple(xxhash.xxh3_64_intdigest(arr[i]) for i in range(arr.shape[0]))


def rows_match(rows: torch.Tensor, expected: tuple[int, ...]) -> list[bool]:
    return [a == b for a, b in zip(row_checksums(rows), expected, strict=True)]

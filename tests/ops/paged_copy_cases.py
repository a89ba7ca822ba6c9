"""Paged KV layouts and an independent byte oracle shared by the CPU and GPU op tests."""

from __future__ import annotations

import ctypes

import torch

from raykv.ops import row_segments

DTYPES = {
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "u8": torch.uint8,
    "f32": torch.float32,
}


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device="cpu"):
    """Random raw bits viewed as `dtype` (NaN payloads included: copies must be bit-exact)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


def kv_entries(
    kind: str,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    layers: int,
    gen: torch.Generator,
    device="cpu",
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(entries, backing tensors) for one layout kind.

    kv: per layer [2, num_blocks, block_size, heads, head_dim], entries t[0] and t[1].
    mla: per layer one latent [num_blocks, block_size, 576].
    interleaved: per layer [num_blocks, 2, block_size, heads, head_dim], entries t[:, 0], t[:, 1]
    (stride(0) spans both halves).
    """
    heads, head_dim = 2, 8
    backing, entries = [], []
    for _ in range(layers):
        if kind == "kv":
            t = random_bits((2, num_blocks, block_size, heads, head_dim), dtype, gen, device)
            entries += [t[0], t[1]]
        elif kind == "mla":
            t = random_bits((num_blocks, block_size, 576), dtype, gen, device)
            entries.append(t)
        elif kind == "interleaved":
            t = random_bits((num_blocks, 2, block_size, heads, head_dim), dtype, gen, device)
            entries += [t[:, 0], t[:, 1]]
        else:
            raise ValueError(kind)
        backing.append(t)
    return entries, backing


def block_bytes(e: torch.Tensor, b: int) -> bytes:
    return e[b].contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()


def oracle_rows(entries: list[torch.Tensor], ids: list[int]) -> list[bytes]:
    """The contract spelled out the slow way: row i = bytes of e[ids[i]] for every e, in order."""
    return [b"".join(block_bytes(e, b) for e in entries) for b in ids]


def emulate_kernel(entries: list[torch.Tensor], ids: list[int], rows: torch.Tensor, gather: bool):
    """Executes the CUDA kernel's segment table with memmove on CPU tensors (tests the table)."""
    width = rows.shape[1]
    for i, b in enumerate(ids):
        row = rows.data_ptr() + i * width
        for base, stride, size, offset in row_segments(entries):
            paged = base + b * stride
            dst, src = (row + offset, paged) if gather else (paged, row + offset)
            ctypes.memmove(dst, src, size)

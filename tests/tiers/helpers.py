"""Small plans, block tables and hashes for the tiers tests (everything on CPU, tiny)."""

from __future__ import annotations

import dataclasses
import random

import torch

from raykv.layout import MLA, FullAttention, Mamba, Plan, SlidingWindow, plan
from raykv.tiers import NULL_BLOCK, GpuKV, group_factor

MODELS = (
    "full",
    "mla",
    "sliding",
    "hybrid",
    "mamba_hybrid",
    "mixed_heads",
    "ratio_hybrid",
    "uneven_hybrid",
)


def layers_for(model: str, num_layers: int = 2, window: int = 16, dtype: str = "bfloat16"):
    full = FullAttention(dtype=dtype, num_kv_heads=2, head_dim=8)
    sliding = SlidingWindow(dtype=dtype, num_kv_heads=2, head_dim=8, window=window)
    attn = {f"a{i}": full for i in range(num_layers)}
    if model == "full":
        return attn
    if model == "mixed_heads":  # one group, layers of different page sizes
        return {"a0": full, "a1": FullAttention(dtype=dtype, num_kv_heads=4, head_dim=8)}
    if model == "mla":
        return {
            f"m{i}": MLA(dtype=dtype, kv_lora_rank=16, qk_rope_head_dim=8)
            for i in range(num_layers)
        }
    if model == "sliding":
        return {f"s{i}": sliding for i in range(num_layers)}
    if model == "hybrid":
        return {**attn, **{f"s{i}": sliding for i in range(num_layers)}}
    if model == "ratio_hybrid":  # pages 1:2, unified by doubling the full group's block size
        wide = SlidingWindow(dtype=dtype, num_kv_heads=4, head_dim=8, window=window)
        return {"a0": full, "s0": wide}
    if model == "uneven_hybrid":  # a group that leaves some shared tensors unused
        return {**{f"a{i}": full for i in range(3)}, **{f"s{i}": sliding for i in range(2)}}
    if model == "mamba_hybrid":
        return {**attn, "mamba0": Mamba(dtype=dtype, state_shapes=((8, 3), (2, 4, 8)))}
    raise ValueError(model)


def make_plan(
    model: str = "full",
    *,
    block_size: int = 4,
    factor: int = 1,
    kernel: int | None = None,
    num_gpu_blocks: int = 64,
    cpu_blocks: int = 32,
    tp_size: int = 1,
    window: int = 16,
    num_layers: int = 2,
) -> Plan:
    layers = layers_for(model, num_layers, window)
    p = plan(
        layers,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=64,
        max_num_batched_tokens=64,
        tp_size=tp_size,
        block_size=block_size,
        offload_block_size=block_size * factor,
        kernel_block_sizes=None if kernel is None else [kernel],
        cpu_bytes=1,  # only to get cpu_bytes_per_block; the block count is set below
    )
    return dataclasses.replace(p, cpu_num_blocks=cpu_blocks)


def filled_kv(plan, seed: int) -> GpuKV:
    """A CPU ``GpuKV`` of ``plan`` whose every (distinct) entry holds random bytes."""
    kv = GpuKV.allocate(plan, "cpu")
    g = torch.Generator().manual_seed(seed)
    for e in {id(t): t for es in kv._entries.values() for t in es}.values():
        e.copy_(torch.randint(0, 256, e.shape, generator=g, dtype=torch.uint8))
    return kv


def fill_random(kv: GpuKV, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for group in kv.plan.groups:
        for e in kv.entries(group.group_id):
            e.view(torch.uint8).copy_(
                torch.randint(0, 256, e.view(torch.uint8).shape, generator=g, dtype=torch.uint8)
            )


def row(kv: GpuKV, group_id: int, block: int) -> bytes:
    """All bytes of one logical block of one group, entry by entry."""
    return b"".join(
        e[block].contiguous().view(torch.uint8).cpu().numpy().tobytes()
        for e in kv.entries(group_id)
    )


def random_tables(
    p: Plan, rng: random.Random, ids: list[int], chunks: int, nulls: list[int]
) -> tuple[list[list[int]], list[list[bytes]]]:
    """Per group: ``chunks`` offload blocks of GPU ids drawn from ``ids`` (consumed), the first
    ``nulls[g]`` slots null; hashes unique per (group, position)."""
    tables, hashes = [], []
    tag = rng.getrandbits(32).to_bytes(4, "little")
    for g, n0 in zip(p.groups, nulls, strict=True):
        n = chunks * group_factor(p, g)
        t = [NULL_BLOCK if i < n0 else ids.pop() for i in range(n)]
        tables.append(t)
        hashes.append([tag + bytes([g.group_id]) + i.to_bytes(4, "little") for i in range(n)])
    return tables, hashes

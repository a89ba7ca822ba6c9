"""The NCCL bench's paged KV pools (``raykv.bench.transport_nccl``): random bytes per rank, in
fresh tensors or in memory another process of the host maps, the blocks a batch moves, and
rows gathered for the checks."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from raykv.bench.transport_nccl import NcclConfig


def pool(
    cfg: NcclConfig, device: torch.device, seed: int, into: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The paged KV's entries (K and V, or the latent, of each layer), random bytes from
    ``seed``, made on ``device`` (a preset's pool is GiBs); ``into``: one uint8 tensor per layer
    to hold them (memory a peer maps), else fresh tensors."""
    g = torch.Generator(device).manual_seed(seed)
    out = []
    for i in range(cfg.layers):
        raw = torch.randint(0, 256, layer_shape(cfg), generator=g, dtype=torch.uint8,
                            device=device)  # fmt: skip
        if into is not None:
            into[i].copy_(raw.view(-1))
            raw = into[i].view(raw.shape)
        out += raw.view(torch.bfloat16).unbind(0)
    return out


def layer_shape(cfg: NcclConfig) -> tuple[int, ...]:
    """One layer's entries as bytes: ``[kinds, blocks, block_size, heads, 2 * head_dim]``."""
    return (cfg.kinds, cfg.num_blocks, cfg.block_size, cfg.kv_heads, 2 * cfg.head_dim)


def layer_bytes(cfg: NcclConfig) -> int:
    return math.prod(layer_shape(cfg))


def shared_pool(cfg: NcclConfig, device: torch.device, seed: int):
    """(entries, handle): the holder's KV in memory a process of this host maps with
    ``GpuKV.open_handles``-style handles (a CUDA ``PeerSpec``, CPU shared-memory specs)."""
    shapes = [(layer_bytes(cfg),)] * cfg.layers
    if device.type == "cuda":
        from raykv.tiers.peer_memory import PeerExport

        export = PeerExport(shapes, device)
        return pool(cfg, device, seed, export.tensors), export
    from raykv.tiers import shm

    made = [shm.create(shape, f"bench{i}") for i, shape in enumerate(shapes)]
    return pool(cfg, device, seed, [t for t, _ in made]), [spec for _, spec in made]


def open_pool(cfg: NcclConfig, device: torch.device, handle) -> list[torch.Tensor]:
    """The holder's entries mapped here (``_shared_pool``'s handle)."""
    from raykv.tiers.peer_memory import open_tensors

    return entries_of(cfg, open_tensors(handle, device))


def entries_of(cfg: NcclConfig, raws: list[torch.Tensor]) -> list[torch.Tensor]:
    """A pool's entries over its raw uint8 tensors, one per layer."""
    return [e for raw in raws for e in raw.view(layer_shape(cfg)).view(torch.bfloat16).unbind(0)]


def block_ids(cfg: NcclConfig, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(cfg.num_blocks - 1, generator=g)[: cfg.blocks] + 1).tolist()


def rows(entries: list[torch.Tensor], ids: list[int], width: int) -> torch.Tensor:
    from raykv import ops

    dst = torch.empty((len(ids), width), dtype=torch.uint8, device=entries[0].device)
    ops.gather_blocks(entries, torch.tensor(ids), dst)
    return dst

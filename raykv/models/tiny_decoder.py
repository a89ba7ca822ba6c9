"""A tiny random-weight decoder (GQA + RoPE) whose attention reads a paged KV cache.

It exists so the demo and tests run a real prefill -> store -> load -> continue loop on CPU.
The KV cache is one tensor per layer, ``[2, num_blocks, block_size, kv_heads, head_dim]``
(K then V), addressed through a block table exactly like an engine's paged cache, so the
bytes raykv stores and loads are the bytes the attention reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from raykv.errors import InvalidInput


@dataclass(frozen=True)
class TinyConfig:
    vocab_size: int = 2048
    hidden: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn: int = 768
    rope_theta: float = 10000.0
    seed: int = 0


class _Layer(nn.Module):
    def __init__(self, c: TinyConfig) -> None:
        super().__init__()
        self.c = c
        self.attn_norm = nn.RMSNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, False)
        self.o = nn.Linear(c.num_heads * c.head_dim, c.hidden, bias=False)
        self.mlp_norm = nn.RMSNorm(c.hidden)
        self.up = nn.Linear(c.hidden, 2 * c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: torch.Tensor,
        slots: tuple[torch.Tensor, torch.Tensor],
        context: tuple[torch.Tensor, torch.Tensor],
        start: int,
    ) -> torch.Tensor:
        c, n = self.c, x.shape[0]
        q, k, v = self.qkv(self.attn_norm(x)).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
            dim=-1,
        )
        q = _rotate(q.view(n, c.num_heads, c.head_dim), *rope)
        k = _rotate(k.view(n, c.num_kv_heads, c.head_dim), *rope)
        # (kernel block, offset) pairs index the cache whatever its strides (raykv's GpuKV
        # may interleave K and V per block)
        cache[0][slots] = k
        cache[1][slots] = v.view(n, c.num_kv_heads, c.head_dim)
        keys, values = cache[0][context], cache[1][context]  # the whole context, from the cache
        # query i sits at position start + i and sees keys 0 .. start + i
        mask = torch.arange(len(context[0]))[None, :] <= (start + torch.arange(n))[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            enable_gqa=True,
        )
        x = x + self.o(out.transpose(0, 1).reshape(n, -1))
        gate, up = self.up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class TinyDecoder(nn.Module):
    """``forward(token_ids, start, kv_cache, block_table)`` runs tokens at positions
    ``start ..`` with the first ``start`` tokens' KV already in the cache."""

    def __init__(self, config: TinyConfig | None = None) -> None:
        super().__init__()
        c = self.config = config or TinyConfig()
        gen = torch.Generator().manual_seed(c.seed)
        self.embed = nn.Embedding(c.vocab_size, c.hidden)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        with torch.no_grad():  # same seed, same weights in every process
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        self.eval()

    def kv_layers(self, dtype: str = "float32") -> dict:
        """Layer name -> KV spec, for ``raykv.layout.plan``."""
        from raykv.layout import FullAttention

        c = self.config
        spec = FullAttention(dtype=dtype, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim)
        return {f"layers.{i}.attn": spec for i in range(c.num_layers)}

    def new_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        c = self.config
        shape = (2, num_blocks, block_size, c.num_kv_heads, c.head_dim)
        return [torch.zeros(shape) for _ in range(c.num_layers)]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.config.head_dim // 2
        inv = self.config.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        ang = (positions.double()[:, None] * inv[None, :]).float()[:, None, :]
        return ang.cos(), ang.sin()

    @torch.no_grad()
    def forward(
        self,
        token_ids: list[int] | torch.Tensor,
        start: int,
        kv_cache: list[torch.Tensor],
        block_table: list[int],
        block_size: int | None = None,
    ) -> torch.Tensor:
        """``block_table`` holds logical blocks of ``block_size`` tokens (default: the cache's
        kernel block size); the cache is ``[2, kernel blocks, kernel block size, h, d]``."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        kbs = kv_cache[0].shape[2]
        n, block_size = len(ids), block_size or kbs
        end = start + n
        if len(block_table) * block_size < end:
            raise InvalidInput(
                f"block table of {len(block_table)} blocks x {block_size} tokens holds "
                f"{len(block_table) * block_size} tokens, the forward needs {end}; allocate more"
            )
        if ids.numel() and (int(ids.max()) >= self.config.vocab_size or int(ids.min()) < 0):
            raise InvalidInput(f"token ids must lie in [0, {self.config.vocab_size})")
        table = torch.as_tensor(block_table, dtype=torch.long)
        pos = torch.arange(end)
        offset = pos % block_size
        kblock = table[pos // block_size] * (block_size // kbs) + offset // kbs
        context = (kblock, offset % kbs)
        slots = (kblock[start:], context[1][start:])
        rope = self._rope(pos[start:])
        x = self.embed(ids)
        for layer, cache in zip(self.layers, kv_cache, strict=True):
            x = layer(x, rope, cache, slots, context, start)
        return self.lm_head(self.norm(x))

"""Deterministic token ids and KV rows for the service tests (one seed, one answer)."""

import torch

# a two-layer float32 model, 1 KV head of dim 16, block size 16: one block's row on one rank
ROW = 2 * 2 * 16 * 1 * 16 * 4  # layers x K,V x block x heads x head_dim x 4 bytes
BLOCK = 16


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rows(n: int, seed: int, width: int = ROW) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)

"""Page-size unification for hybrid models: every shared tensor slot has one page size.

Order of the rules:
1. Mamba: its state does not grow with the block size, so the attention base block size
   ``B`` is raised in multiples of ``align`` (the hash block size, or its lcm with the
   smallest kernel block size every attention backend supports) until the largest
   attention page reaches the largest Mamba page; Mamba pages are then padded up to it.
2. Integer ratio: an attention group whose page divides the largest page ``P`` gets block
   size ``B * (P // page)``, so its page equals ``P`` exactly (if that block is no longer
   than ``max_model_len``).
3. Padding: every other group keeps ``B`` and its page is padded up to ``P``.
Within a group, the largest layer page stands for the group (smaller layers are padded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from raykv.errors import PageSizeError
from raykv.layout.specs import KVSpec, cdiv


@dataclass(frozen=True)
class Unified:
    block_sizes: tuple[int, ...]  # per group
    page_bytes: int  # P: the page of every tensor slot, one rank
    padded: tuple[bool, ...]  # per group: page padded (True) or exactly P (False)


def group_page(specs: Sequence[KVSpec], block_size: int, tp_size: int) -> int:
    """The page that stands for a group: its largest layer page."""
    return max(s.page_bytes(block_size, tp_size) for s in specs)


def mamba_base_block_size(
    attention: Sequence[Sequence[KVSpec]],
    mamba_page: int,
    *,
    block_size: int,
    align: int,
    tp_size: int,
) -> int:
    """Smallest multiple of ``align`` (>= block_size) whose attention page holds
    ``mamba_page``."""
    per_token = max(group_page(g, 1, tp_size) for g in attention)
    if per_token <= 0:
        raise PageSizeError(
            f"attention layers hold {per_token} bytes per token; cannot unify with a Mamba "
            f"page of {mamba_page} bytes; check the attention specs (heads, head_dim)"
        )
    m = max(cdiv(block_size, align), cdiv(mamba_page, per_token * align))
    while max(group_page(g, m * align, tp_size) for g in attention) < mamba_page:
        m += 1  # page_bytes may be non-linear in a custom spec: walk until it fits
    return m * align


def unify_pages(
    groups: Sequence[Sequence[KVSpec]],
    *,
    block_size: int,
    align: int,
    tp_size: int,
    max_model_len: int,
) -> Unified:
    """Block size per group and the one page ``P`` every slot gets (hybrid models)."""
    is_mamba = [g[0].kind == "mamba" for g in groups]
    attention = [g for g, m in zip(groups, is_mamba, strict=True) if not m]
    mamba_page = max(
        (group_page(g, block_size, tp_size) for g, m in zip(groups, is_mamba, strict=True) if m),
        default=0,
    )
    base = block_size
    if attention and mamba_page:
        base = mamba_base_block_size(
            attention,
            mamba_page,
            block_size=block_size,
            align=align,
            tp_size=tp_size,
        )
    pages = [group_page(g, base, tp_size) for g in groups]
    if min(pages) <= 0:
        raise PageSizeError(
            f"page sizes {pages} bytes include an empty page; every KV layer must hold bytes "
            "(check num_kv_heads / head_dim / state shapes)"
        )
    target = max(pages)
    sizes, padded = [], []
    for g, page, m in zip(groups, pages, is_mamba, strict=True):
        k = target // page
        exact = not m and target % page == 0 and base * k <= max(base, max_model_len)
        if exact and group_page(g, base * k, tp_size) == target:
            sizes.append(base * k)
            padded.append(False)
            continue
        sizes.append(base)
        padded.append(page != target)
    return Unified(tuple(sizes), target, tuple(padded))

"""``plan()``: the one place that sizes the GPU pool and the CPU tier (invariants 2, 5, 6, 11)."""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Mapping, Sequence

from raykv.errors import BlockSizeError, ConfigError, InsufficientMemoryError, PageSizeError
from raykv.layout import tp
from raykv.layout.grouping import split_groups
from raykv.layout.kernel_blocks import (
    KernelBlockSizes,
    pick_kernel_block_size,
    supported_kernel_block_sizes,
)
from raykv.layout.plan import KVGroup, Plan
from raykv.layout.specs import KVSpec
from raykv.layout.unify import unify_pages

GiB = 1 << 30


def cpu_tier_size(
    gpu_tensor_bytes: int,
    num_gpu_blocks: int,
    distinct_copies: int,
    block_size_factor: int,
    cpu_bytes: int,
) -> tuple[int, int]:
    """(cpu_num_blocks, cpu_bytes_per_block), invariant 5.

    A CPU-tier block holds every distinct TP copy of ``block_size_factor`` GPU blocks, each
    worth the REAL allocated bytes per GPU block (tensor bytes / num_gpu_blocks). No GPU
    blocks: nothing to offload, zero CPU blocks.
    """
    per_block = tp.cpu_bytes_per_block(
        gpu_tensor_bytes, num_gpu_blocks, distinct_copies, block_size_factor
    )
    return (cpu_bytes // per_block, per_block) if per_block else (0, 0)


def _shown(value: object) -> str:
    text = repr(value)
    return f"{text[:60]}..." if len(text) > 63 else text


def check_whole(value: object, name: str, *, minimum: int = 0, fix: str | None = None) -> int:
    """``value`` as a Python int >= ``minimum`` (a size in bytes, a token or block count).
    Ints and numpy integers pass; bools (an int subclass: True is no size), floats (nan, inf,
    2.5 and 2.0 alike: a size is never rounded), strings and None raise ConfigError naming
    the value, its type and ``fix`` (default: an example of a good value)."""
    n = None
    if not isinstance(value, bool) and "bool" not in str(getattr(value, "dtype", "")):
        with contextlib.suppress(TypeError):
            n = operator.index(value)  # type: ignore[arg-type]
    if n is not None and n >= minimum:
        return n
    if fix is None:
        size = name.endswith("bytes")
        fix = f"pass an int, e.g. {name}={64 << 20 if size else max(minimum, 16)}"
        fix += " (64 MiB)" if size else ""
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
    raise ConfigError(f"{name} must be {what}, got {_shown(value)} ({type(value).__name__}); {fix}")


def _positive(**values: object) -> list[int]:
    return [check_whole(v, name, minimum=1) for name, v in values.items()]


def _fmt(n: int) -> str:
    return f"{n} bytes ({n / GiB:.2f} GiB)"


def _raise_align(
    layers: Mapping[str, KVSpec], kernel_block_sizes: KernelBlockSizes, hash_bs: int
) -> int:
    """Step for raising a block size: the hash block size, lcm'd with the smallest kernel
    block size every attention backend supports (so the raised size still splits)."""
    per_layer = supported_kernel_block_sizes(layers, kernel_block_sizes)
    if not per_layer:
        return hash_bs
    common = {s for s in set(per_layer[0]).intersection(*per_layer[1:]) if s > 0}
    return math.lcm(hash_bs, min(common)) if common else hash_bs


def max_len_that_fits(
    groups: Sequence[KVGroup], usable: int, upper: int, max_num_batched_tokens: int
) -> int:
    """Longest request (<= upper) whose admission blocks fit ``usable`` blocks; 0 if none.
    Admission blocks grow with the length, so a binary search finds it."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(g.max_blocks(mid, max_num_batched_tokens) for g in groups) <= usable:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan(
    layers: Mapping[str, KVSpec],
    *,
    gpu_bytes: int | None = None,
    max_model_len: int,
    max_num_batched_tokens: int,
    tp_size: int = 1,
    cpu_bytes: int = 0,
    offload_block_size: int | None = None,
    kernel_block_sizes: KernelBlockSizes = None,
    block_size: int = 16,
    hash_block_size: int | None = None,
    num_gpu_blocks: int | None = None,
    max_padding_waste: float = 0.5,
) -> Plan:
    """Group, unify and size a model's KV layers for one TP rank.

    ``gpu_bytes`` is the KV memory of one GPU; ``num_gpu_blocks`` instead fixes the block
    count (null block included), e.g. when an engine already chose it. ``block_size`` is the
    base block size; ``hash_block_size`` (default ``block_size``) must divide every group
    block size. Raises ConfigError subclasses naming the numbers and the fix (invariant 11).
    """
    hash_bs = block_size if hash_block_size is None else hash_block_size
    block_size, hash_bs, max_model_len, max_num_batched_tokens, tp_size = _positive(
        block_size=block_size,
        hash_block_size=hash_bs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        tp_size=tp_size,
    )
    if block_size % hash_bs:
        raise BlockSizeError(
            f"block size {block_size} is not a multiple of the hash block size {hash_bs}; "
            f"align them: use a block size that is a multiple of {hash_bs} (e.g. "
            f"{(block_size // hash_bs + 1) * hash_bs}) or a hash block size that divides "
            f"{block_size}"
        )
    if (gpu_bytes is None) == (num_gpu_blocks is None):
        raise ConfigError("pass exactly one of gpu_bytes (KV bytes per GPU) or num_gpu_blocks")
    if gpu_bytes is not None:
        gpu_bytes = check_whole(gpu_bytes, "gpu_bytes")
    if num_gpu_blocks is not None:
        num_gpu_blocks = check_whole(num_gpu_blocks, "num_gpu_blocks")
    cpu_bytes = check_whole(cpu_bytes, "cpu_bytes")

    layers = dict(layers)
    for spec in layers.values():
        spec.page_bytes(block_size, tp_size)  # TP splits are checked here, early

    # Grouping, then page-size unification (hybrid only).
    names, num_tensors = split_groups(layers)
    specs = [[layers[n] for n in g] for g in names]
    if len(names) == 1:
        sizes = (block_size,)
        pages = tuple(s.page_bytes(block_size, tp_size) for s in specs[0])
        tensor_pages = pages
        waste = 0.0
    else:
        unified = unify_pages(
            specs,
            block_size=block_size,
            align=_raise_align(layers, kernel_block_sizes, hash_bs),
            tp_size=tp_size,
            max_model_len=max_model_len,
        )
        sizes = unified.block_sizes
        tensor_pages = (unified.page_bytes,) * num_tensors
        used = sum(s.page_bytes(bs, tp_size) for g, bs in zip(specs, sizes, strict=True) for s in g)
        allocated = len(names) * num_tensors * unified.page_bytes
        waste = 1 - used / allocated
        page_waste = 1 - used / sum(len(g) * unified.page_bytes for g in specs)
        if page_waste > max_padding_waste:
            raw = sorted({s.page_bytes(block_size, tp_size) for g in specs for s in g})
            raise PageSizeError(
                f"page sizes {raw} bytes (block size {block_size}, tp {tp_size}) unify only "
                f"by padding to {unified.page_bytes} bytes, wasting {page_waste:.0%} of KV "
                f"memory (limit {max_padding_waste:.0%}); fix: pick a block size whose pages "
                "are integer multiples of each other, or raise max_padding_waste"
            )
    for bs in sizes:
        if bs % hash_bs:  # unification only raises in multiples of the hash block size
            raise BlockSizeError(
                f"group block size {bs} is not a multiple of the hash block size {hash_bs}; "
                f"align them"
            )
    gpu_bytes_per_block = sum(tensor_pages)
    if gpu_bytes_per_block <= 0:
        raise PageSizeError(f"layers hold no KV bytes per block (pages {tensor_pages})")

    groups = tuple(
        KVGroup(
            group_id=i,
            spec=g[0],
            layer_names=n,
            block_size=bs,
            kernel_block_size=pick_kernel_block_size(n, layers, bs, kernel_block_sizes),
            layer_page_bytes=tuple(s.page_bytes(bs, tp_size) for s in g),
        )
        for i, (n, g, bs) in enumerate(zip(names, specs, sizes, strict=True))
    )

    # Sizing (invariant 6: the block count comes from here, never from tensor shapes).
    if num_gpu_blocks is None:
        assert gpu_bytes is not None
        num_gpu_blocks = gpu_bytes // gpu_bytes_per_block
        available = gpu_bytes
    else:
        available = num_gpu_blocks * gpu_bytes_per_block
    usable = max(num_gpu_blocks - 1, 0)
    # Invariant 2: the admission gate's formula (in-flight chunk included), over one shared
    # pool: an accepted plan runs any admitted request alone to its end.
    need = sum(g.max_blocks(max_model_len, max_num_batched_tokens) for g in groups)
    if need > usable:
        need_bytes = (need + 1) * gpu_bytes_per_block
        fits = max_len_that_fits(groups, usable, max_model_len, max_num_batched_tokens)
        shorter = f"lower max_model_len to {fits} or less, " if fits else ""
        raise InsufficientMemoryError(
            f"one request of max_model_len={max_model_len} tokens needs {need} blocks "
            f"(+1 null) = {_fmt(need_bytes)} per GPU at tp_size={tp_size}, but only "
            f"{_fmt(available)} is available ({usable} usable blocks of "
            f"{gpu_bytes_per_block} bytes); fix: give the KV cache more GPU memory, "
            f"{shorter}or raise tp_size",
            need_bytes=need_bytes,
            fits_len=fits or 0,
        )

    # CPU tier (invariant 5).
    base = min(sizes)
    offload = base if offload_block_size is None else offload_block_size
    (offload,) = _positive(offload_block_size=offload)
    if offload % base:
        raise BlockSizeError(
            f"offload block size {offload} is not a multiple of the block size {base}; "
            f"use a multiple of {base} (e.g. {base * max(offload // base, 1)})"
        )
    factor = offload // base
    copies = tp.model_copies(layers.values(), tp_size)
    cpu_num_blocks, cpu_bytes_per_block = cpu_tier_size(
        num_gpu_blocks * gpu_bytes_per_block, num_gpu_blocks, copies, factor, cpu_bytes
    )
    return Plan(
        groups=groups,
        num_gpu_blocks=num_gpu_blocks,
        hash_block_size=hash_bs,
        gpu_bytes_per_block=gpu_bytes_per_block,
        tp_size=tp_size,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        offload_block_size=offload,
        block_size_factor=factor,
        cpu_num_blocks=cpu_num_blocks,
        cpu_bytes_per_block=cpu_bytes_per_block,
        layer_specs=layers,  # a plain dict: a Plan crosses Ray actors (pickled)
        num_tensors=num_tensors,
        padding_waste=waste,
        tensor_page_bytes=tensor_pages,
        distinct_copies=copies,
    )

"""Plans built straight from the layout dataclasses, so block tests need no sizing."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from raykv.blocks import BlockManager
from raykv.layout import KVGroup, KVSpec, Plan


def make_plan(
    group_specs: Sequence[KVSpec],
    num_gpu_blocks: int,
    block_size: int,
    *,
    group_block_sizes: Sequence[int] | None = None,
    kernel_block_sizes: Sequence[int] | None = None,
    hash_block_size: int | None = None,
    max_model_len: int = 1 << 20,
    max_num_batched_tokens: int = 8192,
) -> Plan:
    """One group per spec; every group has ``block_size`` unless ``group_block_sizes``."""
    sizes = list(group_block_sizes or [block_size] * len(group_specs))
    kernels = list(kernel_block_sizes or sizes)
    groups = tuple(
        KVGroup(
            group_id=i,
            spec=spec,
            layer_names=(f"layer{i}",),
            block_size=bs,
            kernel_block_size=kbs,
            layer_page_bytes=(1024,),
        )
        for i, (spec, bs, kbs) in enumerate(zip(group_specs, sizes, kernels, strict=True))
    )
    return Plan(
        groups=groups,
        num_gpu_blocks=num_gpu_blocks,
        hash_block_size=hash_block_size or min(sizes),
        gpu_bytes_per_block=1024 * len(groups),
        tp_size=1,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        offload_block_size=min(sizes),
        block_size_factor=1,
        cpu_num_blocks=0,
        cpu_bytes_per_block=0,
        layer_specs={f"layer{i}": g.spec for i, g in enumerate(groups)},
    )


def held_blocks(mgr: BlockManager) -> dict[int, int]:
    """Block id -> how many table slots of live requests hold it (null excluded)."""
    held: dict[int, int] = {}
    for rid in mgr.request_ids:
        for table in mgr.block_table(rid):
            for b in table:
                if b:
                    held[b] = held.get(b, 0) + 1
    return held


def check_pool(mgr: BlockManager, uncached: Collection[int] = ()) -> None:
    """The pool-wide invariants: null block, ref counts, free + used == total. ``uncached``:
    blocks taken out of the prefix map on purpose (``BlockPool.uncache``), shared or not."""
    pool = mgr.pool
    free = pool.free_block_ids()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    assert 0 not in free, "null block in the free queue"
    assert pool.ref_counts[0] == 0 and not pool.is_cached(0), "null block ref-counted/cached"
    assert 0 not in pool.cached.values()
    held = held_blocks(mgr)
    assert not set(held) & set(free), "a held block is free"
    assert len(held) + len(free) == pool.num_usable_blocks, "free + used != total"
    for b in range(1, pool.num_blocks):
        assert pool.ref_counts[b] == held.get(b, 0), f"block {b} ref count"
        if held.get(b, 0) > 1 and b not in uncached:
            assert pool.is_cached(b), f"block {b} shared but not a cached prefix block"
    for key, b in pool.cached.items():
        assert pool.block_keys[b] == key


def examples(ci: int, long: int) -> int:
    """Hypothesis examples for one property: ``ci`` in CI, ``long`` under
    ``--hypothesis-profile=long`` (tests/conftest.py)."""
    from hypothesis import settings

    return long if settings.get_current_profile_name() == "long" else ci

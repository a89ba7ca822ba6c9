"""Hybrid grouping: layers with the same spec type share a block table.

A uniform-type model is one group. A hybrid model is cut into groups of equal layer count
``s`` so that tensor ``t`` can be shared by layer ``t`` of every group (see plan.py). ``s``
is chosen in ``[min count, max count]`` (the smallest type stays in one group) to leave the
fewest empty tensor slots; ties go to the larger ``s`` (fewer block tables per request).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from raykv.errors import ConfigError
from raykv.layout.specs import KVSpec, cdiv


def group_by_type(layers: Mapping[str, KVSpec]) -> list[tuple[str, ...]]:
    """Layer names per spec type key, in order of first appearance."""
    if not layers:
        raise ConfigError("a plan needs at least one KV layer; got an empty layer mapping")
    by_key: dict[tuple, list[str]] = {}
    for name, spec in layers.items():
        by_key.setdefault(spec.type_key(), []).append(name)
    return [tuple(names) for names in by_key.values()]


def empty_slots(counts: Sequence[int], group_size: int) -> int:
    """Tensor slots no layer uses when every type is cut into groups of ``group_size``."""
    return sum(cdiv(n, group_size) * group_size - n for n in counts)


def choose_group_size(counts: Sequence[int]) -> int:
    """Layers per group (= tensors) for a hybrid model with these per-type layer counts."""
    lo, hi = min(counts), max(counts)
    return min(range(lo, hi + 1), key=lambda s: (empty_slots(counts, s), -s))


def split_groups(layers: Mapping[str, KVSpec]) -> tuple[list[tuple[str, ...]], int]:
    """(layer names per group, number of shared tensors)."""
    types = group_by_type(layers)
    if len(types) == 1:
        return types, len(types[0])  # one tensor per layer, no sharing
    s = choose_group_size([len(t) for t in types])
    groups = [names[i : i + s] for names in types for i in range(0, len(names), s)]
    return groups, s

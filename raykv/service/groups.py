"""What pools, tiers, the coordinator and the client agree on for any plan the layout makes
(one group or hybrid, any tp_size, any offload block size). Pure functions.

* Keys: block ``j`` of group ``g`` is named by ``raykv.tiers.group_block_hashes``: the group
  id (4 bytes, little endian) + the chained hash at the end of the block. Groups never share
  a key, and the index, the pools and the tiers all use these keys.
* Chunks: a CPU-tier entry holds ``f = group_factor(plan, g)`` consecutive GPU blocks of one
  group and is keyed by its last block's key. Only complete chunks exist (a partial one is a
  miss, never a wrong hit); a chunk's null slots (out of a sliding window) carry nothing.
* Hits: a prefix of ``L`` tokens is served when every group holds the slots it needs for
  ``L`` (``GroupManager.longest_hit``: a sliding window needs only its last window), the
  same rule as ``BlockManager.cached_prefix``.
* TP copies: ``raykv.layout.tp`` (which rank holds and which writes each copy; invariant 5).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat

from raykv.api import check_block_ids
from raykv.blocks.managers import GroupManager, manager_for
from raykv.blocks.pool import NULL_BLOCK
from raykv.errors import ConfigError, InvalidInput
from raykv.layout.plan import Plan

# raykv.tiers (torch) is imported where it is used: the coordinator looks prefixes up
# without torch.
Tables = list[list[int]]


def group_keys(plan: Plan, hashes: Sequence[bytes] | bytes) -> list[list[bytes]]:
    """Per group, the key of each full block (from a request's chained hashes, or the
    hashes joined)."""
    from raykv.tiers.jobs import group_block_hashes

    return group_block_hashes(plan, hashes)


def key_group(key: bytes) -> int:
    """The group id a key belongs to."""
    return int.from_bytes(key[:4], "little")


def row_widths(plan: Plan) -> tuple[int, ...]:
    """Per group (plan order): bytes of one block's row on one rank (the tensors it uses)."""
    from raykv.tiers.gpu_kv import tensor_pages

    pages = tensor_pages(plan)
    return tuple(sum(pages[: len(g.layer_names)]) for g in plan.groups)


def factors(plan: Plan) -> tuple[int, ...]:
    """Per group: GPU blocks per CPU-tier entry (ConfigError if they do not line up)."""
    from raykv.tiers.jobs import group_factor

    return tuple(group_factor(plan, g) for g in plan.groups)


def check_servable(plan: Plan) -> None:
    """The service caches prefixes: every group must be a function of the token prefix."""
    bad = [f"group {g.group_id} ({g.spec.kind})" for g in plan.groups if not g.spec.cacheable]
    if bad:
        raise ConfigError(
            f"{', '.join(bad)} hold state that is not a function of the token prefix (Mamba "
            "state, encoder KV), so no prefix of this model can be shared; the service serves "
            "attention-only models (full, sliding window, chunked local, MLA), use raykv.blocks "
            "and raykv.tiers in-process for the others"
        )
    factors(plan)


def as_tables(plan: Plan, block_ids: Sequence) -> Tables:
    """A caller's block ids per group (checked by ``check_block_ids``, then ``per_group``)."""
    return per_group(plan, check_block_ids(block_ids))


def per_group(plan: Plan, ids: list) -> Tables:
    """Block ids as ``check_block_ids`` returns them (the client checked them), per group:
    a one-group model also takes one flat list, any other one list per group."""
    n = len(plan.groups)
    if not any(map(isinstance, ids, repeat(list))):  # in C: a prompt's ids, no step each
        if n != 1:
            raise InvalidInput(
                f"the model has {n} KV groups: pass block ids per group (a list of {n} "
                "lists, as allocate returns them), not one flat list"
            )
        return [ids]
    if len(ids) != n:
        raise InvalidInput(f"expected block ids for {n} KV group(s), got {len(ids)} lists")
    return ids


@dataclass(frozen=True)
class Chunk:
    """One CPU-tier entry: ``members[s]`` is the key of the GPU block at sub-slot ``s``
    (None where the request's table held the null block)."""

    group: int  # index into plan.groups
    key: bytes  # the last member's key
    members: tuple[bytes | None, ...]


def complete_chunks(plan: Plan, tables: Tables, keys: list[list[bytes]]) -> list[Chunk]:
    """Every complete chunk of a request's tables with at least one real block."""
    out = []
    for gi, (f, table, gkeys) in enumerate(zip(factors(plan), tables, keys, strict=True)):
        if f == 1:  # one block per entry
            pairs = zip(table, gkeys, strict=False)  # as far as both go
            out += [Chunk(gi, k, (k,)) for b, k in pairs if b != NULL_BLOCK]
            continue
        for c in range(min(len(table), len(gkeys)) // f):
            slots = range(c * f, (c + 1) * f)
            if all(table[j] == NULL_BLOCK for j in slots):
                continue
            members = tuple(gkeys[j] if table[j] != NULL_BLOCK else None for j in slots)
            out.append(Chunk(gi, gkeys[(c + 1) * f - 1], members))
    return out


def managers(plan: Plan) -> tuple[GroupManager, ...]:
    return tuple(manager_for(g) for g in plan.groups)


def common_hit(mgrs: Sequence[GroupManager], has: Callable[[int, int], bool], limit: int) -> int:
    """Longest prefix (<= ``limit`` tokens) every group serves; ``has(group index, slot)``
    says whether that slot's block is available. Each group answers the longest hit <= the
    candidate; the candidate only shrinks, so it ends at a length all groups accept."""
    lookups = [(lambda j, gi=gi: 1 if has(gi, j) else None) for gi in range(len(mgrs))]
    length = max(limit, 0)
    while True:
        before = length
        for m, lookup in zip(mgrs, lookups, strict=True):
            length = m.longest_hit(lookup, length)
        if length == before or length == 0:
            return length


def key_limit(plan: Plan, keys: list[list[bytes]]) -> int:
    """Tokens every group has keys for (so a hit never looks past a group's keys)."""
    return min(len(k) * g.block_size for k, g in zip(keys, plan.groups, strict=True))


def primary_group(plan: Plan) -> int:
    """The group whose runs describe a hit: the first that keeps every slot (full
    attention, MLA), else the first."""
    for gi, g in enumerate(plan.groups):
        if g.spec.kind in ("full", "mla"):
            return gi
    return 0


def needed_slots(mgr: GroupManager, num_tokens: int) -> range:
    """Slots of one group a prefix of ``num_tokens`` tokens needs."""
    return range(mgr.num_skipped(num_tokens), num_tokens // mgr.block_size)

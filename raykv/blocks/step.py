"""One scheduler step of one request: planned by a pure function, applied verbatim.

``plan_step`` reads the request's tables and the pool and returns a frozen ``StepPlan``;
it changes nothing (it only memoizes block hashes, a pure function of the tokens).
``BlockManager.blocks_needed`` returns the plan's count and ``BlockManager.allocate``
applies that same plan with ``apply_step``, so the prediction and the allocation cannot
drift apart (invariant 1). No admission cap appears here: caps belong to the gate.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from raykv.blocks.hashing import BlockHash, BlockHasher, Tenant
from raykv.blocks.managers import GroupManager, Lookup
from raykv.blocks.pool import NULL_BLOCK, BlockPool


@dataclass(eq=False)
class RequestBlocks:
    """What the manager tracks per request (mutable; only ``apply_step`` writes it)."""

    request_id: Hashable
    tables: list[list[int]]  # per group: logical block ids, NULL_BLOCK for skipped slots
    num_skipped: list[int]  # per group: leading slots that hold the null block
    num_hashed: list[int]  # per group: leading slots already offered to the prefix cache
    tenant: Tenant = None  # ``tenant_key``: enters the first block's hash
    num_tokens: int = 0  # positions 0 .. num_tokens - 1 have slots
    num_cached_tokens: int = 0  # prefix-hit tokens of the first step
    hashes: list[BlockHash] = field(default_factory=list)  # chained, per full hash block
    hash_due: int = 0  # known tokens at which the next block of some group fills
    num_prompt_tokens: int = 0  # tokens the request was admitted with

    def ensure_hashes(self, hasher: BlockHasher, token_ids: Sequence[int], upto: int) -> None:
        """Memoize the chained hashes of the hash blocks that end at or before ``upto``."""
        n = min(upto, len(token_ids)) // hasher.hash_block_size
        if n > len(self.hashes):
            self.hashes += hasher.hash_blocks(
                token_ids,
                first_block=len(self.hashes),
                end_block=n,
                parent=self.hashes[-1] if self.hashes else None,
                tenant=self.tenant,
            )


@dataclass(frozen=True)
class GroupStep:
    release: tuple[int, ...]  # blocks of slots num_skipped .. skip_to - 1, now out of reach
    skip_to: int  # leading slots that hold the null block after the step
    new_nulls: int  # null slots appended (slots before a hit's window)
    hits: tuple[int, ...]  # cached blocks appended (first step only)
    num_fresh: int  # blocks appended from the free queue


@dataclass(frozen=True)
class StepPlan:
    groups: tuple[GroupStep | None, ...]  # None: the group's table does not change
    num_tokens: int  # positions with slots after the step
    num_hit_tokens: int  # tokens the prefix hits cover (first step only)
    num_taken: int  # blocks leaving the free queue: fresh ones + revived free cached hits
    num_returned: int  # released blocks whose last reference this step drops

    def fits(self, num_free_blocks: int) -> bool:
        return self.num_taken <= num_free_blocks + self.num_returned


def common_hit(
    managers: Sequence[GroupManager],
    pool: BlockPool,
    hashes: Sequence[BlockHash],
    hash_block_size: int,
    limit: int,
) -> tuple[int, list[Lookup]]:
    """Longest prefix every group can serve from the cache, and each group's (memoized)
    slot -> cached block lookup.

    Each group answers the longest hit <= the current candidate; the candidate only
    shrinks, so repeating until no group lowers it ends at a length all groups accept.
    """

    find = pool.lookup if pool.has_copies else pool.cached.get

    def lookup_for(m: GroupManager) -> Lookup:
        k = m.block_size // hash_block_size
        gid = m.group_id
        memo: dict[int, int | None] = {}

        def lookup(j: int) -> int | None:
            if j not in memo:
                memo[j] = find((gid, hashes[(j + 1) * k - 1]))
            return memo[j]

        return lookup

    lookups = [lookup_for(m) for m in managers]
    length = min(limit, len(hashes) * hash_block_size)
    while True:
        before = length
        for m, lookup in zip(managers, lookups, strict=True):
            length = m.longest_hit(lookup, length)
        if length == before or length == 0:
            return length, lookups


def first_step_hits(
    managers: Sequence[GroupManager], lookups: Sequence[Lookup], hit: int
) -> list[tuple[int, tuple[int, ...]]]:
    """Per group, what a first step with a ``hit``-token prefix hit appends before its
    fresh blocks: (null slots, cached blocks). The step and the admission gate both read
    it, so the gate credits exactly the hits the step reuses (invariant 1)."""
    out = []
    for m, lookup in zip(managers, lookups, strict=True):
        start = m.num_skipped(hit)
        out.append((start, tuple(lookup(j) for j in range(start, hit // m.block_size))))
    return out


def plan_step(
    req: RequestBlocks,
    num_new_tokens: int,
    token_ids: Sequence[int] | None,
    managers: Sequence[GroupManager],
    pool: BlockPool,
    hasher: BlockHasher | None,
) -> StepPlan:
    """Plan positions ``req.num_tokens .. req.num_tokens + num_new_tokens - 1``.

    ``hasher`` is None when prefix caching is off. Tokens before ``req.num_tokens`` count as
    computed; on the first step the prefix hit counts as computed. Prefix hits are looked
    for on the first step only, capped at ``num_new_tokens`` and at ``len(token_ids) - 1``
    (at least one token is always computed).
    """
    total = req.num_tokens + num_new_tokens
    first = req.num_tokens == 0
    hit = 0
    lookups: list[Lookup] = []
    if hasher is not None and token_ids is not None:
        req.ensure_hashes(hasher, token_ids, total)
        if first and num_new_tokens > 0:
            limit = min(num_new_tokens, len(token_ids) - 1)
            hit, lookups = common_hit(managers, pool, req.hashes, hasher.hash_block_size, limit)
    computed = hit if first else req.num_tokens
    hit_slots = first_step_hits(managers, lookups, hit) if hit else None
    rc = pool.ref_counts
    steps: list[GroupStep | None] = []
    taken = returned = 0
    for i, m in enumerate(managers):
        table = req.tables[i]
        have = len(table)
        target = m.num_slots(total)
        skipped = req.num_skipped[i]
        skip_to = min(m.num_skipped(computed), target)
        if target <= have and skip_to <= skipped:
            steps.append(None)  # the usual decode step: this group has nothing to do
            continue
        target = max(target, have)
        skip_to = max(skip_to, skipped)
        release = tuple(b for b in table[skipped : min(skip_to, have)] if b)
        returned += sum(1 for b in release if rc[b] == 1)
        new_nulls = max(0, skip_to - have)
        hits: tuple[int, ...] = ()
        if hit_slots is not None:
            new_nulls, hits = hit_slots[i]  # the first step: new_nulls == num_skipped(hit)
            taken += sum(1 for b in hits if rc[b] == 0)
        fresh = target - have - new_nulls - len(hits)
        taken += fresh
        steps.append(GroupStep(release, skip_to, new_nulls, hits, fresh))
    return StepPlan(tuple(steps), total, hit, taken, returned)


def release_skipped(req: RequestBlocks, plan: StepPlan, pool: BlockPool) -> None:
    """Return the blocks that left the request's reach: their slots become null.

    Keeps invariant 8's release rules: this runs whether or not the step fits, so a step
    that does not fit still frees the blocks no future token reads, and changes nothing
    else; and blocks go back tail-first, so of the blocks leaving together the prefix's
    head is evicted last (as ``BlockManager.free`` does)."""
    for i, s in enumerate(plan.groups):
        if s is not None and s.release:
            table = req.tables[i]
            for j in range(req.num_skipped[i], min(s.skip_to, len(table))):
                table[j] = NULL_BLOCK
            req.num_skipped[i] = max(req.num_skipped[i], min(s.skip_to, len(table)))
            pool.release(reversed(s.release))


def apply_step(
    req: RequestBlocks,
    plan: StepPlan,
    token_ids: Sequence[int] | None,
    managers: Sequence[GroupManager],
    pool: BlockPool,
    hasher: BlockHasher | None,
) -> list[list[int]]:
    """Apply ``plan`` exactly; the caller has checked ``plan.fits``. Returns the slots
    appended per group (nulls, hits, then fresh blocks)."""
    release_skipped(req, plan, pool)
    # Invariant 8: every group's hits are referenced before any block is allocated, so
    # no allocation can evict a block this step reuses.
    for s in plan.groups:
        if s is not None and s.hits:
            pool.touch(s.hits)
    appended: list[list[int]] = []
    for i, s in enumerate(plan.groups):
        if s is None:
            appended.append([])
            continue
        new = [NULL_BLOCK] * s.new_nulls
        new += s.hits
        if s.num_fresh:
            new += pool.allocate(s.num_fresh)
        req.tables[i] += new
        req.num_skipped[i] = s.skip_to
        if plan.num_hit_tokens:
            req.num_hashed[i] = s.new_nulls + len(s.hits)
            req.hash_due = 0
        appended.append(new)
    req.num_tokens = plan.num_tokens
    if plan.num_hit_tokens:
        req.num_cached_tokens = plan.num_hit_tokens
    if hasher is not None:
        cache_full_blocks(req, managers, pool, hasher)
    return appended


def cache_full_blocks(
    req: RequestBlocks, managers: Sequence[GroupManager], pool: BlockPool, hasher: BlockHasher
) -> None:
    """Offer every block whose tokens are all known and allocated to the prefix cache."""
    hbs = hasher.hash_block_size
    known = min(req.num_tokens, len(req.hashes) * hbs)
    if known < req.hash_due:
        return  # the usual decode step: no block filled up
    due = []
    for i, m in enumerate(managers):
        if not m.cacheable:
            continue
        bs = m.block_size
        start, end = req.num_hashed[i], min(known // bs, len(req.tables[i]))
        if end <= start:
            due.append((start + 1) * bs)
            continue
        k = bs // hbs
        table = req.tables[i]
        pool.cache(
            m.group_id,
            [req.hashes[(j + 1) * k - 1] for j in range(start, end)],
            table[start:end],
            req.hashes[start * k - 1] if start else None,
            bs,
        )
        req.num_hashed[i] = end
        due.append((end + 1) * bs)
    req.hash_due = min(due, default=0)

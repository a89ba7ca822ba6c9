"""BlockManager: admission, per-step allocation and prefix caching for one GPU's pool.

Every group of the plan draws from ONE shared pool of ``plan.num_gpu_blocks`` blocks
(block 0 is the null block). A request is admitted once (the admission gate, with the
plan's admission formula, invariant 2), then each scheduler step asks for slots:

    mgr.admit("r1", len(prompt))                   # False: not now, True: registered
    mgr.allocate("r1", len(prompt), prompt)        # new block ids per group, or None
    mgr.allocate("r1", 1, prompt + [next_token])   # one decode step
    mgr.free("r1")

``blocks_needed`` and ``allocate`` run the same step planner (``raykv.blocks.step``):
the prediction is the allocation (invariant 1). Block ids are logical everywhere;
``kernel_block_table`` is the only place kernel ids appear (invariant 7).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from raykv.blocks.events import KVEvent
from raykv.blocks.hashing import DEFAULT_HASH_SEED, BlockHash, BlockHasher, Tenant
from raykv.blocks.managers import GroupManager, manager_for
from raykv.blocks.pool import BlockPool
from raykv.blocks.step import (
    RequestBlocks,
    StepPlan,
    apply_step,
    common_hit,
    first_step_hits,
    plan_step,
    release_skipped,
)
from raykv.errors import BlockSizeError, InvalidInput, RequestTooLarge, UnknownRequest
from raykv.layout import KernelBlockIds, Plan, kernel_block_ids, require_logical
from raykv.layout.sizing import max_len_that_fits

RequestId = Hashable


def check_plan(plan: Plan) -> None:
    """Block sizes must line up with the hash and kernel block sizes (invariant 11). Plans
    from ``raykv.layout.plan`` already do; hand-built ones are checked here."""
    hbs = plan.hash_block_size
    if hbs < 1:
        raise BlockSizeError(f"hash_block_size must be >= 1 token, got {hbs}")
    for g in plan.groups:
        if g.block_size < 1 or g.block_size % hbs:
            raise BlockSizeError(
                f"group {g.group_id} ({g.spec.kind}) has block size {g.block_size}, which is "
                f"not a multiple of the hash block size {hbs}; align them: use a block size "
                f"that is a multiple of {hbs}, or a hash block size that divides {g.block_size}"
            )
        if g.kernel_block_size < 1 or g.block_size % g.kernel_block_size:
            raise BlockSizeError(
                f"group {g.group_id} ({g.spec.kind}) has block size {g.block_size}, which is "
                f"not a multiple of its kernel block size {g.kernel_block_size}; pick a kernel "
                f"block size that divides {g.block_size}"
            )
    if plan.num_gpu_blocks < 1:
        raise InvalidInput(f"plan has {plan.num_gpu_blocks} GPU blocks; it needs >= 1")


class BlockManager:
    def __init__(
        self,
        plan: Plan,
        enable_prefix_caching: bool = True,
        *,
        hash_seed: int | str | bytes = DEFAULT_HASH_SEED,
    ):
        check_plan(plan)
        self.plan = plan
        self.managers: tuple[GroupManager, ...] = tuple(manager_for(g) for g in plan.groups)
        self._group_index = {g.group_id: i for i, g in enumerate(plan.groups)}
        # A group whose content is not a function of the token prefix (Mamba state, encoder
        # KV) makes every hit impossible: then nothing is hashed or cached at all.
        self.enable_prefix_caching = enable_prefix_caching and all(
            m.cacheable for m in self.managers
        )
        self.pool = BlockPool(plan.num_gpu_blocks, enable_caching=self.enable_prefix_caching)
        self.hasher = (
            BlockHasher(plan.hash_block_size, hash_seed) if self.enable_prefix_caching else None
        )
        self._requests: dict[RequestId, RequestBlocks] = {}

    # --- admission gate -----------------------------------------------------------------

    def admission_blocks(self, num_tokens: int) -> int:
        """Blocks the gate reserves for a request of ``num_tokens`` on an empty pool (the
        plan's formula, invariant 2)."""
        return sum(self.plan.admission_blocks(num_tokens))

    def _admission_need(
        self, req: RequestBlocks, num_tokens: int, token_ids: Sequence[int] | None
    ) -> int:
        """The gate's count (invariant 1): per group, the plan's admission blocks less the
        slots the first step's prefix hit covers (those take nothing new: a null slot or a
        block in use), plus the free cached hit blocks the step revives. Prefix hits that
        running requests hold are thus credited, never counted. The hits are the ones the
        first step over ``token_ids`` reuses (``first_step_hits``), looked up on hashes
        memoized here, so the prompt is hashed once."""
        per_group = self.plan.admission_blocks(num_tokens)
        hasher = self.hasher
        if hasher is None or token_ids is None or num_tokens < 2 or not self.pool.cached:
            return sum(per_group)
        req.ensure_hashes(hasher, token_ids, num_tokens)
        limit = min(num_tokens, len(token_ids)) - 1
        hit, lookups = common_hit(
            self.managers, self.pool, req.hashes, hasher.hash_block_size, limit
        )
        if not hit:
            return sum(per_group)
        rc = self.pool.ref_counts
        need = 0
        for n, (nulls, hits) in zip(
            per_group, first_step_hits(self.managers, lookups, hit), strict=True
        ):
            need += max(0, n - nulls - len(hits)) + sum(1 for b in hits if not rc[b])
        return need

    def admit(
        self,
        request_id: RequestId,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        *,
        tenant: Tenant = None,
    ) -> bool:
        """Register a request of ``num_tokens`` tokens if the blocks it needs are free now.

        Raises InvalidInput past ``max_model_len`` and RequestTooLarge when even an empty
        pool could never hold it (invariant 2). Returns False, registering nothing, when it
        only does not fit yet. The gate gives credit for prefix hits that running requests
        hold (``_admission_need``): it never refuses a request whose real need fits.
        ``token_ids`` (optional, the prompt) are hashed here, once, for the gate and the
        first step, under ``tenant`` (``tenant_key``: its blocks are that tenant's only).
        """
        if request_id in self._requests:
            raise InvalidInput(f"request {request_id!r} is already admitted; free it first")
        plan = self.plan
        if not 0 <= num_tokens <= plan.max_model_len:
            raise InvalidInput(
                f"request {request_id!r} has {num_tokens} tokens; it must have between 0 and "
                f"max_model_len={plan.max_model_len}"
            )
        full = self.admission_blocks(num_tokens)
        if full > self.pool.num_usable_blocks:
            raise RequestTooLarge(self._too_large_message(request_id, num_tokens, full))
        req = RequestBlocks(
            request_id,
            tables=[[] for _ in self.managers],
            num_skipped=[0] * len(self.managers),
            num_hashed=[0] * len(self.managers),
            tenant=tenant,
            num_prompt_tokens=num_tokens,
        )
        free = self.pool.num_free_blocks
        if full > free and self._admission_need(req, num_tokens, token_ids) > free:
            return False
        if self.hasher is not None and token_ids is not None:
            req.ensure_hashes(self.hasher, token_ids, num_tokens)
        self._requests[request_id] = req
        return True

    def _too_large_message(self, request_id: RequestId, num_tokens: int, need: int) -> str:
        usable = self.pool.num_usable_blocks
        per_group = ", ".join(
            f"group {g.group_id} ({g.spec.kind}, block size {g.block_size}): {n}"
            for g, n in zip(self.plan.groups, self.plan.admission_blocks(num_tokens), strict=True)
        )
        lo = max_len_that_fits(
            self.plan.groups, usable, num_tokens, self.plan.max_num_batched_tokens
        )
        return (
            f"request {request_id!r} of {num_tokens} tokens needs {need} blocks ({per_group}) "
            f"but the pool has only {usable} usable blocks ({self.plan.num_gpu_blocks} minus "
            f"the null block), so it can never run; requests of at most {lo} tokens fit. Fix: "
            f"give the pool more GPU memory (or more TP ranks), or lower max_model_len to {lo}"
        )

    # --- per-step allocation ------------------------------------------------------------

    def _request(self, request_id: RequestId) -> RequestBlocks:
        try:
            return self._requests[request_id]
        except KeyError:
            raise UnknownRequest(
                f"request {request_id!r} is not admitted here (admit it first; it may have "
                "been freed already)"
            ) from None

    def step_plan(
        self,
        request_id: RequestId,
        num_new_tokens: int,
        token_ids: Sequence[int] | None = None,
    ) -> StepPlan:
        """The plan of the next step: what ``allocate`` with these arguments would do."""
        return self._step_plan(self._request(request_id), num_new_tokens, token_ids)

    def _step_plan(
        self, req: RequestBlocks, num_new_tokens: int, token_ids: Sequence[int] | None
    ) -> StepPlan:
        if num_new_tokens < 0:
            raise InvalidInput(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if req.num_tokens + num_new_tokens > self.plan.max_model_len:
            raise InvalidInput(
                f"request {req.request_id!r} would reach {req.num_tokens + num_new_tokens} tokens "
                f"({req.num_tokens} + {num_new_tokens}), past max_model_len="
                f"{self.plan.max_model_len}; finish or truncate it"
            )
        return plan_step(req, num_new_tokens, token_ids, self.managers, self.pool, self.hasher)

    def blocks_needed(
        self,
        request_id: RequestId,
        num_new_tokens: int,
        token_ids: Sequence[int] | None = None,
    ) -> int:
        """Blocks ``allocate`` with the same arguments takes from the free queue (fresh
        blocks plus revived cached hits). The step fits when this is at most
        ``num_free_blocks`` plus the blocks the step itself releases (``step_plan``)."""
        return self.step_plan(request_id, num_new_tokens, token_ids).num_taken

    def allocate(
        self,
        request_id: RequestId,
        num_new_tokens: int,
        token_ids: Sequence[int] | None = None,
    ) -> list[list[int]] | None:
        """Give positions ``num_tokens .. num_tokens + num_new_tokens - 1`` their slots.

        ``token_ids`` are the request's tokens so far: on the first step they find prefix
        hits, and every block whose tokens are all known is hashed into the prefix cache.
        Returns the slots appended per group (null, hit, then fresh ids), or None when the
        step does not fit: then only the blocks that left the window are released, as an
        empty step would (invariant 8), and nothing else changes.
        """
        req = self._request(request_id)
        plan = self._step_plan(req, num_new_tokens, token_ids)
        if not plan.fits(self.pool.num_free_blocks):
            release_skipped(req, plan, self.pool)
            return None
        return apply_step(req, plan, token_ids, self.managers, self.pool, self.hasher)

    def free(self, request_id: RequestId) -> None:
        """Return every block of the request; cached ones stay findable until evicted.
        Last blocks are freed first so a prefix's tail is evicted before its head."""
        req = self._request(request_id)
        del self._requests[request_id]
        for table in req.tables:
            self.pool.release(reversed(table))

    # --- reading state ------------------------------------------------------------------

    def block_table(self, request_id: RequestId) -> list[list[int]]:
        """Logical block ids per group (null slots are 0)."""
        return [list(t) for t in self._request(request_id).tables]

    def kernel_block_table(self, request_id: RequestId, group: int) -> KernelBlockIds:
        """Group ``group``'s table in kernel block ids: logical block b becomes
        ``b * f + k`` for k < f, f = block_size // kernel_block_size (the null block
        becomes kernel blocks 0 .. f - 1)."""
        try:
            i = self._group_index[group]
        except KeyError:
            raise InvalidInput(
                f"no group {group}; the plan has groups {sorted(self._group_index)}"
            ) from None
        table = self._request(request_id).tables[i]
        return kernel_block_ids(table, self.plan.groups[i].kernel_blocks_per_block)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_tokens(self, request_id: RequestId) -> int:
        """Positions of the request that have slots."""
        return self._request(request_id).num_tokens

    def num_cached_tokens(self, request_id: RequestId) -> int:
        """Tokens of the request served by prefix hits (already computed)."""
        return self._request(request_id).num_cached_tokens

    def block_hashes(self, request_id: RequestId) -> tuple[BlockHash, ...]:
        """The request's chained hashes, one per full hash block of known tokens: the keys
        an offload job stores under (see ``raykv.tiers.jobs.group_block_hashes``)."""
        return tuple(self._request(request_id).hashes)

    def cached_prefix(
        self,
        token_ids: Sequence[int],
        *,
        tenant: Tenant = None,
    ) -> int:
        """Tokens a first step over ``token_ids`` (of ``tenant``) would take from the prefix
        cache: common to every group, at most ``len(token_ids) - 1``. Changes nothing."""
        if self.hasher is None or len(token_ids) < 2:
            return 0
        limit = len(token_ids) - 1
        hbs = self.hasher.hash_block_size
        hashes = self.hasher.hash_blocks(token_ids, end_block=limit // hbs, tenant=tenant)
        return common_hit(self.managers, self.pool, hashes, hbs, limit)[0]

    def prefix_hit(self, request_id: RequestId) -> int:
        """Tokens the request's first step would take from the prefix cache now: common to
        every group, at most its admitted length - 1, on the hashes ``admit`` memoized (no
        hashing here). A scheduler sizes the first chunk as this plus its token budget."""
        req = self._request(request_id)
        if self.hasher is None or req.num_tokens or req.num_prompt_tokens < 2:
            return 0
        hbs = self.hasher.hash_block_size
        return common_hit(self.managers, self.pool, req.hashes, hbs, req.num_prompt_tokens - 1)[0]

    def hold_blocks(self, block_ids: Sequence[int]) -> None:
        """Add a reference so the blocks are not reused while, e.g., a store to the CPU
        tier still reads them (invariant 9); ``release_blocks`` drops it. Held blocks are
        not free, so ``num_free_blocks`` and the step planner stay exact."""
        require_logical(block_ids, "hold_blocks")
        self.pool.touch(block_ids)

    def release_blocks(self, block_ids: Sequence[int]) -> None:
        require_logical(block_ids, "release_blocks")
        self.pool.free(block_ids)

    def drain_events(self) -> list[KVEvent]:
        """KV events (BlockStored / BlockRemoved) since the last drain, in order."""
        return self.pool.drain_events()

    @property
    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    def __contains__(self, request_id: RequestId) -> bool:
        return request_id in self._requests

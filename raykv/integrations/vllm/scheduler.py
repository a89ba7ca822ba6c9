"""The connector's scheduler side: how many tokens raykv adds, and what each step moves.

``get_num_new_matched_tokens`` answers from the node's prefix index replica
(``raykv.engine.NodeKV.lookup``: shared memory, no round trip) how many tokens raykv holds
beyond vLLM's own prefix cache: whole blocks, and never the whole prompt (at most N - 1
tokens: vLLM must compute at least one token; a hit covering the last full block is cut to
N - 1, and the load then ends mid-block: the block is loaded whole and vLLM rewrites its last
slot). A stale answer is safe: the load leases and verifies every block, and what does not
arrive is recomputed. While no raykv answers on the node every lookup is a miss, at once.
A hit the node's CPU tier holds, of a model with one KV group, is loaded synchronously, by
the worker's ``start_load_kv`` before that step's forward (one lease round trip to the node
agent, one verified copy); blocks that did not arrive are reported by
``get_block_ids_with_load_errors`` and vLLM recomputes from the first of them. Every other
hit (blocks on other nodes or in a pool, which the node's tier pulls first; or a model with
several KV groups, as vLLM takes block-level failures of one group only) is loaded
asynchronously in vLLM's terms: the request waits in WAITING_FOR_REMOTE_KVS while vLLM runs
the others, and the worker reports it finished (``finished_recving``) or failed
(``failed_recving``: vLLM recomputes the request) in the step its load ends. The worker
reports every such load exactly once, even for a request vLLM aborted meanwhile (vLLM keeps
its blocks allocated until then). A request whose load failed is offered no more hits (it
recomputes).

A request with a cache salt or a LoRA adapter is looked up, loaded and saved under its
tenant's keys (``request_tenant``: the tenant enters its blocks' hashes), so two tenants
with the same prompt never share a block; images and prompt embeddings are neither loaded
nor saved (``not_keyed_by_tokens``).

Saves are asynchronous: ``build_connector_meta`` asks the worker to publish every prompt
block that this step completes (blocks a load brought in are in the tier already: a step that
completes no other block saves nothing); the worker copies them after the forward in the
background. ``request_finished`` keeps a request's blocks (returns True) when any save was
sent for it, until the worker reports it in ``finished_sending``: the worker reports every
such request once its saves are done (or dropped), and never one it was not sent.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from raykv.blocks.hashing import Tenant
from raykv.integrations.vllm.config import RaykvVllmConfig, request_flags, request_tenant
from raykv.integrations.vllm.metadata import LoadSpec, RaykvMetadata, SaveSpec
from raykv.integrations.vllm.served import ServedEngine

log = logging.getLogger(__name__)


@dataclass
class _Req:
    """One request the connector knows (from its first lookup to ``request_finished``)."""

    request: Any
    load: bool
    store: bool
    tenant: Tenant  # its blocks' keys are this tenant's (``request_tenant``)
    local_tokens: int = 0  # vLLM's own prefix-cache hit at the last lookup
    hit_tokens: int = 0  # raykv's extra tokens at the last lookup
    external_tokens: int = 0  # tokens vLLM agreed to take from raykv
    load_blocks: tuple[tuple[int, ...], ...] = ()  # the blocks the load fills (per group)
    failed_blocks: int = 0
    failed: bool = False  # a load failed: recompute, no more hits
    saved_tokens: int = 0  # prompt tokens already sent for saving, or loaded from the tier
    saves_sent: bool = False
    pending_load: LoadSpec | None = None
    remote: bool = True  # the last lookup found blocks the node's tier does not hold


@dataclass
class SchedulerStats:
    lookups: int = 0
    lookups_down: int = 0  # lookups while no raykv answered on the node (misses)
    lookup_tokens: int = 0
    hit_tokens: int = 0
    loaded_tokens: int = 0
    load_error_blocks: int = 0
    saved_blocks: int = 0
    by_request: dict[str, int] = field(default_factory=dict)


class RaykvScheduler:
    """State of the scheduler-side connector; vLLM's calls map one to one (connector.py)."""

    def __init__(self, config: RaykvVllmConfig, engine: ServedEngine) -> None:
        self.config, self.engine, self.layout = config, engine, engine.layout
        self.bs = self.layout.block_size
        self.reqs: dict[str, _Req] = {}
        self.stats = SchedulerStats()
        self.kv_cache_manager: Any = None
        self.sync = len(self.layout.groups) == 1  # see the module docstring

    @property
    def groups(self) -> tuple[int, ...]:
        """vLLM group -> raykv group (the engine's model is served once it is used)."""
        assert self.engine.groups is not None
        return self.engine.groups

    # --- lookups ----------------------------------------------------------------------

    def _state(self, request: Any) -> _Req:
        st = self.reqs.get(request.request_id)
        if st is None or st.request is not request:  # new, or an id reused after an abort
            load, store = request_flags(request.kv_transfer_params, self.config, request)
            st = self.reqs[request.request_id] = _Req(request, load, store, request_tenant(request))
        return st

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)
        st.local_tokens, st.hit_tokens = num_computed_tokens, 0
        prompt = request.prompt_token_ids or ()
        n = len(prompt)
        if not st.load or st.failed or n <= self.bs or num_computed_tokens >= n - 1:
            return 0, False
        if not self.engine.ready():  # no service on the node now: a miss, at once
            self.stats.lookups_down += 1
            return 0, False
        # lookup(ids) looks at the full blocks of ids[:-1]; one token more makes it see the
        # prompt's last full block too (a hit there is cut to n - 1 below)
        probe = [*prompt, 0] if n < self.layout.max_model_len else prompt
        local = num_computed_tokens - num_computed_tokens % self.bs
        try:
            found = self.engine.lookup(probe, local, st.tenant)
        except Exception as e:  # a bad replica or a bug: a miss, never a failed request
            log.warning("raykv lookup failed (%r): computing request %s", e, request.request_id)
            return 0, False
        self.stats.lookups += 1
        self.stats.lookup_tokens += n
        hit = found.hit_tokens - found.hit_tokens % self.bs
        ext = max(min(hit, n - 1) - num_computed_tokens, 0)
        st.hit_tokens = ext
        st.remote = found.tier_tokens < num_computed_tokens + ext
        # a hit the node's tier lacks crosses nodes: loaded asynchronously (the request
        # waits in WAITING_FOR_REMOTE_KVS while vLLM runs the others)
        return ext, ext > 0 and not (self.sync and not st.remote)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._state(request)
        if num_external_tokens <= 0:  # nothing to load (or the second call, after a load)
            return
        st.external_tokens = num_external_tokens
        local = st.local_tokens - st.local_tokens % self.bs
        end = local + num_external_tokens
        nblocks = -(-end // self.bs)
        table = self._table(request.request_id)
        ids = tuple(tuple(t[:nblocks]) for t in table)
        skip = tuple(
            max(local // self.bs, _leading_nulls(t[:nblocks])) for t in table
        )  # fmt: skip
        st.load_blocks = tuple(tuple(t[s:]) for t, s in zip(ids, skip, strict=True))
        prompt = request.prompt_token_ids
        st.pending_load = LoadSpec(
            request.request_id, tuple(prompt[: nblocks * self.bs]), ids, skip, end,
            sync=self.sync and not st.remote, remote=st.remote, tenant=st.tenant,
        )  # fmt: skip
        # the loaded blocks come from the tier: saving them again would find them there
        st.saved_tokens = max(st.saved_tokens, nblocks * self.bs)

    def _table(self, request_id: str) -> list[list[int]]:
        """The request's block ids per raykv group (vLLM's groups reordered)."""
        vllm_table = self.kv_cache_manager.get_block_ids(request_id)
        out: list[list[int]] = [[] for _ in self.groups]
        for vi, ri in enumerate(self.groups):
            out[ri] = list(vllm_table[vi])
        return out

    # --- each step --------------------------------------------------------------------

    def build_meta(self, so: Any) -> RaykvMetadata:
        meta = RaykvMetadata(preempted=frozenset(getattr(so, "preempted_req_ids", None) or ()))
        for st in self.reqs.values():
            if st.pending_load is not None:
                meta.loads.append(st.pending_load)
                self.stats.loaded_tokens += st.pending_load.num_tokens
            st.pending_load = None
        if not self.engine.ready():  # no service on the node: nothing is saved meanwhile
            return meta
        for rid, scheduled in so.num_scheduled_tokens.items():
            st = self.reqs.get(rid)
            if st is None or not st.store:
                continue
            request = st.request
            prompt = request.prompt_token_ids or ()
            done = min(request.num_computed_tokens + scheduled, len(prompt))
            full = done - done % self.bs
            if full <= st.saved_tokens:
                continue
            table = self._table(rid)
            nb = full // self.bs
            blocks = tuple(tuple(t[:nb]) for t in table)
            meta.saves.append(SaveSpec(rid, tuple(prompt[:full]), blocks, st.tenant))
            self.stats.saved_blocks += nb - st.saved_tokens // self.bs
            st.saved_tokens, st.saves_sent = full, True
        return meta

    def on_output(self, output: Any) -> None:
        """Count load errors per request (vLLM recomputes those tokens itself)."""
        for rid in getattr(output, "failed_recving", None) or ():
            st = self.reqs.get(rid)
            if st is not None:
                st.failed, st.saved_tokens = True, 0
                st.failed_blocks += sum(len(t) for t in st.load_blocks)
                self.stats.load_error_blocks += sum(len(t) for t in st.load_blocks)
        bad = set(getattr(output, "invalid_block_ids", None) or ())
        if not bad:
            return
        for st in self.reqs.values():
            n = sum(b in bad for t in st.load_blocks for b in t)
            if n:
                st.failed, st.failed_blocks = True, st.failed_blocks + n
                st.saved_tokens = 0  # the recomputed blocks are saved again (held keys skip)
                self.stats.load_error_blocks += n

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; hold its blocks while a save sent for it may run."""
        st = self.reqs.pop(request.request_id, None)
        if st is None or st.request is not request:
            return False, None
        self.stats.hit_tokens += st.external_tokens
        params = {
            "raykv": {
                "external_tokens": st.external_tokens,
                "load_error_blocks": st.failed_blocks,
                "saved_tokens": st.saved_tokens,
            }
        }
        return st.saves_sent, params

    def close(self) -> None:
        self.engine.close()


def _leading_nulls(ids: list[int]) -> int:
    n = 0
    while n < len(ids) and ids[n] == 0:
        n += 1
    return n

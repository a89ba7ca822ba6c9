"""The connector's worker side: vLLM's own KV tensors <-> the node's raykv CPU tier.

``register_kv_caches`` attaches vLLM's per-layer KV tensors to the node's CPU tier
(``raykv.engine.AttachedKV``, through the node agent: raykv's one data plane maps the tier's
arena from ``/dev/shm`` and runs ``raykv.tiers`` Store/LoadJobs on it: one paged copy,
checksums computed on store and verified before load). No KV byte goes through a Python
object, a socket or Ray's object store. On CPU vLLM's tensors are block-outermost
(``[num_blocks, kv_heads, block_size, 2 * head_size]``, one contiguous page per block and
layer), registered with ``layout="block_outer"``; on GPU (NHD, ``[2, num_blocks,
block_size, kv_heads, head_size]``) with ``layout="kv_outer"``. With no service on the node
it attaches once one answers; meanwhile loads are misses and saves are dropped (counted).

Loads start in ``start_load_kv``, all layers at once (``wait_for_layer_load`` has nothing
left to wait for): blocks the node's tier lacks are pulled into it first
(``AttachedKV.pull``: ``CpuTierActor.pull``, verified on arrival), then one lease round trip
to the node agent and one verified copy into vLLM's blocks (``load_into``). A synchronous
load (the node's tier holds it, one KV group) is done before the forward, and blocks it did
not deliver (a checksum failure, an entry evicted, the agent gone) are reported by block id
in the same step. An asynchronous one runs on the loader's thread while vLLM steps on; it is
reported in ``finished_recving`` once done, and in ``failed_recving`` too if anything did
not arrive (vLLM recomputes the request). Either way vLLM never reads wrong KV.
Saves run after the forward (``wait_for_save``) on one background thread;
``get_finished`` reports a finished request once every save sent for it is done, so vLLM
keeps its blocks until then. ``handle_preemptions`` waits for the saves in flight before
vLLM reuses a preempted request's blocks. A step whose ``wait_for_save`` never ran drops its
saves when the next step's metadata arrives (nothing stays reserved: a store reserves its
tier entries only while it copies).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from raykv.engine.attached import AttachedKV
from raykv.integrations.vllm.metadata import LoadSpec, RaykvMetadata, SaveSpec
from raykv.integrations.vllm.served import ServedEngine

log = logging.getLogger(__name__)


def tensor_layout(tensors: Mapping[str, Any], num_blocks: int) -> str:
    """ "block_outer" (vLLM CPU) or "kv_outer" (vLLM GPU, NHD) for ``GpuKV.register``."""
    t = next(iter(tensors.values()))
    return (
        "kv_outer"
        if t.dim() == 5 and t.shape[0] == 2 and t.shape[1] >= num_blocks
        else ("block_outer")
    )


class RaykvWorker:
    """State of the worker-side connector; vLLM's calls map one to one (connector.py)."""

    def __init__(self, engine: ServedEngine) -> None:
        self.engine, self.num_blocks = engine, engine.layout.num_blocks
        self.kv_caches: dict[str, Any] = {}
        self.attached: AttachedKV | None = None
        self.lock = threading.Lock()  # one AttachedKV user at a time (loads vs saves)
        self.book = threading.Lock()  # the counters below (never held during a copy)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="raykv-save")
        self.meta: RaykvMetadata | None = None
        self.staged: list[SaveSpec] = []  # this step's saves until wait_for_save
        self.inflight: list[Future] = []
        self.pending: Counter[str] = Counter()  # request -> saves not done
        self.sent: set[str] = set()  # requests a save was sent for (reported when finished)
        self.finishing: set[str] = set()
        self.errors: set[int] = set()
        self.cut: dict[str, int] = {}  # request -> its first block a load missed (this step)
        self.recved: set[str] = set()  # asynchronous loads done, not reported yet
        self.failed: set[str] = set()  # ... of which some blocks did not arrive
        self.failed_out: set[str] = set()  # ... reported by ``finished``, for ``take_failed``
        # asynchronous loads (blocks on other nodes, or several KV groups) run here
        self.loader = ThreadPoolExecutor(1, thread_name_prefix="raykv-load")
        self.loading: dict[str, Future] = {}
        self.counts: Counter[str] = Counter()

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        self.kv_caches = dict(kv_caches)
        self._attached()

    def _attached(self) -> AttachedKV | None:
        """The engine's tensors attached to the node's tier, once raykv answers there."""
        if self.attached is None and self.kv_caches and self.engine.ready():
            layout = tensor_layout(self.kv_caches, self.num_blocks)
            self.attached = self.engine.node.attach(
                self.kv_caches, num_blocks=self.num_blocks, layout=layout
            )
        return self.attached

    # --- per step ---------------------------------------------------------------------

    def bind(self, meta: RaykvMetadata) -> None:
        if self.staged:  # the last step's wait_for_save never ran: its saves are dropped
            self.counts["saves_dropped"] += len(self.staged)
            self.staged = []
        self.meta = meta
        self.staged = list(meta.saves)
        self.sent.update(s.request_id for s in meta.saves)

    def start_load(self) -> None:
        self.cut = {}
        if self.meta is None or not self.meta.loads:
            return
        if self._attached() is None:  # no service now: every load is a miss (recomputed)
            for spec in self.meta.loads:
                self._missed(spec, 0)
            return
        for spec in self.meta.loads:
            if spec.sync:
                self._load(spec)
            else:  # vLLM runs other requests meanwhile; ``finished`` reports it when done
                self.loading[spec.request_id] = self.loader.submit(self._load, spec)

    def _load(self, spec: LoadSpec) -> None:
        began = time.perf_counter()
        try:  # blocks the node's tier lacks come to it first (verified there); the pull
            # crosses nodes, so it holds no lock: saves and this node's loads go on meanwhile
            if spec.remote:
                self.attached.pull(spec.token_ids, [len(t) for t in spec.block_ids], spec.tenant)
        except Exception as e:  # what is local still loads; the rest is recomputed
            log.warning("raykv pull for %s failed (%r)", spec.request_id, e)
        tables, skip = [list(t) for t in spec.block_ids], list(spec.skip)
        try:  # one round trip to the node agent (lease), then one verified copy
            with self.lock:
                got = self.attached.load_into(spec.token_ids, tables, skip, spec.tenant)
        except Exception as e:  # the tier is gone or restarting: nothing was loaded
            log.warning("raykv load of %s failed (%r): vLLM recomputes it", spec.request_id, e)
            got = 0
        self._missed(spec, got, time.perf_counter() - began)

    def _missed(self, spec: LoadSpec, got: int, seconds: float = 0.0) -> None:
        """Count a load that delivered ``got`` tokens in ``seconds`` and report what it did
        not (an asynchronous one from the loader's thread)."""
        with self.book:
            self._account(spec, got)
            if got and seconds > 0:  # its cost per token, by path (a router's cost model)
                path = "remote" if spec.remote else "cpu"
                self.counts[f"load_us_{path}"] += round(seconds * 1e6)
                self.counts[f"load_tokens_{path}"] += got

    def _account(self, spec: LoadSpec, got: int) -> None:
        self.counts["loaded_tokens"] += min(got, spec.num_tokens)
        if not spec.sync:
            self.recved.add(spec.request_id)
        if got < spec.num_tokens:
            self.counts["load_errors"] += 1
            if spec.sync:  # vLLM recomputes from the first block that did not arrive
                first = got // self.engine.layout.block_size
                self.cut[spec.request_id] = first  # this step's save stops there (below)
                for t, s in zip(spec.block_ids, spec.skip, strict=True):
                    self.errors.update(b for b in t[max(first, s) :] if b != 0)
            else:
                self.failed.add(spec.request_id)
            log.info("raykv load of %s: %d of %d tokens arrived; vLLM recomputes it",
                     spec.request_id, got, spec.num_tokens)  # fmt: skip

    def wait_for_save(self) -> None:
        """Submit this step's saves. A request whose load missed blocks this step saves only
        the blocks before the first miss: the rest hold stale bytes (and this step's tokens
        were computed over them), and must never be published."""
        if self.attached is not None:  # this step's loads' lease releases, off the step's path
            self.inflight.append(self.pool.submit(self.attached.send))
        staged, self.staged = self.staged, []
        cut, self.cut = self.cut, {}
        if self.attached is None:  # no service now: the saves are dropped
            self.counts["saves_dropped"] += len(staged)
            staged = []
        for spec in staged:
            if spec.request_id in cut:
                n = cut[spec.request_id]
                if n == 0:
                    continue
                bs = len(spec.token_ids) // max(len(spec.block_ids[0]), 1)
                blocks = tuple(t[:n] for t in spec.block_ids)
                spec = dataclasses.replace(
                    spec, token_ids=spec.token_ids[: n * bs], block_ids=blocks
                )
            with self.book:
                self.pending[spec.request_id] += 1
            self.inflight.append(self.pool.submit(self._save, spec))

    def _save(self, spec: SaveSpec) -> None:
        try:
            with self.lock:
                tables = [list(t) for t in spec.block_ids]
                n = self.attached.store_from(spec.token_ids, tables, spec.tenant)
            self.counts["saved_entries"] += n
        except Exception as e:  # a miss later, never wrong KV
            log.warning("raykv save of %s failed (%r)", spec.request_id, e)
            self.counts["save_errors"] += 1
        finally:
            with self.book:
                self.pending[spec.request_id] -= 1

    def preempted(self) -> None:
        """Preempted requests' blocks are about to be reused: finish the saves reading them."""
        self.drain()

    def drain(self) -> None:
        inflight, self.inflight = self.inflight, []
        for f in inflight:
            f.result()

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose saves are done, loads done since the last call). Every
        asynchronous load is reported exactly once, finished by vLLM or not (an aborted
        request's blocks stay allocated until then); ``take_failed`` then names those of
        them that did not deliver everything."""
        self.inflight = [f for f in self.inflight if not f.done()]
        self.loading = {r: f for r, f in self.loading.items() if not f.done()}
        self.finishing.update(r for r in finished_req_ids if r in self.sent)
        with self.book:
            done = {r for r in self.finishing if self.pending[r] <= 0}
            for r in done:
                self.pending.pop(r, None)
            recved, self.recved = self.recved, set()
            self.failed_out, self.failed = self.failed, set()  # the same loads' failures
        self.finishing -= done
        self.sent -= done
        return (done or None), (recved or None)

    def take_failed(self) -> set[str]:
        failed, self.failed_out = self.failed_out, set()
        return failed

    def load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors

    def close(self) -> None:
        """Finish the loads and saves in flight, then detach: the tier releases at once
        whatever this worker still holds (a lease no step loaded, a store cut short)."""
        self.loader.shutdown(wait=True)
        self.drain()
        self.pool.shutdown(wait=True)
        if self.attached is not None:
            try:
                self.attached.close()
            except Exception as e:  # the tier is gone: its leases went with it
                log.warning("raykv detach failed (%r)", e)
        self.engine.close()

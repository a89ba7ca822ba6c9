"""Client handles: what an engine's scheduler and workers hold to use the service.

    kv = raykv.connect()                       # join a running Ray, or start one here
    kv.add_model("tiny", layers, max_model_len=4096, pool_bytes=64 << 20)
    hit = kv.lookup(prompt)                    # LookupResult(hit_tokens, where)
    kv.admit(rid, len(prompt), prompt); table = kv.allocate(rid, len(prompt), prompt)[0]
    kv.load(rid, prompt, into=table[:hit.hit_tokens // block_size])
    ...; kv.store(rid, table, rows); kv.free(rid)

Hybrid models (several KV groups) take block ids per group, as ``allocate`` returns them
(``store(rid, tables, [rows_g0, rows_g1, ...])``, ``load(rid, prompt, into=tables)``); a
one-group model also takes one flat list. A model served with ``tp_size=N`` takes rows per
rank (``store(rid, ids, [rows_rank0, ..., rows_rankN-1])``) and ``read(ids, rank=r)``.

Engine-facing calls go to the pool of the caller's node (found through the coordinator),
never to another node's: its block ids are that pool's (on GPUs, that GPU's). A call that
finds its pool dead raises ServiceError (the request's blocks died with it); later calls wait,
up to ``retry_s`` seconds, until the coordinator has placed a fresh pool under the same name
on the same node, and go there. ``lookup`` and ``stats`` go to the coordinator, and retry
through a coordinator restart for up to ``retry_s`` seconds. A ``Client`` pickles to its
settings, so a scheduler can hand it to workers on other nodes; each re-resolves its own
local pool. ``client.aio`` has the same methods as coroutines.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ray

from raykv.errors import RaykvError, ServiceError
from raykv.service.control import ensure_service
from raykv.service.ray_join import join
from raykv.service.spec import (  # the result types: raykv.LookupResult & co.
    COORDINATOR,
    NAMESPACE,
    Hit,
    LoadResult,
    LookupResult,
    ServedModel,
    StoreResult,  # noqa: F401  (raykv.StoreResult, and the store op's result)
    check_admit,
    check_block_ids,
    check_count,
    check_int,
    check_request_id,
    check_token_ids,
    served_model,
    token_id_array,
)

RETRY_S = 60.0
log = logging.getLogger(__name__)
# the coordinator restarting (actor errors, timeouts, its answer lost with it) or not yet
# named again (ValueError)
_RETRY = (
    ray.exceptions.RayActorError,
    ray.exceptions.GetTimeoutError,
    ray.exceptions.ObjectLostError,
    ValueError,
)
COORDINATOR_WHO = "the raykv coordinator"


def _brief(e: BaseException) -> str:
    """``Type: first line`` of an error, plus the actor it names (Ray's actor errors say
    ``name: ...`` further down)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    out = f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__
    named = next((ln for ln in lines[1:] if ln.startswith("name:")), None)
    return f"{out} ({named})" if named else out


def _unwrap(e: ray.exceptions.RayTaskError, who: str, method: str) -> RaykvError:
    """What a caller gets for an error ``who``'s ``method`` raised: the raykv error itself,
    else (another member it called failed, or a bug in it) a ServiceError that names
    ``who``, the call, the cause and what to do (issue 44: no raw Ray error reaches users)."""
    cause = e.cause
    if isinstance(cause, RaykvError):
        return cause
    if isinstance(cause, ray.exceptions.RayError):
        return ServiceError(
            f"{who}'s {method!r} failed: a member it called failed ({_brief(cause)}); the "
            "coordinator places failed members again within seconds, so retry the call (a "
            "request whose pool died is gone: admit it again)"
        )
    return ServiceError(
        f"{who}'s {method!r} failed ({_brief(cause if cause is not None else e)}); retry the "
        "call; if it keeps failing it is a raykv bug: report it with this message and the "
        "member's log (raykv status lists the members)"
    )


def _raise_task_error(e: ray.exceptions.RayTaskError, who: str, method: str) -> NoReturn:
    err = _unwrap(e, who, method)
    raise err from (None if err is e.cause else e)


class _Base:
    """Settings and resolution shared by the sync and async forms."""

    def __init__(
        self,
        namespace: str = NAMESPACE,
        model: str | None = None,
        retry_s: float = RETRY_S,
        node_id: str | None = None,
        client_id: str | None = None,
    ) -> None:
        self.namespace, self.model_name, self.retry_s = namespace, model, retry_s
        self.node_id = node_id  # None: the node this handle is used on
        # who admitted a request: the pools serve its blocks to this id only; it travels
        # with the handle (pickled, ``on``, ``aio``), so an engine's workers share it
        self.client_id = client_id or uuid.uuid4().hex
        self._coord = None
        self._info: tuple[ServedModel, Any] | None = None
        self._pool: tuple[str, str, Any] | None = None  # (node id, pool name, handle)
        # (node id, model, pool name) bound last: a name outlives its actor's deaths
        self._pool_name: tuple[str, str, str] | None = None

    def _settings(self, node_id: str | None) -> tuple:
        return (self.namespace, self.model_name, self.retry_s, node_id, self.client_id)

    def __reduce__(self):
        return (type(self), self._settings(self.node_id))

    def on(self, node_id: str | None) -> Any:
        """A handle of the same kind and client bound to the pool of ``node_id`` (None: the
        caller's)."""
        return type(self)(*self._settings(node_id))

    def _coordinator(self):
        if self._coord is None:
            self._coord = ray.get_actor(COORDINATOR, namespace=self.namespace)
        return self._coord

    def _forget_coordinator(self, method: str, error: Exception, deadline: float) -> None:
        """A coordinator call failed in a retryable way: give up past ``deadline``, else drop
        the cached handle so the next try finds the restarted actor by name."""
        if time.monotonic() > deadline:
            raise ServiceError(
                f"the raykv coordinator did not answer {method!r} within "
                f"{self.retry_s:.0f}s ({type(error).__name__}); is the service up "
                "(raykv up / raykv status)? Retry once it answers"
            ) from error
        self._coord = None

    def _node_id(self) -> str:
        return self.node_id or ray.get_runtime_context().get_node_id()

    def _bind_pool(self, node: str, model: str, names: list[str]) -> Any | None:
        """Bind this node's pool from ``names`` (the coordinator's live pools of ``node``):
        the one bound before while it is placed again (the same name is the same GPU slot),
        else the first. None while there is none to bind yet: the caller waits."""
        last = self._pool_name
        if last is not None and last[:2] == (node, model):
            name = last[2] if last[2] in names else None
        else:
            name = names[0] if names else None
        if name is None:
            return None
        try:
            handle = ray.get_actor(name, namespace=self.namespace)
        except ValueError:  # died since the coordinator last heard of it
            self._report_dead(name)
            return None
        self._pool, self._pool_name = (node, name, handle), (node, model, name)
        return handle

    def _pool_wait(self, node: str, model: str, deadline: float) -> None:
        """No pool of ``node`` to bind yet: give up with ServiceError past ``deadline``."""
        if time.monotonic() <= deadline:
            return
        last, self._pool_name = self._pool_name, None  # the next call takes any pool there
        raise ServiceError(
            f"no pool of model {model!r} answered on node {node[:12]} within {self.retry_s:.0f}s"
            + (f" ({last[2]} is being placed again)" if last and last[:2] == (node, model) else "")
            + "; a client only uses its own node's pool: check the node's free resources "
            "(raykv status), or retry later"
        )

    def _report_dead(self, name: str) -> None:
        """Tell the coordinator (without waiting) that pool ``name`` is dead, so it stops
        naming it and places a fresh one now."""
        try:
            self._coordinator().member_failed.remote(name)
        except (ValueError, ray.exceptions.RayError) as e:  # the coordinator is restarting
            log.warning("could not report dead pool %s to the coordinator: %r", name, e)

    def _pool_who(self) -> str:
        return f"pool {self._pool[1]!r}" if self._pool is not None else "this node's pool"

    def _pool_gone(self, error: Exception) -> ServiceError:
        who = self._pool_who()
        if self._pool is not None:
            self._report_dead(self._pool[1])
        self._pool = None
        return ServiceError(
            f"{who} is gone ({type(error).__name__}) and with it this call's request state; "
            "the coordinator starts a fresh one on this node within a few seconds (its "
            "blocks are misses) and the next calls wait for it: admit the request again and "
            "retry"
        )

    def _pool_failed(self, method: str, error: Exception) -> ServiceError:
        """A pool call whose answer never came (lost, timed out, cancelled, the node out of
        memory) while the pool itself may live on."""
        return ServiceError(
            f"{self._pool_who()}'s {method!r} did not answer ({_brief(error)}); it may or may "
            "not have taken effect: retry it (block_table shows a request's blocks; raykv "
            "status shows the pool)"
        )

    def _coord_failed(self, method: str, error: Exception) -> ServiceError:
        return ServiceError(
            f"{COORDINATOR_WHO}'s {method!r} did not answer ({_brief(error)}); retry it (raykv "
            "status shows whether the service is up)"
        )

    def _lookup_hashes(self, token_ids: Sequence[int], plan: Any, name: str) -> tuple:
        """(ids, limit, chained hashes) of a lookup: all but the prompt's last token (at
        least one token is left to compute)."""
        from raykv.blocks import BlockHasher

        ids = token_id_array(token_ids, plan.max_model_len, name)
        limit = max(len(ids) - 1, 0)
        hasher = BlockHasher(plan.hash_block_size)
        return ids, limit, hasher.hash_blocks(ids, end_block=limit // hasher.hash_block_size)

    # Each op is (target, method, args, post): "coord" calls retry, "pool" calls do not.
    def _lookup_op(self, token_ids: Sequence[int], model: ServedModel, plan: Any, hashed=None):
        """One coordinator call (``Coordinator.lookup_packed``): the prompt's chained hashes
        (``_lookup_hashes``, or ``hashed``) joined into one bytes blob, the coordinator cuts
        each group's keys out of it; the arguments and the answer travel packed as bytes."""
        from raykv.service.groups import primary_group
        from raykv.service.index import pack, unpack

        ids, limit, hashes = hashed or self._lookup_hashes(token_ids, plan, model.name)
        bs = plan.groups[primary_group(plan)].block_size
        node = self._node_id()

        def post(answer: bytes) -> LookupResult:
            res = unpack(answer, None, "a lookup answer")
            where = tuple(Hit(tier, n, n == node, count * bs) for tier, n, count in res["runs"])
            return LookupResult(res["hit_tokens"], where, len(ids))

        request = pack((model.name, b"".join(hashes), node, limit))
        return "coord", "lookup_packed", (request,), post


def _flat(block_ids: Sequence) -> bool:
    """True for one flat list of ids (a one-group model's table)."""
    return not any(isinstance(b, (list, tuple)) or getattr(b, "ndim", 0) > 0 for b in block_ids)


def _read_post(flat: bool) -> Callable:
    from raykv.service.rows import as_tensor

    def post(rows: list) -> Any:
        out = [as_tensor(r) for r in rows]
        return out[0] if flat else out

    return post


def _ident(x: Any) -> Any:
    return x


def _step_args(request_id: Any, num_tokens: Any, token_ids: Any, what: str) -> tuple:
    """The checks the pool makes, made here first so bad input raises locally (raykv.errors)."""
    ids = None if token_ids is None else check_token_ids(token_ids)
    return check_request_id(request_id), check_count(num_tokens, what), ids


def _rank(rank: Any) -> int:
    return check_int(rank, "rank", "pass a TP rank (an int in 0..tp_size-1)")


# --- the operations, each defined once ------------------------------------------------------
# An op checks its arguments here (bad input raises raykv.errors before any actor call) and
# returns what performs it, (target, method, args, post): "coord" calls go to the coordinator
# and retry through its restarts, "pool" calls go to the caller's node's pool with the client
# id first; ``post`` turns the answer into the result. ``Client`` runs an op with ray.get,
# ``AsyncClient`` with await: both get their methods from this one table (``_with_ops``).

_Op = tuple[str, str, tuple, Callable[[Any], Any]]


@dataclass(frozen=True)
class _OpSpec:
    build: Callable[..., _Op]
    returns: str  # the public method's return annotation
    needs_model: bool  # the served model and plan are resolved (cached) before ``build``


_OPS: list[_OpSpec] = []


def _op(returns: str, *, needs_model: bool = False) -> Callable:
    def register(build: Callable[..., _Op]) -> Callable[..., _Op]:
        _OPS.append(_OpSpec(build, returns, needs_model))
        return build

    return register


class _Ops:
    """The op table's entries (a namespace: ``_OPS`` holds them in order)."""

    @_op("Any")
    def add_model(
        self, name: str, layers: Mapping[str, Any], *, max_model_len: int, **settings: Any
    ) -> _Op:
        """Serve ``name`` (see ``ServedModel`` for settings); returns its ``Plan``. Bad
        settings raise ConfigError here; a model whose pools cannot start is not added
        (ServiceError, nothing of it kept)."""
        model = served_model(name, layers, max_model_len, settings)

        def post(plan: Any) -> Any:
            self.model_name, self._info, self._pool = name, (model, plan), None
            return plan

        return "coord", "add_model", (model,), post

    @_op("dict")
    def stats(self) -> _Op:
        """The coordinator's view of the service (what ``raykv status`` prints)."""
        return "coord", "stats", (), _ident

    @_op("LookupResult", needs_model=True)
    def lookup(self, token_ids: Sequence[int]) -> _Op:
        """The leading tokens of ``token_ids`` whose KV some pool or CPU tier holds, and where."""
        return self._lookup_op(token_ids, *self._info)

    @_op("bool")
    def admit(self, request_id: Hashable, num_tokens: int, token_ids=None) -> _Op:
        """Register the request if the blocks its ``num_tokens`` need are free now (False: not
        yet; nothing registered). ``token_ids``: its prompt, at most ``num_tokens`` ids; an
        empty request (0 tokens) or a request id None raises InvalidInput."""
        args = _step_args(request_id, num_tokens, token_ids, "num_tokens")
        check_admit(*args[1:])
        return "pool", "admit", args, _ident

    @_op("int")
    def blocks_needed(self, request_id: Hashable, num_new_tokens: int, token_ids=None) -> _Op:
        """Free blocks the request's next step of ``num_new_tokens`` takes."""
        args = _step_args(request_id, num_new_tokens, token_ids, "num_new_tokens")
        return "pool", "blocks_needed", args, _ident

    @_op("list[list[int]] | None")
    def allocate(self, request_id: Hashable, num_new_tokens: int, token_ids=None) -> _Op:
        """The block ids, per group, the request's next step appends (None: it does not fit)."""
        args = _step_args(request_id, num_new_tokens, token_ids, "num_new_tokens")
        return "pool", "allocate", args, _ident

    @_op("StoreResult")
    def store(
        self, request_id: Hashable, block_ids: Sequence, rows: Any, *, offload: bool = False
    ) -> _Op:
        """Write uint8 rows [n, row_bytes] into the request's blocks (per group, per rank;
        see the module docstring; null ids are skipped). Full blocks become hits for every
        node. ``offload`` also copies the request's complete CPU-tier entries to the node's
        CPU tier now (else that happens when the GPU blocks are evicted).

        Published bytes are immutable: a block that already holds published KV (written
        before and cached under its prefix key, by this request or by one sharing the block
        through a prefix hit), or that another store / load is writing at that moment, is
        skipped: its row is ignored and its bytes never change (the first write of a shared
        prefix block wins; the same prefix recomputed by another request is not written
        again). Blocks private to the request (not published: e.g. a partial last block, or
        a duplicate of a prefix another block already publishes) are written, again and
        again if need be. Returns a ``StoreResult``: an int, the blocks newly published,
        with ``written`` (blocks written) and ``skipped`` (per group, the ids left as they
        were). Bad input raises InvalidInput before anything is written."""
        from raykv.service.rows import to_wire

        request_id, ids = check_request_id(request_id), check_block_ids(block_ids)
        return "pool", "store", (request_id, ids, to_wire(rows), offload), _ident

    @_op("LoadResult")
    def load(self, request_id: Hashable, token_ids: Sequence[int], into: Sequence) -> _Op:
        """Fill ``into`` (the request's blocks, per group) with their positions' KV from the
        best copies in the cluster; ``num_tokens`` is the prefix now backed in every group."""
        request_id, _, ids = _step_args(request_id, 0, token_ids, "num_tokens")
        return "pool", "load", (request_id, ids, check_block_ids(into)), lambda d: LoadResult(**d)

    @_op("Any")
    def read(self, block_ids: Sequence, rank: int = 0) -> _Op:
        """Bytes of the pool's blocks on ``rank``: a uint8 tensor [n, row_bytes] for a flat
        list of ids, else a list of them, one per group."""
        ids = check_block_ids(block_ids)
        return "pool", "read", (ids, _rank(rank)), _read_post(_flat(ids))

    @_op("list[list[int]]")
    def block_table(self, request_id: Hashable) -> _Op:
        """The request's block ids per group now; slots a sliding window or chunk dropped
        hold the null block 0 (``allocate`` returns only what a step appends)."""
        return "pool", "block_table", (check_request_id(request_id),), _ident

    @_op("None")
    def free(self, request_id: Hashable) -> _Op:
        """Release the request's blocks (full ones stay cached as prefix hits)."""
        return "pool", "free", (check_request_id(request_id),), _ident


def _with_ops(make: Callable[[_OpSpec], Callable]) -> Callable[[type], type]:
    """A class decorator: one method per op of ``_OPS``, made by ``make`` (sync or async),
    with the op's name, signature (its declared return type) and docstring."""

    def install(cls: type) -> type:
        for spec in _OPS:
            method, name = make(spec), spec.build.__name__
            method.__name__, method.__qualname__ = name, f"{cls.__name__}.{name}"
            method.__doc__, method.__module__ = spec.build.__doc__, __name__
            method.__annotations__ = {**spec.build.__annotations__, "return": spec.returns}
            sig = inspect.signature(spec.build)
            method.__signature__ = sig.replace(return_annotation=spec.returns)
            setattr(cls, name, method)
        return cls

    return install


def _sync_method(spec: _OpSpec) -> Callable:
    def method(self: Client, *args: Any, **kwargs: Any) -> Any:
        return self._run(spec, args, kwargs)

    return method


def _async_method(spec: _OpSpec) -> Callable:
    async def method(self: AsyncClient, *args: Any, **kwargs: Any) -> Any:
        return await self._run(spec, args, kwargs)

    return method


@_with_ops(_sync_method)
class Client(_Base):
    """Synchronous handle. ``aio`` gives the asyncio form (``AsyncClient``). Its operations
    (add_model, stats, lookup, admit, blocks_needed, allocate, store, load, read,
    block_table, free) come from the op table above."""

    @property
    def aio(self) -> AsyncClient:
        return AsyncClient(*self._settings(self.node_id))

    @property
    def plan(self) -> Any:
        return self._model()[1]

    def _run(self, spec: _OpSpec, args: tuple, kwargs: dict) -> Any:
        if spec.needs_model:
            self._model()
        target, method, call_args, post = spec.build(self, *args, **kwargs)
        call = self._coord_call if target == "coord" else self._pool_call
        return post(call(method, *call_args))

    def _coord_call(self, method: str, *args: Any) -> Any:
        deadline, delay = time.monotonic() + self.retry_s, 0.2
        while True:
            try:
                return ray.get(getattr(self._coordinator(), method).remote(*args))
            except ray.exceptions.RayTaskError as e:  # raised by the method: not retried
                _raise_task_error(e, COORDINATOR_WHO, method)
            except _RETRY as e:
                self._forget_coordinator(method, e, deadline)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except ray.exceptions.RayError as e:  # anything else Ray raises: not retried
                raise self._coord_failed(method, e) from e

    def _model(self) -> tuple[ServedModel, Any]:
        if self._info is None:
            self._info = self._coord_call("get_model", self.model_name)
            self.model_name = self._info[0].name
        return self._info

    def _pool_handle(self):
        node = self._node_id()
        if self._pool is not None and self._pool[0] == node:
            return self._pool[2]
        model, _ = self._model()
        deadline, delay = time.monotonic() + self.retry_s, 0.1
        while True:
            pool = self._bind_pool(node, model.name, self._coord_call("pools", model.name, node))
            if pool is not None:
                return pool
            self._pool_wait(node, model.name, deadline)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _pool_call(self, method: str, *args: Any) -> Any:
        try:
            pool = self._pool_handle()
            return ray.get(getattr(pool, method).remote(self.client_id, *args))
        except ray.exceptions.RayTaskError as e:
            _raise_task_error(e, self._pool_who(), method)
        except ray.exceptions.RayActorError as e:
            raise self._pool_gone(e) from e
        except ray.exceptions.RayError as e:
            raise self._pool_failed(method, e) from e

    # --- shared memory (the data path without serialization) ------------------------------

    def pool_kv(self) -> Any:
        """This node's pool's KV tensors (rank 0's) mapped into this process, a
        ``raykv.tiers.GpuKV`` (``.layers`` per layer, ``.entries(group)`` per group): a CPU
        pool's through shared memory, a CUDA pool's through CUDA IPC (this process on the
        pool's node). An engine running on the pool's blocks reads a request's KV there in
        place once ``load`` returned, instead of ``read``'s rows; writes go through
        ``store`` (it checksums and publishes them). Map it once and keep it."""
        from raykv.tiers import GpuKV

        _, plan = self._model()
        kind, share = self._pool_call("kv_share")
        return GpuKV.attach(plan, share) if kind == "shm" else GpuKV.open_handles(plan, share)

    def attach(
        self,
        kv_tensors: Mapping[str, Any] | None = None,
        *,
        num_blocks: int | None = None,
        layout: str = "kv_outer",
        device: str = "cpu",
    ) -> Any:
        """The engine's paged KV bound to this node's CPU tier through shared memory
        (``raykv.engine.AttachedKV``, through the node agent's local socket):
        ``store_from(token_ids, block_ids)`` and ``load_into(token_ids, block_ids)`` cost
        one paged copy plus one control round trip.
        ``kv_tensors``: the engine's own per-layer tensors (checked against the plan, as
        ``GpuKV.register``, ``layout`` "kv_outer" or "block_outer"); None allocates tensors
        laid out like the pools' (``.kv``) on ``device``. ``num_blocks``: the engine's own
        block count (its pool is its own; the model's plan sets the rest)."""
        from raykv.engine.node import NodeKV

        model, _ = self._model()
        node = NodeKV.open(self.namespace, node_id=self._node_id())
        if not node.up:
            node.close()
            raise ServiceError(
                f"no raykv node agent answers at {node.agent.path} (this node's CPU tier runs "
                "it); is this node part of the service (raykv status)?"
            )
        node.use(model.name)
        return node.attach(kv_tensors, num_blocks=num_blocks, layout=layout, device=device)


@_with_ops(_async_method)
class AsyncClient(_Base):
    """The same operations as coroutines, for asyncio engines and async actors."""

    async def _run(self, spec: _OpSpec, args: tuple, kwargs: dict) -> Any:
        if spec.needs_model:
            await self._model()
        target, method, call_args, post = spec.build(self, *args, **kwargs)
        call = self._coord_call if target == "coord" else self._pool_call
        return post(await call(method, *call_args))

    async def _coord_call(self, method: str, *args: Any) -> Any:
        deadline, delay = time.monotonic() + self.retry_s, 0.2
        while True:
            try:
                return await getattr(self._coordinator(), method).remote(*args)
            except ray.exceptions.RayTaskError as e:  # raised by the method: not retried
                _raise_task_error(e, COORDINATOR_WHO, method)
            except _RETRY as e:
                self._forget_coordinator(method, e, deadline)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except ray.exceptions.RayError as e:  # anything else Ray raises: not retried
                raise self._coord_failed(method, e) from e

    async def _model(self) -> tuple[ServedModel, Any]:
        if self._info is None:
            self._info = await self._coord_call("get_model", self.model_name)
            self.model_name = self._info[0].name
        return self._info

    async def _pool_handle(self):
        node = self._node_id()
        if self._pool is not None and self._pool[0] == node:
            return self._pool[2]
        model, _ = await self._model()
        deadline, delay = time.monotonic() + self.retry_s, 0.1
        while True:
            names = await self._coord_call("pools", model.name, node)
            pool = self._bind_pool(node, model.name, names)
            if pool is not None:
                return pool
            self._pool_wait(node, model.name, deadline)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _pool_call(self, method: str, *args: Any) -> Any:
        try:
            pool = await self._pool_handle()
            return await getattr(pool, method).remote(self.client_id, *args)
        except ray.exceptions.RayTaskError as e:
            _raise_task_error(e, self._pool_who(), method)
        except ray.exceptions.RayActorError as e:
            raise self._pool_gone(e) from e
        except ray.exceptions.RayError as e:
            raise self._pool_failed(method, e) from e


def connect(
    address: str | None = None, namespace: str = NAMESPACE, *, model: str | None = None
) -> Client:
    """A client of the raykv service; starts the coordinator if there is none.

    ``address`` None: use the Ray this process already joined, else RAY_ADDRESS, else the
    head ``raykv up`` started on this host, else start an embedded local Ray on 127.0.0.1
    (records of dead clusters are ignored). An address that does not answer is a
    ``ServiceError`` within seconds.
    """
    if not ray.is_initialized():
        join(address, namespace, start_local=True)
    ensure_service(namespace)
    return Client(namespace, model)

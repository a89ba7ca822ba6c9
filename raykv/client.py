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

Each operation is one method of ``_Operations`` below: it checks its arguments (the checks
of ``raykv.api``, run once per call, here: bad input raises before any actor call) and
returns the actor call that performs it, e.g. ``PoolCall(GpuPool.store, ...)``. ``Client``
makes that call with ``ray.get``, ``AsyncClient`` with ``await`` (``operation``). So
``Client.store`` leads to ``_Operations.store``, then to ``GpuPool.store`` in the pool's
process, which trusts those checks and checks ownership.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
import uuid
from collections.abc import Callable, Coroutine, Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MethodType
from typing import TYPE_CHECKING, Any, Concatenate, Generic, NoReturn, ParamSpec, TypeVar, overload

import ray

from raykv.api import (  # the result types: raykv.LookupResult & co.
    Hit,
    LoadResult,
    LookupResult,
    StoreResult,
    check_admit,
    check_block_ids,
    check_count,
    check_int,
    check_request_id,
    check_token_ids,
    token_id_array,
)
from raykv.errors import RaykvError, ServiceError
from raykv.service.control.calls import ensure_service
from raykv.service.control.ray_join import join
from raykv.service.served import COORDINATOR, NAMESPACE, ServedModel, served_model

if TYPE_CHECKING:
    from raykv.blocks.hashing import Tenant
    from raykv.layout import Plan
    from raykv.service.control.coordinator import Coordinator
    from raykv.service.pool.gpu_pool import GpuPool

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


def _step_args(
    request_id: Hashable, count: int, token_ids: Sequence[int] | None, what: str
) -> tuple[Hashable, int, Any]:
    """A step's checked arguments, in this order: the request id, its token count (``what``),
    its ids."""
    request_id, count = check_request_id(request_id), check_count(count, what)
    return request_id, count, None if token_ids is None else check_token_ids(token_ids)


# --- what an operation asks of an actor ------------------------------------------------------


class _ActorMethods:
    """``GpuPool`` and ``Coordinator`` as this module has them at run time. Their modules
    import torch and the whole service, which a client needs not, and a Ray call needs only
    a method's name: ``GpuPool.store`` here is a stand-in function named "store". Editors and
    type checkers see the real classes (the ``TYPE_CHECKING`` import above), so "go to
    definition" on ``GpuPool.store`` opens the pool's method; ``tests/service/
    test_client_ops.py`` checks every name used here against the real classes."""

    def __init__(self, actor: str) -> None:
        self.actor = actor

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)

        def stand_in(*_args: Any, **_kwargs: Any) -> NoReturn:
            raise TypeError(f"{self.actor}.{method} runs in its actor: call it through Ray")

        stand_in.__name__, stand_in.__qualname__ = method, f"{self.actor}.{method}"
        return stand_in


if not TYPE_CHECKING:
    GpuPool, Coordinator = _ActorMethods("GpuPool"), _ActorMethods("Coordinator")

R = TypeVar("R")
P = ParamSpec("P")


def _answer(answer: Any) -> Any:
    """The actor's answer as it came: most operations return it unchanged."""
    return answer


@dataclass(frozen=True)
class PoolCall(Generic[R]):
    """What an operation asks of the caller's node's pool: its ``method`` (a ``GpuPool``
    method), called with the handle's client id and then ``args``; ``result`` turns the
    answer into the operation's result. Not retried: a pool that dies takes its requests
    with it."""

    method: Callable[..., Any]
    args: tuple[Any, ...] = ()
    result: Callable[[Any], R] = _answer


@dataclass(frozen=True)
class CoordinatorCall(Generic[R]):
    """What an operation asks of the coordinator: its ``method`` (a ``Coordinator`` method)
    with ``args``, retried through coordinator restarts for up to ``retry_s``; ``result``
    turns the answer into the operation's result."""

    method: Callable[..., Any]
    args: tuple[Any, ...] = ()
    result: Callable[[Any], R] = _answer


def _result_annotation(build: Callable[..., Any]) -> str:
    """The result type an operation's call names: "StoreResult" for ``-> PoolCall[StoreResult]``
    (annotations are strings in this module: ``from __future__ import annotations``)."""
    call = build.__annotations__["return"]
    kind, _, rest = call.partition("[")
    if kind not in ("PoolCall", "CoordinatorCall") or not rest.endswith("]"):
        raise TypeError(
            f"operation {build.__name__} returns {call}, not a PoolCall or a CoordinatorCall"
        )
    return rest[:-1]


class operation(Generic[P, R]):
    """An operation of both handles, written once as ``build``: it checks the caller's
    arguments (bad input raises raykv.errors there, before any actor call) and returns the
    actor call that performs it. ``Client.<name>`` makes that call and returns its result;
    ``AsyncClient.<name>`` is the same as a coroutine function. Both carry ``build``'s name,
    parameters and docstring, with the call's result type as their return annotation."""

    needs_model = False  # ``with_model``

    def __init__(
        self, build: Callable[Concatenate[Any, P], PoolCall[R] | CoordinatorCall[R]]
    ) -> None:
        self.build = build
        result = _result_annotation(build)

        def method(handle: Client, /, *args: Any, **kwargs: Any) -> Any:
            return handle._perform(self, args, kwargs)

        async def coroutine(handle: AsyncClient, /, *args: Any, **kwargs: Any) -> Any:
            return await handle._perform(self, args, kwargs)

        signature = inspect.signature(build).replace(return_annotation=result)
        for form in (method, coroutine):
            functools.update_wrapper(form, build)
            form.__annotations__ = {**build.__annotations__, "return": result}
            form.__signature__ = signature  # type: ignore[attr-defined]
        self.method, self.coroutine = method, coroutine

    @classmethod
    def with_model(
        cls, build: Callable[Concatenate[Any, P], PoolCall[R] | CoordinatorCall[R]]
    ) -> operation[P, R]:
        """An operation whose ``build`` reads the served model and plan (``self._info``): the
        handle resolves them (one coordinator call, then cached) before ``build`` runs."""
        op = cls(build)
        op.needs_model = True
        return op

    @overload
    def __get__(self, handle: None, owner: type) -> Callable[..., Any]: ...
    @overload
    def __get__(
        self, handle: AsyncClient, owner: type | None = None
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def __get__(self, handle: Client, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, handle: Any, owner: type | None = None) -> Callable[..., Any]:
        form = self.coroutine if issubclass(owner or type(handle), AsyncClient) else self.method
        return form if handle is None else MethodType(form, handle)


# --- the operations, each written once --------------------------------------------------------


def _flat(block_ids: list) -> bool:
    """True for one flat list of ids (a one-group model's table)."""
    return not any(isinstance(b, list) for b in block_ids)


def _rows_as_tensors(flat: bool) -> Callable[[list], Any]:
    """``read``'s answer (numpy rows per group) as tensors: one for a flat list of ids."""
    from raykv.service.pool.rows import as_tensor

    def result(rows: list) -> Any:
        tensors = [as_tensor(r) for r in rows]
        return tensors[0] if flat else tensors

    return result


class _Operations(_Base):
    """The operations of ``Client`` and ``AsyncClient``. Each checks its arguments with the
    checks of ``raykv.api`` (the one check of each per call: the pool trusts them and checks
    ownership, its plan's limits and the request's state) and returns the actor call that
    performs it (see ``operation``)."""

    @operation
    def add_model(
        self, name: str, layers: Mapping[str, Any], *, max_model_len: int, **settings: Any
    ) -> CoordinatorCall[Plan]:
        """Serve ``name`` (see ``ServedModel`` for settings); returns its ``Plan``. Bad
        settings raise ConfigError here; a model whose pools cannot start is not added
        (ServiceError, nothing of it kept)."""
        model = served_model(name, layers, max_model_len, settings)

        def use(plan: Plan) -> Plan:  # the handle serves the model it added from now on
            self.model_name, self._info, self._pool = name, (model, plan), None
            return plan

        return CoordinatorCall(Coordinator.add_model, (model,), use)

    @operation
    def stats(self) -> CoordinatorCall[dict]:
        """The coordinator's view of the service (what ``raykv status`` prints)."""
        return CoordinatorCall(Coordinator.stats)

    @operation.with_model
    def lookup(
        self, token_ids: Sequence[int], tenant: Tenant = None
    ) -> CoordinatorCall[LookupResult]:
        """The leading tokens of ``token_ids`` whose KV some pool or CPU tier holds, and where.
        ``tenant``: the prompt's tenant (``raykv.blocks.tenant_key``: a cache salt, a LoRA
        adapter's name and path, as the vLLM connector keys such a request): only its blocks
        are hits."""
        from raykv.blocks import BlockHasher
        from raykv.service.control.index import pack, unpack
        from raykv.service.groups import primary_group

        model, plan = self._info  # resolved before this runs (``operation.with_model``)
        ids = token_id_array(token_ids, plan.max_model_len, model.name)
        limit = max(len(ids) - 1, 0)  # the last token is always computed: never a hit
        hasher = BlockHasher(plan.hash_block_size)
        hashes = hasher.hash_blocks(ids, end_block=limit // hasher.hash_block_size, tenant=tenant)
        block_size = plan.groups[primary_group(plan)].block_size
        node = self._node_id()

        def result(answer: bytes) -> LookupResult:
            found = unpack(answer, None, "a lookup answer")
            where = tuple(
                Hit(tier, n, n == node, count * block_size) for tier, n, count in found["runs"]
            )
            return LookupResult(found["hit_tokens"], where, len(ids))

        # one bytes object each way, which Ray moves without serializing values: the
        # chained hashes joined into one blob, the coordinator cuts each group's keys out
        request = pack((model.name, b"".join(hashes), node, limit))
        return CoordinatorCall(Coordinator.lookup_packed, (request,), result)

    @operation
    def admit(
        self, request_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None
    ) -> PoolCall[bool]:
        """Register the request if the blocks its ``num_tokens`` need are free now (False: not
        yet; nothing registered). ``token_ids``: its prompt, at most ``num_tokens`` ids; an
        empty request (0 tokens) or a request id None raises InvalidInput."""
        request_id, num_tokens, ids = _step_args(request_id, num_tokens, token_ids, "num_tokens")
        check_admit(num_tokens, ids)
        return PoolCall(GpuPool.admit, (request_id, num_tokens, ids))

    @operation
    def blocks_needed(
        self, request_id: Hashable, num_new_tokens: int, token_ids: Sequence[int] | None = None
    ) -> PoolCall[int]:
        """Free blocks the request's next step of ``num_new_tokens`` takes."""
        request_id, num_new_tokens, ids = _step_args(
            request_id, num_new_tokens, token_ids, "num_new_tokens"
        )
        return PoolCall(GpuPool.blocks_needed, (request_id, num_new_tokens, ids))

    @operation
    def allocate(
        self, request_id: Hashable, num_new_tokens: int, token_ids: Sequence[int] | None = None
    ) -> PoolCall[list[list[int]] | None]:
        """The block ids, per group, the request's next step appends (None: it does not fit)."""
        request_id, num_new_tokens, ids = _step_args(
            request_id, num_new_tokens, token_ids, "num_new_tokens"
        )
        return PoolCall(GpuPool.allocate, (request_id, num_new_tokens, ids))

    @operation
    def store(
        self, request_id: Hashable, block_ids: Sequence, rows: Any, *, offload: bool = False
    ) -> PoolCall[StoreResult]:
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
        from raykv.service.pool.rows import to_wire

        request_id, ids = check_request_id(request_id), check_block_ids(block_ids)
        return PoolCall(GpuPool.store, (request_id, ids, to_wire(rows), offload))

    @operation
    def load(
        self, request_id: Hashable, token_ids: Sequence[int], into: Sequence
    ) -> PoolCall[LoadResult]:
        """Fill ``into`` (the request's blocks, per group) with their positions' KV from the
        best copies in the cluster; ``num_tokens`` is the prefix now backed in every group."""
        request_id = check_request_id(request_id)
        ids, into = check_token_ids(token_ids), check_block_ids(into)
        return PoolCall(GpuPool.load, (request_id, ids, into), lambda got: LoadResult(**got))

    @operation
    def read(self, block_ids: Sequence, rank: int = 0) -> PoolCall[Any]:
        """Bytes of the pool's blocks on ``rank``: a uint8 tensor [n, row_bytes] for a flat
        list of ids, else a list of them, one per group."""
        ids = check_block_ids(block_ids)
        rank = check_int(rank, "rank", "pass a TP rank (an int in 0..tp_size-1)")
        return PoolCall(GpuPool.read, (ids, rank), _rows_as_tensors(_flat(ids)))

    @operation
    def block_table(self, request_id: Hashable) -> PoolCall[list[list[int]]]:
        """The request's block ids per group now; slots a sliding window or chunk dropped
        hold the null block 0 (``allocate`` returns only what a step appends)."""
        return PoolCall(GpuPool.block_table, (check_request_id(request_id),))

    @operation
    def free(self, request_id: Hashable) -> PoolCall[None]:
        """Release the request's blocks (full ones stay cached as prefix hits)."""
        return PoolCall(GpuPool.free, (check_request_id(request_id),))


class Client(_Operations):
    """Synchronous handle. ``aio`` gives the asyncio form (``AsyncClient``). Its operations
    (add_model, stats, lookup, admit, blocks_needed, allocate, store, load, read,
    block_table, free) are ``_Operations``'."""

    @property
    def aio(self) -> AsyncClient:
        return AsyncClient(*self._settings(self.node_id))

    @property
    def plan(self) -> Any:
        return self._model()[1]

    def _perform(self, op: operation, args: tuple, kwargs: dict) -> Any:
        """Operation ``op``: its checks and call (``op.build``), the call made, its result."""
        if op.needs_model:
            self._model()
        call = op.build(self, *args, **kwargs)
        if isinstance(call, PoolCall):
            return call.result(self._pool_call(call.method, *call.args))
        return call.result(self._coord_call(call.method, *call.args))

    def _coord_call(self, method: Callable[..., Any], *args: Any) -> Any:
        name, deadline, delay = method.__name__, time.monotonic() + self.retry_s, 0.2
        while True:
            try:
                return ray.get(getattr(self._coordinator(), name).remote(*args))
            except ray.exceptions.RayTaskError as e:  # raised by the method: not retried
                _raise_task_error(e, COORDINATOR_WHO, name)
            except _RETRY as e:
                self._forget_coordinator(name, e, deadline)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)
            except ray.exceptions.RayError as e:  # anything else Ray raises: not retried
                raise self._coord_failed(name, e) from e

    def _model(self) -> tuple[ServedModel, Any]:
        if self._info is None:
            self._info = self._coord_call(Coordinator.get_model, self.model_name)
            self.model_name = self._info[0].name
        return self._info

    def _pool_handle(self):
        node = self._node_id()
        if self._pool is not None and self._pool[0] == node:
            return self._pool[2]
        model, _ = self._model()
        deadline, delay = time.monotonic() + self.retry_s, 0.1
        while True:
            names = self._coord_call(Coordinator.pools, model.name, node)
            pool = self._bind_pool(node, model.name, names)
            if pool is not None:
                return pool
            self._pool_wait(node, model.name, deadline)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _pool_call(self, method: Callable[..., Any], *args: Any) -> Any:
        name = method.__name__
        try:
            pool = self._pool_handle()
            return ray.get(getattr(pool, name).remote(self.client_id, *args))
        except ray.exceptions.RayTaskError as e:
            _raise_task_error(e, self._pool_who(), name)
        except ray.exceptions.RayActorError as e:
            raise self._pool_gone(e) from e
        except ray.exceptions.RayError as e:
            raise self._pool_failed(name, e) from e

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
        kind, share = self._pool_call(GpuPool.kv_share)
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


class AsyncClient(_Operations):
    """The same operations as coroutines, for asyncio engines and async actors."""

    async def _perform(self, op: operation, args: tuple, kwargs: dict) -> Any:
        """``Client._perform``, awaiting the calls."""
        if op.needs_model:
            await self._model()
        call = op.build(self, *args, **kwargs)
        if isinstance(call, PoolCall):
            return call.result(await self._pool_call(call.method, *call.args))
        return call.result(await self._coord_call(call.method, *call.args))

    async def _coord_call(self, method: Callable[..., Any], *args: Any) -> Any:
        name, deadline, delay = method.__name__, time.monotonic() + self.retry_s, 0.2
        while True:
            try:
                return await getattr(self._coordinator(), name).remote(*args)
            except ray.exceptions.RayTaskError as e:  # raised by the method: not retried
                _raise_task_error(e, COORDINATOR_WHO, name)
            except _RETRY as e:
                self._forget_coordinator(name, e, deadline)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
            except ray.exceptions.RayError as e:  # anything else Ray raises: not retried
                raise self._coord_failed(name, e) from e

    async def _model(self) -> tuple[ServedModel, Any]:
        if self._info is None:
            self._info = await self._coord_call(Coordinator.get_model, self.model_name)
            self.model_name = self._info[0].name
        return self._info

    async def _pool_handle(self):
        node = self._node_id()
        if self._pool is not None and self._pool[0] == node:
            return self._pool[2]
        model, _ = await self._model()
        deadline, delay = time.monotonic() + self.retry_s, 0.1
        while True:
            names = await self._coord_call(Coordinator.pools, model.name, node)
            pool = self._bind_pool(node, model.name, names)
            if pool is not None:
                return pool
            self._pool_wait(node, model.name, deadline)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _pool_call(self, method: Callable[..., Any], *args: Any) -> Any:
        name = method.__name__
        try:
            pool = await self._pool_handle()
            return await getattr(pool, name).remote(self.client_id, *args)
        except ray.exceptions.RayTaskError as e:
            _raise_task_error(e, self._pool_who(), name)
        except ray.exceptions.RayActorError as e:
            raise self._pool_gone(e) from e
        except ray.exceptions.RayError as e:
            raise self._pool_failed(name, e) from e


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

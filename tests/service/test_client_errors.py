"""Issue 44, item 2: a public Client call raises only raykv errors, whatever Ray raises under
it. Without a cluster: every kind of Ray error, as the pool or the coordinator answers it, in
the sync and the async form. On a one-node cluster: the pool, the CPU tier and the
coordinator killed under every public call."""

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
import ray
import torch
from ray import exceptions as rex

from raykv.client import AsyncClient, Client
from raykv.errors import InvalidInput, RaykvError, ServiceError
from raykv.layout import FullAttention
from raykv.service.control.coordinator import Coordinator
from raykv.service.pool.gpu_pool import GpuPool
from raykv.service.served import COORDINATOR, NAMESPACE, pool_name, tier_name

# the tier kill runs a helper of this module inside the pool
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

OID = "ab" * 14  # an object id, for the errors that name one


def _task(cause: BaseException, method: str = "m") -> rex.RayTaskError:
    """A RayTaskError as Ray raises it: an instance of its cause's class too."""
    return rex.RayTaskError(method, "Traceback (remote)", cause).as_instanceof_cause()


RAY_ERRORS: dict[str, Callable[[], BaseException]] = {
    "actor died": lambda: rex.ActorDiedError(),
    "actor unavailable": lambda: rex.ActorUnavailableError("unreachable", None),
    "get timeout": lambda: rex.GetTimeoutError("timed out"),
    "object lost": lambda: rex.ObjectLostError(OID, None, ""),
    "owner died": lambda: rex.OwnerDiedError(OID, None, ""),
    "worker crashed": lambda: rex.WorkerCrashedError(),
    "task cancelled": lambda: rex.TaskCancelledError(),
    "out of memory": lambda: rex.OutOfMemoryError("the node ran out of memory"),
    "node died": lambda: rex.NodeDiedError("node gone"),
    "object store full": lambda: rex.ObjectStoreFullError(),
    "system error": lambda: rex.RaySystemError("raylet down"),
    # raised by the method itself: another member it called died, or a bug in it
    "task: a member it called died": lambda: _task(rex.ActorDiedError()),
    "task: a bug": lambda: _task(KeyError("oops")),
    "task: a raykv error": lambda: _task(InvalidInput("bad ids")),
}


class _Method:
    def __init__(self, error: BaseException, is_async: bool) -> None:
        self.error, self.is_async = error, is_async

    def remote(self, *args: Any) -> Any:
        if not self.is_async:
            return self  # ray.get (patched) raises it

        async def fail() -> None:
            raise self.error

        return fail()


class _Reports:
    def __init__(self) -> None:
        self.names: list[tuple] = []

    def remote(self, *args: Any) -> None:
        self.names.append(args)


class _Handle:
    """An actor handle whose every method answers with ``error`` (``member_failed``: the
    dead pools reported to it)."""

    def __init__(self, error: BaseException, is_async: bool) -> None:
        self.error, self.is_async, self.member_failed = error, is_async, _Reports()

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.error, self.is_async)


def _client(kind: type, error: BaseException) -> Any:
    is_async = kind is AsyncClient
    kv = kind(model="m", retry_s=-1.0, node_id="n" * 56)  # no retry: the first error counts
    kv._pool = ("n" * 56, "raykv-pool-m-x-0", _Handle(error, is_async))
    kv._coord = _Handle(error, is_async)
    return kv


def _call(kv: Any, target: str) -> Any:
    if target == "pool":
        out = kv._pool_call(GpuPool.allocate, "r", 1)
    else:
        out = kv._coord_call(Coordinator.pools, "m", "n")
    return asyncio.run(out) if isinstance(kv, AsyncClient) else out


@pytest.mark.parametrize("kind", [Client, AsyncClient], ids=["sync", "async"])
@pytest.mark.parametrize("target", ["pool", "coordinator"])
@pytest.mark.parametrize("name", list(RAY_ERRORS))
def test_every_ray_error_reaches_the_caller_as_a_raykv_error(monkeypatch, kind, target, name):
    error = RAY_ERRORS[name]()

    def get(ref: Any, *args: Any, **kwargs: Any) -> Any:
        raise ref.error

    monkeypatch.setattr(ray, "get", get)
    kv = _client(kind, error)
    with pytest.raises(RaykvError) as got:
        _call(kv, target)
    err = got.value
    assert not isinstance(err, rex.RayError), repr(err)
    if name == "task: a raykv error":
        assert err is error.cause  # the method's own error, as it raised it
        return
    assert type(err) is ServiceError, repr(err)
    msg = str(err)
    who = "raykv-pool-m-x-0" if target == "pool" else "coordinator"
    assert who in msg and "retry" in msg.lower(), msg  # the member, and what to do
    if name.startswith("task: a member"):
        assert "a member it called failed (ActorDiedError" in msg, msg
    elif name == "task: a bug":
        assert "KeyError" in msg and "raykv bug" in msg, msg
    pool_died = isinstance(error, rex.RayActorError) and not isinstance(error, rex.RayTaskError)
    if target == "pool" and pool_died:  # reported to the coordinator, forgotten here
        assert "is gone" in msg and kv._pool is None, msg
        assert kv._coord.member_failed.names == [("raykv-pool-m-x-0",)]


# --- on a cluster: each actor kind killed under each public call ---------------------------

RAY_WORKERS = 0  # the head alone: a pool, a CPU tier and the coordinator
BS = 16
ROW = 2 * 2 * BS * 1 * 16 * 4
LAYERS = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)}
SETTINGS = dict(max_model_len=256, pool_bytes=64 * ROW, cpu_bytes=64 * ROW)
IDS = list(range(7, 7 + 2 * BS + 1))  # two full blocks and one token


def _calls(rid: str, table: list[int]) -> dict[str, Callable[[Client], Any]]:
    """Every public Client call, on request ``rid`` (admitted, its blocks ``table``)."""
    rows = torch.randint(0, 256, (2, ROW), dtype=torch.uint8)
    return {
        "add_model": lambda kv: kv.add_model("ce", LAYERS, **SETTINGS),
        "stats": lambda kv: kv.stats(),
        "lookup": lambda kv: kv.lookup(IDS),
        "admit": lambda kv: kv.admit(rid + "+", len(IDS), IDS),
        "blocks_needed": lambda kv: kv.blocks_needed(rid, 1),
        "allocate": lambda kv: kv.allocate(rid, 1),
        "store": lambda kv: kv.store(rid, table[:2], rows, offload=True),
        "load": lambda kv: kv.load(rid, IDS, into=table[:2]),
        "read": lambda kv: kv.read(table[:2]),
        "block_table": lambda kv: kv.block_table(rid),
        "free": lambda kv: kv.free(rid),
        "pool_kv": lambda kv: kv.pool_kv(),
    }


def _outcome(call: Callable[[Client], Any], kv: Client) -> str:
    try:
        call(kv)
    except RaykvError as e:
        return type(e).__name__
    except Exception as e:  # what the test is about
        return f"RAW {type(e).__name__}: {e}"
    return "ok"


def _wait(what: str, check: Callable[[], bool], bound: float = 45.0) -> None:
    deadline = time.monotonic() + bound
    while True:
        try:
            if check():
                return
        except RaykvError:
            pass
        assert time.monotonic() < deadline, f"{what} within {bound:.0f}s"
        time.sleep(0.3)


def _kill_tier_before_apply(pool: Any) -> None:
    """Inside the pool: the next offload's tier dies between its reservation and its apply
    (the call under way then finds the tier dead)."""
    io = pool.tier_io  # the part that offloads
    orig = type(io)._apply

    async def killing(tier: Any, ops: list) -> int:
        del io._apply  # once
        ray.kill(tier, no_restart=True)
        for _ in range(100):
            try:
                await tier.snapshot.remote()
            except rex.RayActorError:
                break
            await asyncio.sleep(0.1)
        return await orig(io, tier, ops)

    io._apply = killing


def _run_under(svc: Any, kill: Callable[[], None]) -> dict[str, str]:
    """One handle per public call, each with its own request and its pool bound, then
    ``kill``, then each call once: its outcome ("ok" or the raykv error's type)."""
    kv = svc.kv
    prepared = []
    for i, name in enumerate(_calls("", [])):
        rid = f"{name}-{time.monotonic_ns()}-{i}"
        h = kv.on(svc.head)
        assert h.admit(rid, len(IDS), IDS)
        table = h.allocate(rid, len(IDS), IDS)[0]
        prepared.append((name, h, _calls(rid, table)[name]))
    kill()
    got = {name: _outcome(call, h) for name, h, call in prepared}
    print(got)
    return got


@pytest.mark.ray
def test_each_member_killed_under_each_public_call_raises_only_raykv_errors(ray_cluster):
    svc = ray_cluster
    svc.kv.add_model("ce", LAYERS, **SETTINGS)
    head = svc.kv.on(svc.head)
    pool, tier = pool_name("ce", svc.head, 0), tier_name(svc.head)

    def answers(rid: str) -> bool:
        ok = head.admit(rid, len(IDS), IDS)
        head.free(rid)
        return ok

    def kill_pool() -> None:
        handle = ray.get_actor(pool, namespace=NAMESPACE)
        ray.kill(handle, no_restart=True)
        _wait("the pool dead", lambda: _dead(handle))

    got = _run_under(svc, kill_pool)
    coord_calls = {"add_model", "stats", "lookup"}
    # the pool's calls find it dead: each a ServiceError; the coordinator's answer
    assert got == {n: "ok" if n in coord_calls else "ServiceError" for n in got}, got
    _wait("a fresh pool", lambda: answers("p"))

    def kill_tier() -> None:
        actor = ray.get_actor(pool, namespace=NAMESPACE)
        ray.get(actor.__ray_call__.remote(_kill_tier_before_apply))

    old_tier = ray.get(ray.get_actor(tier, namespace=NAMESPACE).snapshot.remote())["actor_id"]
    got = _run_under(svc, kill_tier)
    # the store's offload found its tier dead: a miss later, not an error; the rest go on
    assert got == {n: "ok" for n in got}, got
    _wait("a fresh tier", lambda: _actor_id(tier) not in (None, old_tier) and answers("t"))

    def kill_coordinator() -> None:
        ray.kill(ray.get_actor(COORDINATOR, namespace=NAMESPACE), no_restart=False)

    got = _run_under(svc, kill_coordinator)
    assert not [o for o in got.values() if o.startswith("RAW")], got
    # calls to the coordinator wait for its restart (retry_s) and answer
    assert all(got[n] == "ok" for n in coord_calls), got
    _wait("the restarted coordinator", lambda: svc.kv.stats()["restarted"] and answers("c"))


def _dead(handle: Any) -> bool:
    try:
        ray.get(handle.snapshot.remote(), timeout=5)
    except rex.RayActorError:
        return True
    except rex.GetTimeoutError:
        pass
    return False


def _actor_id(name: str) -> str | None:
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
        return ray.get(actor.snapshot.remote(), timeout=5)["actor_id"]
    except (ValueError, rex.RayError):
        return None

"""``Client`` and ``AsyncClient`` share one definition of each operation (``_Operations`` in
``raykv.client``): the same operations, signatures and local argument checks (bad input
raises before any actor call, in both forms), and the actor method each one calls."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import numpy as np
import pytest

import raykv.client
from raykv.client import AsyncClient, Client, PoolCall, _Operations
from raykv.errors import InvalidInput

OPS = (
    "add_model",
    "stats",
    "lookup",
    "admit",
    "blocks_needed",
    "allocate",
    "store",
    "load",
    "read",
    "block_table",
    "free",
)


def test_both_forms_have_every_op_with_one_signature() -> None:
    for name in OPS:
        sync, aio = getattr(Client, name), getattr(AsyncClient, name)
        assert not inspect.iscoroutinefunction(sync)
        assert inspect.iscoroutinefunction(aio)
        assert inspect.signature(sync) == inspect.signature(aio)
        assert sync.__doc__ and sync.__doc__ == aio.__doc__
    assert inspect.signature(Client.store).return_annotation == "StoreResult"


def test_an_operation_reads_as_its_checks_and_its_actor_call() -> None:
    """What a reader (or an editor's "go to definition") finds behind ``Client.store``: one
    definition, checking the arguments and naming the pool method it calls, whose call
    carries the checked values (numpy ids as plain ints)."""
    source = inspect.getsource(Client.store)
    assert "def store(" in source and "check_block_ids(" in source
    assert "PoolCall(GpuPool.store," in source
    assert inspect.getsource(AsyncClient.store) == source
    call = vars(_Operations)["store"].build(Client(model="m"), "r", np.array([3, 4]), [])
    assert isinstance(call, PoolCall) and call.method.__name__ == "store"
    assert call.args == ("r", [3, 4], [], False) and type(call.args[1][0]) is int


def test_every_actor_method_the_client_names_is_one_of_the_actor() -> None:
    """In ``raykv.client`` ``GpuPool.x`` and ``Coordinator.x`` are names only (the actors'
    modules are not imported there): each must be a method of the real class, a pool's
    taking the client id first."""
    from raykv.service.control.coordinator import Coordinator
    from raykv.service.pool.gpu_pool import GpuPool

    actors = {"GpuPool": GpuPool, "Coordinator": Coordinator}
    tree = ast.parse(Path(raykv.client.__file__).read_text())
    named = {
        (node.value.id, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in actors
    }
    assert {("GpuPool", "store"), ("Coordinator", "lookup_packed")} <= named
    for actor, method in sorted(named):
        real = getattr(actors[actor], method, None)
        assert callable(real), f"{actor}.{method} is no method of {actor}"
        if actor == "GpuPool":
            assert list(inspect.signature(real).parameters)[1] == "client", method


class NoActorCall(AssertionError):
    pass


def _refuse(*_a: object, **_k: object) -> None:
    raise NoActorCall("an actor was called with bad input")


async def _arefuse(*_a: object, **_k: object) -> None:
    _refuse()


BAD = [
    ("admit", ("r", -1)),
    ("admit", (["unhashable"], 4)),
    ("allocate", ("r", 1.5)),
    ("blocks_needed", ("r", 2, [1, "x"])),
    ("store", ("r", [1.5], [])),
    ("load", ("r", [1, 2], [None])),
    ("read", ([1], "0")),
    ("block_table", ([1],)),
    ("free", ({},)),
]


@pytest.mark.parametrize(("name", "args"), BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_input_raises_locally_in_both_forms(name: str, args: tuple, monkeypatch) -> None:
    sync, aio = Client(model="m"), AsyncClient(model="m")
    for h, refuse in ((sync, _refuse), (aio, _arefuse)):
        monkeypatch.setattr(h, "_pool_call", refuse)
        monkeypatch.setattr(h, "_coord_call", refuse)
    with pytest.raises(InvalidInput):
        getattr(sync, name)(*args)
    with pytest.raises(InvalidInput):
        asyncio.run(getattr(aio, name)(*args))


def test_the_handle_keeps_its_client_id_in_every_form() -> None:
    import pickle

    c = Client(model="m", node_id="n1")
    for other in (
        c.aio,
        c.on("n2"),
        pickle.loads(pickle.dumps(c)),
        pickle.loads(pickle.dumps(c.aio)),
    ):
        assert other.client_id == c.client_id and other.model_name == "m"
    assert c.on("n2").node_id == "n2" and pickle.loads(pickle.dumps(c)).node_id == "n1"
    assert isinstance(c.aio, AsyncClient) and isinstance(c.aio.on(None), AsyncClient)

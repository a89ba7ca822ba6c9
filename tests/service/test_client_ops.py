"""``Client`` and ``AsyncClient`` come from one op table: the same operations, signatures and
local argument checks (bad input raises before any actor call, in both forms)."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from raykv.client import AsyncClient, Client
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

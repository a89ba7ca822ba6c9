"""A ``GpuPool`` driven in-process (no Ray): what happens when a call that awaited finds its
request freed and admitted again under the same id, and when a request's token ids change.
The coordinator and the transport are stand-ins that record what the pool publishes."""

import asyncio

import pytest
import ray
import torch
from kvdata import tokens

from raykv.errors import InvalidInput
from raykv.layout import FullAttention
from raykv.service.control.index import GPU, Located, Location
from raykv.service.pool.gpu_pool import GpuPool
from raykv.service.served import ServedModel
from raykv.tiers.checksum import row_checksums
from raykv.transport import OBJECT_STORE, BlockBatch

BS, ROW = 16, 2 * 16 * 1 * 16 * 4  # one layer: K,V x 16 tokens x 1 head x 16 x 4 bytes
ENGINE = "engine"  # the client id every call of these in-process pools comes from
LAYERS = {"l0": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16)}


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class FakeCoordinator:
    """Answers ``locate`` with one copy on another member; records every KV event."""

    def __init__(self) -> None:
        self.stored: list = []
        self.removed: list = []
        self.locate = _Method(self._locate)
        self.events = _Method(self._events)
        self.member_failed = _Method(self._ok)
        self.reserve = _Method(self._full)  # also the CPU tier: it has no room (no offloads)

    async def _full(self, *args):
        return None, None  # (arena, no reservation)

    async def _locate(self, model, hashes, node_id, reader=None):
        return Located([[Location("raykv-pool-elsewhere", "other-node", GPU)] for _ in hashes])

    async def _events(self, name, seq, model, keys, blocks, removed):
        self.stored += zip(keys, blocks, strict=True)
        self.removed += removed
        return True

    async def _ok(self, *args):
        return True


@pytest.fixture
def pool(monkeypatch):
    # 5 usable blocks: a 5-block request takes every block, so a re-admit reuses the freed ones
    model = ServedModel("u", LAYERS, max_model_len=5 * BS, pool_bytes=6 * ROW, cpu_bytes=4 * ROW)
    plan = model.plan(model.pool_bytes)
    assert plan.num_gpu_blocks == 6
    p = GpuPool("raykv-pool-u-test-0", model, plan, "this-node")
    p.coord = FakeCoordinator()
    monkeypatch.setattr(ray, "get_actor", lambda *a, **k: p.coord)
    return p


def test_a_load_whose_request_is_freed_and_readmitted_writes_and_publishes_nothing(pool) -> None:
    """The engine frees the request while its load's rows travel and admits the id again for
    another prompt: the blocks the load writes stay held until it ends (the new request is
    not admitted meanwhile: no room), and then nothing of the old prompt is published, valid
    or readable in the blocks the new request gets."""
    first, second = tokens(5 * BS, 1), tokens(5 * BS, 2)
    fetched = torch.full((1, 4, ROW), 7, dtype=torch.uint8)  # the first prompt's KV

    class RacingTransport:
        name = OBJECT_STORE

        async def stream(self, source, model, keys, endpoint=None, land=None, asked=None):
            # while the rows travel, the engine aborts "r" and reuses its id for a new prompt
            await pool.free(ENGINE, "r")
            race.append(await pool.admit(ENGINE, "r", len(second), second))
            sums = [list(row_checksums(fetched[0]))]
            yield BlockBatch(len(keys), fetched, tuple(tuple(c) for c in sums))

    async def run():
        assert await pool.admit(ENGINE, "r", len(first), first)
        table = (await pool.allocate(ENGINE, "r", len(first), first))[0]
        res = await pool.load(ENGINE, "r", first, into=table[:4])
        assert await pool.admit(ENGINE, "r", len(second), second)  # the load ended: room
        return table, res, (await pool.allocate(ENGINE, "r", len(second), second))[0]

    race: list = []
    pool.fetch.transports = {OBJECT_STORE: RacingTransport()}
    table, res, again = asyncio.run(run())
    assert race == [False]  # the load still held the freed request's blocks
    assert res["num_tokens"] == 0 and res["loaded_blocks"] == 0
    assert set(again) & set(table[:4]), "the new request must have reused the freed blocks"
    # the new request's blocks never got the first prompt's bytes, and nothing became a hit
    assert not (pool.local.gather(0, again) == 7).all(dim=1).any()
    assert pool.coord.stored == [] and pool.requests.valid == {}


def test_token_ids_that_disagree_with_the_requests_are_refused(pool) -> None:
    ids = tokens(3 * BS, 3)

    async def run():
        assert await pool.admit(ENGINE, "t", len(ids), ids)
        table = (await pool.allocate(ENGINE, "t", 2 * BS, ids[: 2 * BS]))[0]
        other = list(ids)
        other[5] += 1
        with pytest.raises(InvalidInput, match="differ at position 5"):
            await pool.allocate(ENGINE, "t", BS, other)
        with pytest.raises(InvalidInput, match="differ at position 5"):
            await pool.load(ENGINE, "t", other, into=table[:1])
        assert await pool.block_table(ENGINE, "t") == [table]
        assert (
            await pool.allocate(ENGINE, "t", BS, ids)
        ) is not None  # the same tokens, grown: fine

    asyncio.run(run())


def test_a_store_into_a_reused_block_publishes_the_old_key_as_removed(pool) -> None:
    """Blocks evicted to make a step fit leave the index, exactly once, with their keys."""
    a, b = tokens(5 * BS, 4), tokens(5 * BS, 5)

    async def run():
        assert await pool.admit(ENGINE, "a", len(a), a)
        ta = (await pool.allocate(ENGINE, "a", len(a), a))[0]
        assert await pool.store(ENGINE, "a", ta, torch.ones((5, ROW), dtype=torch.uint8)) == 5
        keys = [k for k, _ in pool.coord.stored]
        await pool.free(ENGINE, "a")
        assert await pool.admit(ENGINE, "b", len(b), b)
        await pool.allocate(ENGINE, "b", len(b), b)  # takes every block: a's are evicted
        return keys

    keys = asyncio.run(run())
    assert sorted(pool.coord.removed) == sorted(keys) and pool.requests.valid == {}
    # an index that still points here (a lost event, a restarted coordinator) gets a miss,
    # never the bytes b wrote into those blocks
    assert asyncio.run(pool.export_blocks("u", keys))[0] == 0

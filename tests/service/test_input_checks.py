"""Caller input, without Ray: the one check per concept (``raykv.api``) that the client runs
once per call, what the pool checks itself (ownership, its plan's limits), and the rule that
published blocks are immutable, on a ``GpuPool`` driven in-process (issue 8, points 5-7;
issue 46, item 3; the cluster tests are in ``test_input_cluster.py``)."""

import asyncio
import operator

import numpy as np
import pytest
import ray
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from raykv.api import (
    StoreResult,
    check_admit,
    check_block_ids,
    check_count,
    check_int,
    check_request_id,
    check_token_ids,
    token_id_array,
)
from raykv.errors import AccessDenied, InvalidInput
from raykv.layout import FullAttention
from raykv.service.pool.gpu_pool import GpuPool
from raykv.service.served import ServedModel

BS, ROW = 16, 2 * 16 * 1 * 16 * 4  # one layer: K,V x 16 tokens x 1 head x 16 x 4 bytes
ENGINE = "engine"  # the client id every call of these in-process pools comes from
LAYERS = {"l0": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16)}


def _is_int(x: object) -> bool:
    return (type(x) is int) or isinstance(x, np.integer)


# anything a caller might pass where an integer is expected
values = st.one_of(
    st.integers(-(2**40), 2**40),
    st.booleans(),
    st.booleans().map(np.bool_),
    st.floats(allow_nan=True),
    st.integers(-1000, 1000).map(float),  # 3.0: still no id
    st.integers(0, 2**31 - 1).map(np.int64),
    st.integers(0, 255).map(np.uint8),
    st.integers(-1000, 1000).map(np.float64),
    st.integers(0, 1000).map(str),
    st.text(max_size=5),
    st.none(),
    st.integers(0, 9).map(lambda i: [i]),
    st.integers(0, 9).map(lambda i: {i: i}),
    st.integers(0, 9).map(lambda i: torch.tensor(i)),
    st.integers(0, 9).map(lambda i: torch.tensor(float(i))),
    st.booleans().map(torch.tensor),
)


def _torch_int(x: object) -> bool:
    return isinstance(x, torch.Tensor) and not x.dtype.is_floating_point and x.dtype != torch.bool


@given(values)
def test_check_int_accepts_exactly_the_integers(value) -> None:
    if _is_int(value) or _torch_int(value):
        out = check_int(value, "block ids", "the fix")
        assert type(out) is int and out == operator.index(value)
    else:
        with pytest.raises(InvalidInput) as e:
            check_int(value, "block ids", "the fix")
        msg = str(e.value)
        assert msg.startswith("block ids must be an integer, got ")
        assert repr(value)[:40] in msg and type(value).__name__ in msg and "the fix" in msg


@given(values)
def test_check_count_takes_integers_at_least_zero(value) -> None:
    if (_is_int(value) or _torch_int(value)) and operator.index(value) >= 0:
        assert check_count(value, "num_tokens") == operator.index(value)
    else:
        with pytest.raises(InvalidInput, match="num_tokens must be"):
            check_count(value, "num_tokens")


@given(st.lists(values, max_size=6))
def test_check_token_ids_accepts_exactly_lists_of_non_negative_integers(ids) -> None:
    good = all((_is_int(t) or _torch_int(t)) and operator.index(t) >= 0 for t in ids)
    if good:
        assert check_token_ids(ids, 6, "m") == [operator.index(t) for t in ids]
        assert check_token_ids(tuple(ids)) == [operator.index(t) for t in ids]
    else:
        with pytest.raises(InvalidInput) as e:
            check_token_ids(ids, 6, "m")
        bad = (
            next((i, t) for i, t in enumerate(ids) if not (_is_int(t) or _torch_int(t)))
            if not all(_is_int(t) or _torch_int(t) for t in ids)
            else None
        )
        if bad is not None:  # the first offending id is named, with its position
            assert f"token id at position {bad[0]} must be an integer" in str(e.value)
            assert repr(bad[1])[:40] in str(e.value)
        else:
            assert "must be >= 0" in str(e.value)


def _outcome(fn, *args):
    try:
        return fn(*args)
    except InvalidInput as e:
        return InvalidInput, str(e)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.lists(values, max_size=6),
        # mostly good ids, sometimes 0/1 (where a bool may hide), a bad one anywhere
        st.lists(
            st.one_of(st.integers(0, 2**20), st.sampled_from([0, 1, True, False])), max_size=40
        ),
        st.lists(st.integers(0, 2**65), max_size=6),
        st.lists(st.integers(-3, 3), max_size=6).map(np.array),
        st.lists(st.integers(0, 2**64 - 1), max_size=6).map(lambda x: np.array(x, np.uint64)),
    ),
    st.one_of(st.none(), st.integers(0, 8)),
)
def test_token_id_array_checks_as_check_token_ids_does(ids, max_len) -> None:
    """The lookup's fast check is ``check_token_ids`` then the hasher's int64 range: the
    same ids (as one uint32 array for a list whose ids all fit, else int64) or the same
    InvalidInput message."""
    got = _outcome(token_id_array, ids, max_len, "m")
    want = _outcome(check_token_ids, ids, max_len, "m")
    if isinstance(want, tuple):
        assert got == want
    elif any(t >= 2**63 for t in want):  # an id past int64 cannot be hashed
        assert isinstance(got, tuple) and "int64 range" in got[1]
    else:
        narrow = isinstance(ids, list) and all(0 <= t < 2**32 for t in want)
        assert got.dtype == (np.uint32 if narrow else np.int64) and got.tolist() == want


@pytest.mark.parametrize(
    "token_ids, match",
    [
        ([1, True, 3], r"position 1 must be an integer, got True \(bool\)"),
        ({1: 2, 3: 4}, r"sequence of integers, got \{1: 2, 3: 4\} \(dict\)"),
        ({1, 2}, r"got \{1, 2\} \(set\)"),
        ("123", r"got '123' \(str\)"),
        (b"\x01\x02", r"\(bytes\)"),
        (7, r"got 7 \(int\)"),
        (np.ones(3), "integer dtype, got float64"),
        (np.ones(3, dtype=bool), "integer dtype, got bool"),
        (torch.ones(3, dtype=torch.bool), "integer dtype, got torch.bool"),
        ([1, 2.5], r"position 1 must be an integer, got 2.5 \(float\)"),
        ([np.float32(1)], r"position 0 .* \(float32\)"),
    ],
)
def test_bad_token_ids_are_refused_with_the_value_and_the_fix(token_ids, match) -> None:
    with pytest.raises(InvalidInput, match=match) as e:
        check_token_ids(token_ids)
    assert "integer" in str(e.value)


def test_integer_arrays_and_numpy_scalars_are_token_ids() -> None:
    assert check_token_ids(np.arange(4)) == [0, 1, 2, 3]
    assert check_token_ids(torch.arange(3, dtype=torch.int32)) == [0, 1, 2]
    assert check_token_ids([np.int64(5), 6, np.uint16(7)]) == [5, 6, 7]
    assert check_token_ids(range(3)) == [0, 1, 2]


@given(
    st.one_of(
        st.lists(values, max_size=4),
        st.lists(st.lists(values, max_size=3), min_size=1, max_size=3),
    )
)
def test_check_block_ids_keeps_the_shape_and_refuses_non_integers(ids) -> None:
    flat = [b for t in ids for b in (t if isinstance(t, list) else [t])]
    mixed = any(isinstance(t, list) for t in ids) and not all(isinstance(t, list) for t in ids)
    if all(_is_int(b) or _torch_int(b) for b in flat) and not mixed:
        out = check_block_ids(ids)
        assert out == [
            [operator.index(b) for b in t] if isinstance(t, list) else operator.index(t)
            for t in ids
        ]
    else:
        with pytest.raises(InvalidInput, match="block ids"):
            check_block_ids(ids)


@pytest.mark.parametrize("rid", [["r"], {"r": 1}, {"r"}, bytearray(b"r")])
def test_unhashable_request_ids_are_refused(rid) -> None:
    with pytest.raises(InvalidInput, match=r"is not hashable; use a str or an int") as e:
        check_request_id(rid)
    assert repr(rid) in str(e.value)
    for ok in ("r", 3, ("a", 1), np.int64(2)):
        assert check_request_id(ok) is ok


def test_store_result_is_the_published_count_and_pickles() -> None:
    import pickle

    r = StoreResult(3, 4, [[7]])
    assert r == 3 and r.published == 3 and r.written == 4 and r.num_skipped == 1
    assert f"{r} {r:>2}" == "3  3" and "skipped=[[7]]" in repr(r)
    back = pickle.loads(pickle.dumps(r))
    assert (back, back.written, back.skipped) == (3, 4, [[7]])


# --- published blocks are immutable (in-process pool) ----------------------------------


def _pool(monkeypatch) -> GpuPool:
    def no_actor(*a, **k):  # no coordinator, no CPU tier: publishing is a no-op
        raise ValueError("no actor in this test")

    monkeypatch.setattr(ray, "get_actor", no_actor)
    model = ServedModel("u", LAYERS, max_model_len=5 * BS, pool_bytes=12 * ROW, cpu_bytes=4 * ROW)
    return GpuPool("raykv-pool-u-test-0", model, model.plan(model.pool_bytes), "this-node")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 30000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BASE = _tokens(5 * BS, 1)
# prompts that share 0..5 leading blocks with BASE (and with each other)
PROMPTS = [BASE, BASE[: 4 * BS] + _tokens(BS, 2), BASE[: 2 * BS] + _tokens(3 * BS - 5, 3)]
PROMPTS += [_tokens(3 * BS, 4), BASE[: 3 * BS]]


def _rows(n: int, seed: int) -> torch.Tensor:
    return ((torch.arange(n) * 31 + seed) % 256).to(torch.uint8)[:, None].expand(n, ROW).clone()


ops = st.lists(
    st.tuples(
        st.sampled_from(["step", "step", "store", "free"]),
        st.integers(0, 3),  # request
        st.integers(0, len(PROMPTS) - 1),  # prompt (a new request) / rows seed
        st.integers(0, 5),  # blocks stored (a prefix of the table)
    ),
    max_size=25,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops)
def test_published_bytes_never_change(monkeypatch, ops) -> None:
    """Random admit / allocate / store / free of requests sharing prefixes: a block valid
    (published) before a call holds the same bytes after it, stores skip exactly the
    published blocks and report them, and every other block they name gets its row."""
    pool = _pool(monkeypatch)
    prompt: dict[int, list[int]] = {}
    tables: dict[int, list[int]] = {}
    skips: list[int] = []

    def published() -> dict[bytes, tuple[int, torch.Tensor]]:
        return {
            k: (b, pool.local.gather(0, [b])[0].clone()) for k, b in pool.requests.valid.items()
        }

    async def run() -> None:
        for op, r, x, n in ops:
            before = published()
            if op == "step" and r not in prompt:  # an engine's first step: admit, allocate
                if await pool.admit(ENGINE, r, len(PROMPTS[x]), PROMPTS[x]):
                    prompt[r] = PROMPTS[x]
                    new = await pool.allocate(ENGINE, r, len(prompt[r]), prompt[r])
                    if new is not None:
                        tables[r] = new[0]
                op = "store"  # and store what it computed
            if op == "store" and r in tables:
                ids = tables[r][:n]
                immutable = [b for b in ids if b in pool.requests.key_of]
                data = _rows(len(ids), x)
                res = await pool.store(ENGINE, r, ids, data)
                skips.append(res.num_skipped)
                assert res.skipped == [immutable] and res.written == len(ids) - len(immutable)
                for j, b in enumerate(ids):
                    if b not in immutable:
                        assert torch.equal(pool.local.gather(0, [b])[0], data[j])
            elif op == "free" and r in prompt:
                await pool.free(ENGINE, r)
                del prompt[r]
                tables.pop(r, None)
            after = published()
            for key, (b, data) in before.items():
                if key in after and after[key][0] == b:
                    assert torch.equal(after[key][1], data), (op, r, b)
            # a block handed to a request is valid only while its owner's position key is
            for k, (b, _) in after.items():
                assert pool.requests.key_of[b] == k

    asyncio.run(run())
    event(f"stores skipping published blocks: {min(sum(map(bool, skips)), 3)}+")


def test_a_second_request_sharing_a_prefix_cannot_overwrite_it(monkeypatch) -> None:
    """Issue 8 point 5 on one pool: a2 shares a1's first four blocks through a prefix hit;
    its store skips them (reported), writes its private fifth block, publishes nothing."""
    pool = _pool(monkeypatch)
    p = BASE
    x, y = _rows(5, 1), _rows(5, 200)

    async def run() -> None:
        assert await pool.admit(ENGINE, "a1", 80, p)
        t1 = (await pool.allocate(ENGINE, "a1", 80, p))[0]
        first = await pool.store(ENGINE, "a1", t1[:5], x)
        assert (first, first.written, first.skipped) == (5, 5, [[]])
        assert await pool.admit(ENGINE, "a2", 80, p)
        t2 = (await pool.allocate(ENGINE, "a2", 80, p))[0]
        assert t2[:4] == t1[:4] and t2[4] != t1[4]
        res = await pool.store(ENGINE, "a2", t2[:5], y)
        assert (res, res.written, res.skipped) == (0, 1, [t1[:4]])
        assert torch.equal(pool.local.gather(0, t1[:5]), x)
        assert torch.equal(pool.local.gather(0, [t2[4]]), y[4:])  # private, unpublished
        assert t2[4] not in pool.requests.key_of
        again = await pool.store(ENGINE, "a1", t1[:5], y)  # the owner cannot rewrite them either
        assert (again, again.written, again.skipped) == (0, 0, [t1[:5]])
        assert torch.equal(pool.local.gather(0, t1[:5]), x)

    asyncio.run(run())


# --- issue 44, item 5: questionable inputs that used to pass --------------------------


def test_request_id_none_is_refused() -> None:
    """None is what a forgotten id looks like: it names no request (every op refuses it)."""
    with pytest.raises(InvalidInput, match=r"^request id None names no request; use a str or"):
        check_request_id(None)


@pytest.mark.parametrize(
    "num_tokens, ids, match",
    [
        (10, 64, r"^admit got num_tokens=10 but 64 token ids; the count is the request's size"),
        (63, 64, r"num_tokens=63 but 64 token ids"),
        (0, 1, r"num_tokens=0 but 1 token ids"),
        (0, 0, r"^admit got an empty request \(num_tokens=0 and no token ids\); a request has"),
        (0, None, r"empty request"),
    ],
)
def test_admit_refuses_a_count_below_its_prompt_and_an_empty_request(num_tokens, ids, match):
    prompt = None if ids is None else list(range(ids))
    with pytest.raises(InvalidInput, match=match) as e:
        check_admit(num_tokens, prompt)
    assert "admit(request_id, len(prompt), prompt)" in str(e.value)  # the fix


def test_admit_takes_a_count_of_its_prompt_or_more() -> None:
    """A count above the prompt reserves the steps after it (e.g. ``len(prompt) + 1`` for
    the first decode token); the count alone (no ids) admits by size."""
    for n, ids in ((64, list(range(64))), (65, list(range(64))), (1, None), (7, [3])):
        check_admit(n, ids)


@pytest.mark.parametrize(
    "args, match",
    [
        (("r", 10, BASE[:64]), "num_tokens=10 but 64 token ids"),
        (("r", 0, []), "empty request"),
        (("r", 0), "empty request"),
        ((None, 64, BASE[:64]), "request id None names no request"),
    ],
)
def test_the_client_refuses_them_and_calls_no_actor(monkeypatch, args, match) -> None:
    """The client refuses them before any call (the pool trusts its checks); the same
    prompt admitted properly then runs on the pool (allocate no longer returns [[]])."""
    from raykv.client import Client

    def no_call(*_a: object, **_k: object) -> None:
        raise AssertionError("the client called an actor with bad input")

    kv = Client(model="u")
    monkeypatch.setattr(kv, "_pool_call", no_call)
    monkeypatch.setattr(kv, "_coord_call", no_call)
    with pytest.raises(InvalidInput, match=match):
        kv.admit(*args)
    pool = _pool(monkeypatch)

    async def run() -> None:
        assert await pool.admit(ENGINE, "ok", 64, BASE[:64])
        assert [len(t) for t in await pool.allocate(ENGINE, "ok", 64, BASE[:64])] == [4]

    asyncio.run(run())


def test_the_pool_checks_ownership_and_its_plans_limits(monkeypatch) -> None:
    """What the pool checks itself, on arguments of the forms the client sends: another
    client's request is refused (AccessDenied); a look-alike of one of the request's block
    ids (3.0, numpy's 3, True for 1) is no id of it; token ids past max_model_len and a rank
    past tp_size are refused. Nothing changes."""
    pool = _pool(monkeypatch)

    async def run() -> None:
        assert await pool.admit(ENGINE, "r", 64, BASE[:64])
        table = (await pool.allocate(ENGINE, "r", 64, BASE[:64]))[0]
        free, tokens = pool.bm.num_free_blocks, list(pool.requests.tokens["r"])
        for call in (pool.free, pool.block_table):
            with pytest.raises(AccessDenied, match="admitted by another client"):
                await call("stranger", "r")
        lookalikes = [float(table[0]), np.int64(table[0])] + ([True] if 1 in table else [])
        for b in lookalikes:
            with pytest.raises(InvalidInput, match=r"not in request 'r'.s block table"):
                await pool.store(ENGINE, "r", [b], _rows(1, 0))
            with pytest.raises(InvalidInput, match="out of range"):
                await pool.read(ENGINE, [b])
        with pytest.raises(InvalidInput, match=r"exceed model 'u'.s max_model_len=80"):
            await pool.allocate(ENGINE, "r", 16, BASE + _tokens(16, 9))
        with pytest.raises(InvalidInput, match="rank 1 is outside tp_size=1"):
            await pool.read(ENGINE, table, 1)
        assert pool.bm.num_free_blocks == free and pool.requests.tokens["r"] == tokens
        assert not pool.requests.valid and await pool.block_table(ENGINE, "r") == [table]

    asyncio.run(run())

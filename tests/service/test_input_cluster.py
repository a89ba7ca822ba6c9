"""Issue 8, points 5-7, on a 2-node local Ray cluster (every node on 127.0.0.1):

5. a request sharing published blocks through a prefix hit cannot overwrite them;
6. block ids that are not integers are refused, never truncated;
7. bad request ids, token counts and token ids raise a raykv error naming the value and the
   fix, from the client before any actor call, with the pool unchanged. (The pool trusts the
   client's checks, issue 46 item 3: what it checks itself, ownership and its plan's limits,
   is in ``test_input_checks.py``.)
"""

import time
from types import SimpleNamespace

import numpy as np
import pytest
import ray
import torch
from kvdata import ROW, rows, tokens

from raykv.errors import InvalidInput, UnknownRequest
from raykv.layout import FullAttention
from raykv.service.served import NAMESPACE, pool_name

pytestmark = pytest.mark.ray

RAY_WORKERS = 1  # the head and one worker
LAYERS = {f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)}


@pytest.fixture(scope="module")
def svc(ray_cluster):
    kv = ray_cluster.kv
    kv.add_model("i", LAYERS, max_model_len=256, pool_bytes=40 * ROW, cpu_bytes=16 * ROW)
    a, b = kv.on(ray_cluster.ids[0]), kv.on(ray_cluster.head)
    pool = ray.get_actor(pool_name("i", ray_cluster.ids[0], 0), namespace=NAMESPACE)
    # a live request on A whose blocks, bytes and table every refused call must leave alone
    p = tokens(64, 100)
    assert a.admit("base", 64, p)
    table = a.allocate("base", 32, p[:32])[0]
    assert a.store("base", table, rows(2, 100)) == 2
    return SimpleNamespace(**vars(ray_cluster), a=a, b=b, pool=pool, p=p, table=table)


def pool_state(svc) -> tuple:
    """Free blocks, valid blocks, requests, base's table and bytes, read from the pool."""
    s = ray.get(svc.pool.get_stats.remote())
    table = svc.a.block_table("base")
    data = svc.a.read(table[0]).numpy().tobytes()
    return s["blocks_total"] - s["blocks_used"], s["blocks_valid"], s["requests"], table, data


# --- 5: published blocks are immutable ---------------------------------------------------


def test_a_request_sharing_published_blocks_cannot_overwrite_them(svc) -> None:
    a, b = svc.a, svc.b
    p = tokens(80, 5)
    x, y = rows(5, 51), rows(5, 52)
    assert a.admit("a1", 80, p)
    t1 = a.allocate("a1", 80, p)[0]
    first = a.store("a1", t1[:5], x)
    assert (first, first.written, first.skipped) == (5, 5, [[]])
    assert a.admit("a2", 80, p)
    t2 = a.allocate("a2", 80, p)[0]
    assert t2[:4] == t1[:4] and t2[4] != t1[4]  # a prefix hit never covers the last token
    second = a.store("a2", t2[:5], y)
    # the shared, published blocks are skipped and reported; a2's fifth block is its own
    # (a duplicate of t1[4]'s prefix, not cached): written, not published
    assert (second, second.written, second.skipped) == (0, 1, [t1[:4]])
    assert torch.equal(a.read(t1[:5]), x)  # exactly X, byte for byte
    assert torch.equal(a.read(t2[:5]), torch.cat([x[:4], y[4:]]))
    again = a.store("a1", t1[:5], y)  # nor can their owner rewrite them
    assert (again, again.written, again.skipped) == (0, 0, [t1[:5]])
    assert torch.equal(a.read(t1[:5]), x)
    # another node loads the prefix: X's bytes, not a mix
    assert b.lookup(p).hit_tokens == 64
    assert b.admit("b1", 80, p)
    tb = b.allocate("b1", 80, p)[0]
    res = b.load("b1", p, into=tb[:5])
    assert res.loaded_blocks == 5 and res.bytes == 5 * ROW
    assert torch.equal(b.read(tb[:5]), x)
    for rid in ("a1", "a2"):
        a.free(rid)
    b.free("b1")
    assert torch.equal(a.read(t1[:5]), x)  # freed: cached, still X


# --- 6 and 7: bad input, refused by the client ------------------------------------------


class PoolCalled(AssertionError):
    pass


def call(svc, monkeypatch, method: str, *args):
    """``method`` through the client, which must refuse before calling the pool."""

    def no_pool_call(*a, **k):
        raise PoolCalled(f"the client called the pool's {method} with bad input")

    monkeypatch.setattr(svc.a, "_pool_call", no_pool_call)
    return getattr(svc.a, method)(*args)


BAD_BLOCK_IDS = {  # name: (block ids from base's table, text the error must show)
    "half": (lambda t: [t[1] - 0.5], lambda t: f"got {t[1] - 0.5} (float)"),
    "float": (lambda t: [float(t[1])], lambda t: f"got {float(t[1])} (float)"),
    "np.float64": (lambda t: [np.float64(t[1])], lambda t: f"got {np.float64(t[1])!r}"),
    "bool": (lambda t: [True], lambda t: "got True (bool)"),
    "str": (lambda t: [str(t[1])], lambda t: f"got {str(t[1])!r} (str)"),
    "None": (lambda t: [t[0], None], lambda t: "got None (NoneType)"),
    "per group": (lambda t: [[t[0], t[1] + 0.5]], lambda t: f"got {t[1] + 0.5} (float)"),
    "not a list": (lambda t: t[0] + 0.5, lambda t: f"got {t[0] + 0.5} (float)"),
}


@pytest.mark.parametrize("op", ["store", "read", "load"])
@pytest.mark.parametrize("case", list(BAD_BLOCK_IDS))
def test_non_integer_block_ids_are_refused_not_truncated(svc, monkeypatch, op, case):
    make, shown = BAD_BLOCK_IDS[case]
    t = svc.table
    bad = make(t)
    before = pool_state(svc)
    args = {
        "store": ("base", bad, rows(1, 9)),
        "read": (bad,),
        "load": ("base", svc.p[:32], bad),
    }[op]
    with pytest.raises(InvalidInput, match="block ids") as e:
        call(svc, monkeypatch, op, *args)
    assert shown(t) in str(e.value) and "allocate" in str(e.value)  # the value and the fix
    monkeypatch.undo()
    assert pool_state(svc) == before


def test_integer_block_ids_of_numpy_and_torch_are_taken(svc) -> None:
    t = svc.table
    want = svc.a.read(t)
    assert torch.equal(svc.a.read(np.array(t)), want)
    assert torch.equal(svc.a.read([np.int64(t[0]), torch.tensor(t[1])]), want)


P10, P64 = tokens(10, 7), tokens(64, 3)
ROW1 = np.zeros((1, ROW), np.uint8)
BAD_CALLS = {  # name: (method, args, text the error must show, request it must not admit)
    "unhashable rid (admit)": ("admit", (["r"], 10, P10), "request id ['r'] (list)", None),
    "unhashable rid (allocate)": ("allocate", ({"r": 1}, 16), "request id {'r': 1}", None),
    "unhashable rid (needed)": ("blocks_needed", ({"r"}, 16), "request id {'r'} (set)", None),
    "unhashable rid (free)": ("free", (["base"],), "request id ['base'] (list)", None),
    "unhashable rid (table)": ("block_table", (["base"],), "request id ['base']", None),
    "num_tokens str": ("admit", ("n1", "10", P10), "num_tokens must be an integer, got '10'", "n1"),
    "num_tokens None": ("admit", ("n2", None, P10), "got None (NoneType)", "n2"),
    "num_tokens float": ("admit", ("n3", 10.5, P10), "got 10.5 (float)", "n3"),
    "num_tokens bool": ("admit", ("n4", True, P10), "got True (bool)", "n4"),
    "num_tokens np.float": ("admit", ("n5", np.float64(10), P10), "(float64)", "n5"),
    "num_tokens < 0": ("admit", ("n6", -1, P10), "num_tokens must be >= 0, got -1", "n6"),
    "allocate 2.5": ("allocate", ("base", 2.5), "num_new_tokens must be an integer, got 2.5", None),
    "allocate str": ("allocate", ("base", "16"), "got '16' (str)", None),
    "needed None": ("blocks_needed", ("base", None), "num_new_tokens must be an integer", None),
    "bool token ids": ("admit", ("n7", 2, [True, False]), "position 0 must be an integer", "n7"),
    "dict token ids": ("admit", ("n8", 2, {1: 2, 3: 4}), "got {1: 2, 3: 4} (dict)", "n8"),
    "float array ids": ("admit", ("n9", 3, np.ones(3)), "integer dtype, got float64", "n9"),
    "str token ids": ("admit", ("n10", 3, "abc"), "got 'abc' (str)", "n10"),
    "bool in allocate": ("allocate", ("base", 16, [*tokens(64, 100)[:47], True]), "got True", None),
    "dict in load": ("load", ("base", {1: 2}, []), "(dict)", None),
    # issue 44, item 5: a count below the prompt, an empty request, request id None
    "count below prompt": ("admit", ("c1", 10, P64), "num_tokens=10 but 64 token ids", "c1"),
    "empty prompt": ("admit", ("c2", 0, []), "admit got an empty request", "c2"),
    "empty count": ("admit", ("c3", 0), "admit got an empty request", "c3"),
    "rid None (admit)": ("admit", (None, 10, P10), "request id None names no request", None),
    "rid None (allocate)": ("allocate", (None, 16), "request id None", None),
    "rid None (needed)": ("blocks_needed", (None, 16), "request id None", None),
    "rid None (store)": ("store", (None, [1], ROW1), "request id None", None),
    "rid None (load)": ("load", (None, P10, [1]), "request id None", None),
    "rid None (table)": ("block_table", (None,), "request id None", None),
    "rid None (free)": ("free", (None,), "request id None", None),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_request_ids_counts_and_token_ids_get_a_raykv_error(svc, monkeypatch, case):
    method, args, shown, rid = BAD_CALLS[case]
    before = pool_state(svc)
    with pytest.raises(InvalidInput) as e:
        call(svc, monkeypatch, method, *args)
    msg = str(e.value)
    assert shown in msg, msg
    assert any(fix in msg for fix in ("use a str or an int", "pass ", "(e.g.")), msg
    monkeypatch.undo()
    assert pool_state(svc) == before
    if rid is not None:  # nothing was admitted under it
        with pytest.raises(UnknownRequest):
            svc.a.block_table(rid)


def test_numpy_integers_are_counts_and_token_ids(svc) -> None:
    a = svc.a
    p = np.array(tokens(40, 8), dtype=np.int64)
    assert a.admit("np", np.int64(40), p)
    assert a.blocks_needed("np", np.int32(40), p) == 3
    table = a.allocate("np", np.int64(40), torch.from_numpy(p))[0]
    assert len(table) == 3 and a.block_table("np") == [table]
    a.free("np")


# --- issue 44, item 1: a refused add_model leaves nothing ------------------------------

ISSUE_SIZES = {  # add_model settings the issue found accepted, and what the error shows
    "pool nan": ({"pool_bytes": float("nan")}, "pool_bytes must be an integer >= 0, got nan"),
    "pool inf": ({"pool_bytes": float("inf")}, "pool_bytes must be an integer >= 0, got inf"),
    "cpu inf": ({"cpu_bytes": float("inf")}, "cpu_bytes must be an integer >= 0, got inf"),
    "pool half": ({"pool_bytes": 24 * 4096 + 0.5}, "got 98304.5 (float)"),
    "pool True": ({"pool_bytes": True}, "pool_bytes must be an integer >= 0, got True (bool)"),
    "tp float": ({"tp_size": 1.0}, "tp_size must be a positive integer, got 1.0 (float)"),
    "no such setting": ({"pool_byte": 1 << 20}, "add_model has no setting 'pool_byte'"),
}


@pytest.mark.parametrize("case", list(ISSUE_SIZES))
def test_add_model_refuses_bad_sizes_on_the_client(svc, monkeypatch, case) -> None:
    """ConfigError before any coordinator call: nothing is registered or placed."""
    from raykv.errors import ConfigError

    settings, shown = ISSUE_SIZES[case]
    before = svc.kv.stats()["models"]
    kv = svc.kv.on(None)

    def no_call(*a, **k):
        raise PoolCalled("the client called the coordinator with bad settings")

    monkeypatch.setattr(kv, "_coord_call", no_call)
    settings = {"pool_bytes": 40 * ROW, **settings}
    with pytest.raises(ConfigError) as e:
        kv.add_model("bad", LAYERS, max_model_len=256, **settings)
    assert shown in str(e.value) and "pass " in str(e.value), str(e.value)
    monkeypatch.undo()
    assert svc.kv.stats()["models"] == before


def test_too_few_pool_bytes_are_shown_in_bytes_not_rounded_to_0_mib(svc) -> None:
    from raykv.errors import InsufficientMemoryError

    with pytest.raises(InsufficientMemoryError) as e:
        svc.kv.add_model("tiny", LAYERS, max_model_len=256, pool_bytes=1)
    msg, need = str(e.value), e.value.need_bytes
    assert need == 17 * ROW and "0 MiB" not in msg, msg  # 16 blocks + the null block
    assert f"needs {need} bytes of KV per pool" in msg and "hold 1 byte of host" in msg, msg
    assert f"pool_bytes={need} in add_model" in msg, msg
    assert "tiny" not in svc.kv.stats()["models"]


def test_a_model_whose_pools_cannot_start_is_not_added(svc) -> None:
    """All or nothing: ServiceError naming the pool and why; no plan, no pools, no tier arena
    left and no placing it again; once the cause is fixed it is added as any model."""
    from raykv.errors import ServiceError
    from raykv.service.served import COORDINATOR, tier_name

    def break_pools(self) -> None:  # (runs in the coordinator: pickled by value, as a closure)
        """The pools of "broken" die in their constructor (a GpuPool given a TP-2 plan and
        no rank 1), as the issue's pool_bytes=nan pools did."""
        import dataclasses

        placer, cls = self.placer, type(self.placer)

        async def broken(m, plan, nid, index, num_gpus):
            if m.name == "broken":
                plan = dataclasses.replace(plan, tp_size=2)
            return await cls._place_group(placer, m, plan, nid, index, num_gpus)

        placer._place_group = broken

    def mend_pools(self) -> None:
        self.placer.__dict__.pop("_place_group", None)

    kv = svc.kv
    coord = ray.get_actor(COORDINATOR, namespace=NAMESPACE)
    ray.get(coord.__ray_call__.remote(break_pools))
    try:
        with pytest.raises(ServiceError) as e:
            kv.add_model("broken", LAYERS, max_model_len=256, pool_bytes=40 * ROW)
    finally:
        ray.get(coord.__ray_call__.remote(mend_pools))
    msg = str(e.value)
    assert msg.startswith("model 'broken' was not added: raykv-pool-broken-"), msg
    assert "(and 1 more of its pools) could not start" in msg, msg  # one per node
    assert "needs 1 other ranks, got 0" in msg and "add it again" in msg, msg

    s = kv.stats()
    assert "broken" not in s["models"]
    assert not [m for m in s["members"] if m.get("model") == "broken"]
    with pytest.raises(ray.exceptions.RayTaskError, match="unknown model 'broken'"):
        ray.get(coord.get_model.remote("broken"))
    for node in (svc.head, svc.ids[0]):  # no arena of it in any tier
        tier = ray.get_actor(tier_name(node), namespace=NAMESPACE)
        assert "broken" not in ray.get(tier.snapshot.remote())["stats"]["per_model"]
    deadline = time.monotonic() + 10  # the killed pools' names are released
    while time.monotonic() < deadline and any(
        a["name"].startswith("raykv-pool-broken-")
        for a in ray.util.list_named_actors(all_namespaces=True)
    ):
        time.sleep(0.2)
    named = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    assert not [n for n in named if "broken" in n], named
    # and the coordinator stops placing it: nothing expected, no failed re-placements
    failures = kv.stats()["failures"].get("replace", 0)
    time.sleep(3.5)
    assert kv.stats()["failures"].get("replace", 0) == failures
    expected = ray.get(coord.__ray_call__.remote(lambda self: list(self.placer.expected)))
    assert not [n for n in expected if "broken" in n], expected

    # fixed: the same name is added, placed and served
    plan = kv.add_model("broken", LAYERS, max_model_len=256, pool_bytes=40 * ROW)
    assert plan.num_gpu_blocks == 40 and "broken" in kv.stats()["models"]
    c = kv.on(svc.ids[0])
    p = tokens(32, 44)
    assert c.admit("w", 32, p) and c.allocate("w", 32, p) is not None
    c.free("w")

"""The coordinator's lookup over the one prefix index, without Ray: the same answer as the
managers' own rule with every copy ranked from the caller's node."""

from __future__ import annotations

import asyncio
import pickle
import unittest.mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.blocks import BlockHasher
from raykv.errors import InvalidInput
from raykv.layout import FullAttention, SlidingWindow
from raykv.service.control.coordinator import Coordinator, Member
from raykv.service.control.index import CPU, GPU, rank
from raykv.service.groups import common_hit, group_keys, managers, needed_slots, primary_group
from tests.blocks.helpers import make_plan

# one pool and one tier per node: every member has its own rank seen from either node
MEMBERS = {"pA": ("pool", "A"), "tA": ("tier", "A"), "pB": ("pool", "B"), "tB": ("tier", "B")}
PLANS = {
    "full": make_plan([FullAttention()], 64, 2),
    "hybrid": make_plan([FullAttention(), SlidingWindow(window=4)], 64, 2),
    "coarse": make_plan([FullAttention(), SlidingWindow(window=4)], 64, 4, hash_block_size=2),
}


def coordinator(plan) -> Coordinator:
    with unittest.mock.patch("ray.get_runtime_context"):
        c = Coordinator()

    async def up() -> None:
        return None

    c._up = up
    c.models["m"], c.plans["m"] = object(), plan
    for name, (kind, node) in MEMBERS.items():
        c.members[name] = Member(name, kind, node, "m")
    return c


def events(c, member: str, seq: int, stored: list, removed: tuple = ()) -> bool:
    """A member's batch of KV events as it sends them: (key, block) pairs as two lists."""
    keys, blocks = [k for k, _ in stored], [b for _, b in stored]
    return asyncio.run(c.events(member, seq, "m", keys, blocks, list(removed)))


@settings(max_examples=80, deadline=None)
@given(
    which=st.sampled_from(sorted(PLANS)),
    n_tokens=st.integers(0, 30),
    held=st.lists(st.sets(st.sampled_from(sorted(MEMBERS))), min_size=16, max_size=16),
    node=st.sampled_from("AB"),
    limit=st.one_of(st.none(), st.integers(0, 30)),
)
def test_lookup_is_the_managers_rule_over_the_best_copies(which, n_tokens, held, node, limit):
    plan = PLANS[which]
    c = coordinator(plan)
    tokens = list(range(100, 100 + n_tokens))
    chain = BlockHasher(plan.hash_block_size).hash_blocks(tokens)
    keys = group_keys(plan, chain)
    # slot j of every group is held by held[j] (fed as the members' KV-event batches)
    batches: dict[str, list] = {m: [] for m in MEMBERS}
    for gkeys in keys:
        for j, key in enumerate(gkeys):
            for m in held[j]:
                batches[m].append((key, j if MEMBERS[m][0] == "pool" else -1))
    for m, stored in batches.items():
        assert events(c, m, 1, stored)
    res = asyncio.run(c.lookup("m", b"".join(chain), node, limit))

    mgrs = managers(plan)
    cap = min(len(k) * g.block_size for k, g in zip(keys, plan.groups, strict=True))
    cap = cap if limit is None else min(cap, limit)
    hit = common_hit(mgrs, lambda gi, j: j < len(keys[gi]) and bool(held[j]), cap)
    runs: list[list] = []
    for j in needed_slots(mgrs[primary_group(plan)], hit):
        best = min(held[j], key=lambda m: rank(MEMBERS[m][1], _tier(m), node))
        at = [_tier(best), MEMBERS[best][1]]
        if runs and runs[-1][:2] == at:
            runs[-1][2] += 1
        else:
            runs.append([*at, 1])
    assert res == {"hit_tokens": hit, "runs": [tuple(r) for r in runs]}


def _tier(member: str) -> str:
    return CPU if MEMBERS[member][0] == "tier" else GPU


def test_locate_ranks_every_copy_and_a_gone_member_is_no_copy():
    c = coordinator(PLANS["full"])
    key = group_keys(PLANS["full"], BlockHasher(2).hash_blocks([1, 2]))[0][0]
    for i, m in enumerate(MEMBERS):
        assert events(c, m, 1, [(key, i)])
    where = asyncio.run(c.locate("m", [key], "B")).copies[0]
    assert [loc.member for loc in where] == ["pB", "tB", "pA", "tA"]
    assert [loc.tier for loc in where] == [GPU, CPU, GPU, CPU]
    c._forget("pB")
    where = asyncio.run(c.locate("m", [key], "B")).copies[0]
    assert [loc.member for loc in where] == ["tB", "pA", "tA"]
    assert events(c, "tB", 2, [], [key])  # removed: tB has no copy now
    assert [loc.member for loc in asyncio.run(c.locate("m", [key], "B")).copies[0]] == ["pA", "tA"]
    with pytest.raises(InvalidInput):
        asyncio.run(c.lookup("m", [key], "B"))


def test_locate_answers_one_shared_location_per_member():
    """A 32k-token prompt's 2048 blocks held by two members: every block's copies are the
    same two Location objects, so the answer pickles each member once and stays far below
    Ray's 100 KiB inline limit (a Location per block was ~110 KB: an object-store trip)."""
    plan = PLANS["full"]
    c = coordinator(plan)
    keys = group_keys(plan, BlockHasher(plan.hash_block_size).hash_blocks(list(range(4096))))[0]
    for m in ("pA", "tB"):
        assert events(c, m, 1, [(k, j) for j, k in enumerate(keys)])
    answer = asyncio.run(c.locate("m", keys, "B"))
    where = answer.copies
    assert len(where) == len(keys) == 2048
    first = where[0]
    assert [loc.member for loc in first] == ["tB", "pA"]  # the local tier before a remote pool
    assert all(len(w) == 2 and w[0] is first[0] and w[1] is first[1] for w in where)
    # one object for Ray, its table one bytes object: each member pickled once
    blob = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    assert len(blob) < (100 << 10) // 4
    back = pickle.loads(blob).copies
    assert [[loc.member for loc in w] for w in back] == [["tB", "pA"]] * len(keys)
    assert all(w[0] is back[0][0] for w in back)


def test_packed_lookup_answers_what_lookup_answers_and_refuses_anything_else():
    from raykv.service.control.index import pack, unpack

    plan = PLANS["hybrid"]
    c = coordinator(plan)
    chain = BlockHasher(plan.hash_block_size).hash_blocks(list(range(40)))
    stored = [(k, j) for gk in group_keys(plan, chain) for j, k in enumerate(gk)]
    assert events(c, "pA", 1, stored)
    args = ("m", b"".join(chain), "B", 30)
    want = asyncio.run(c.lookup(*args))
    assert want["hit_tokens"] == 30
    assert unpack(asyncio.run(c.lookup_packed(pack(args))), None, "answer") == want
    for bad in (args, pack(args[:3]), pack(list(args))):
        with pytest.raises(InvalidInput, match=r"packed by raykv\.service\.control\.index\.pack"):
            asyncio.run(c.lookup_packed(bad))

"""The one prefix index (``raykv.blocks.PrefixIndex``): holders and scopes, and lookups
through ``GroupProbe`` giving exactly what the group managers give."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.blocks import BlockRemoved, BlockStored, PrefixIndex
from raykv.blocks.events import GroupProbe
from raykv.blocks.managers import manager_for
from raykv.layout import ChunkedLocal, FullAttention, SlidingWindow
from tests.blocks.helpers import make_plan

SPECS = [FullAttention(), SlidingWindow(window=5), ChunkedLocal(chunk=8), SlidingWindow(window=9)]


@settings(max_examples=200, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    bs=st.sampled_from([1, 2, 4]),
    held=st.lists(st.booleans(), max_size=24),
    extra_keys=st.integers(0, 3),
    limit=st.integers(0, 120),
)
def test_probe_gives_what_the_manager_gives(spec, bs, held, extra_keys, limit):
    """Whatever slots are held (holes anywhere), however many keys and whatever the limit:
    the probe's answer (forward scan in C for managers that keep every slot) equals the
    manager's own ``longest_hit`` over a plain per-slot lookup."""
    mgr = manager_for(make_plan([spec], 8, bs).groups[0])
    keys = [bytes([j]) * 32 for j in range(len(held) + extra_keys)]
    idx = PrefixIndex()
    for j, h in enumerate(held):
        if h:
            idx.add(0, keys[j], j, holder="p", scope="m")
    probe = idx.probe(0, keys, mgr, "m")
    table = {k for j, k in enumerate(keys) if j < len(held) and held[j]}

    def plain(j: int):
        return 1 if j < len(keys) and keys[j] in table else None

    assert probe.longest_hit(None, limit) == mgr.longest_hit(plain, limit)
    assert (probe(0) is not None) == (plain(0) is not None)


def test_probes_go_where_managers_go():
    """``common_hit`` takes probes in place of managers: a hybrid model's common prefix."""
    from raykv.service.groups import common_hit

    plan = make_plan([FullAttention(), SlidingWindow(window=4)], 8, 2)
    mgrs = [manager_for(g) for g in plan.groups]
    keys = [[bytes([g, j]) for j in range(10)] for g in range(2)]
    idx = PrefixIndex()
    for j in range(10):
        idx.add(0, keys[0][j], j, "p")
    for j in (0, 1, 2, 5, 6, 7):  # the window group lost slots 3 and 4
        idx.add(1, keys[1][j], j, "p")
    probes = [GroupProbe(idx.table(g), keys[g], mgrs[g]) for g in range(2)]
    hit = common_hit(probes, lambda gi, j: probes[gi](j) is not None, 20)
    held = [set(range(10)), {0, 1, 2, 5, 6, 7}]
    assert hit == common_hit(mgrs, lambda gi, j: j in held[gi], 20) == 16


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "remove", "drop"]),
            st.sampled_from("pqr"),
            st.sampled_from(["m1", "m2"]),
            st.integers(0, 1),
            st.integers(0, 5),
        ),
        max_size=60,
    )
)
def test_index_matches_a_model_of_sets(ops):
    """Holders and scopes: every (scope, group, hash) knows exactly who holds it."""
    idx, model = PrefixIndex(), {}
    for op, holder, scope, gid, h in ops:
        key = (scope, gid, bytes([h]))
        if op == "add":
            idx.add(gid, key[2], h, holder, scope)
            model.setdefault(key, set()).add(holder)
        elif op == "remove":
            idx.remove(gid, key[2], holder, scope)
            model.get(key, set()).discard(holder)
        else:
            idx.drop_member(holder)
            for holders in model.values():
                holders.discard(holder)
    for (scope, gid, h), holders in model.items():
        assert set(idx.copies(gid, h, scope)) == holders
    assert len(idx) == sum(1 for v in model.values() if v)
    for holder in "pqr":
        assert idx.blocks_of(holder) == sum(1 for v in model.values() if holder in v)


def test_events_of_several_holders_and_the_pool_view():
    idx = PrefixIndex()
    idx.apply(BlockStored(0, (b"a", b"b"), (1, 2), None, 4))
    idx.apply(BlockStored(0, (b"a",), (7,), None, 4), holder="tier", scope="m")
    assert idx.locations == {(0, b"a"): 1, (0, b"b"): 2}  # the unnamed pool's map only
    assert idx.longest_prefix(0, [b"a", b"b", b"c"]) == 2
    assert idx.longest_prefix(0, [b"a", b"b"], scope="m") == 1
    idx.apply(BlockRemoved(0, (b"a",)))
    assert idx.locations == {(0, b"b"): 2}
    assert idx.copies(0, b"a", "m") == {"tier": 7}
    assert idx.drop_member("tier") == 1 and len(idx) == 1

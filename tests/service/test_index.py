"""The coordinator's prefix index (pure Python): ranking, prefixes, members leaving."""

from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.service.index import CPU, GPU, Location, PrefixIndex


def loc(member: str, node: str, tier: str = GPU) -> Location:
    return Location(member, node, tier, 1)


def test_best_copy_is_local_gpu_then_local_cpu_then_remote() -> None:
    idx = PrefixIndex()
    for m, node, tier in [("rg", "B", GPU), ("rc", "B", CPU), ("lc", "A", CPU), ("lg", "A", GPU)]:
        idx.add("m", loc(m, node, tier), b"h0")
    assert idx.longest_prefix("m", [b"h0"], "A")[0].member == "lg"
    idx.remove("m", "lg", b"h0")
    assert idx.longest_prefix("m", [b"h0"], "A")[0].member == "lc"
    idx.remove("m", "lc", b"h0")
    assert idx.longest_prefix("m", [b"h0"], "A")[0].member == "rg"


def test_prefix_stops_at_first_missing_block_and_models_are_apart() -> None:
    idx = PrefixIndex()
    for h in (b"a", b"b", b"d"):
        idx.add("m1", loc("p", "A"), h)
    assert len(idx.longest_prefix("m1", [b"a", b"b", b"c", b"d"], "A")) == 2
    assert idx.longest_prefix("m2", [b"a"], "A") == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "remove", "drop"]), st.sampled_from("pqr"), st.integers(0, 6)
        ),
        max_size=60,
    )
)
def test_index_matches_a_model_of_sets(ops) -> None:
    idx, model = PrefixIndex(), {}
    for op, member, h in ops:
        key = bytes([h])
        if op == "add":
            idx.add("m", loc(member, "N"), key)
            model.setdefault(key, set()).add(member)
        elif op == "remove":
            idx.remove("m", member, key)
            model.get(key, set()).discard(member)
        else:
            idx.drop_member(member)
            for holders in model.values():
                holders.discard(member)
    for h in range(7):
        key = bytes([h])
        assert {c.member for c in idx.copies("m", key)} == model.get(key, set())
    assert len(idx) == sum(1 for v in model.values() if v)
    for member in "pqr":
        assert idx.blocks_of(member) == sum(1 for v in model.values() if member in v)


def test_import_raykv_does_not_import_ray() -> None:
    import subprocess
    import sys

    code = "import sys, raykv; assert 'ray' not in sys.modules; assert callable(raykv.connect)"
    subprocess.run([sys.executable, "-c", code], check=True)

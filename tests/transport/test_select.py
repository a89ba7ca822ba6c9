"""Transport choice: the fastest transport both ends advertise, the object store last."""

from hypothesis import given
from hypothesis import strategies as st

from raykv.transport import OBJECT_STORE, PREFERENCE, choose

offers = st.sets(st.sampled_from(PREFERENCE)).map(lambda s: {n: None for n in s})  # peer: equal


@given(offers, offers)
def test_the_first_shared_transport_of_the_preference_wins(holder, reader):
    got = choose(holder, reader)
    shared = [n for n in PREFERENCE if n in holder and n in reader]
    assert got == (shared[0] if shared else OBJECT_STORE)
    # nothing faster than the choice is offered by both
    assert not any(n in holder and n in reader for n in PREFERENCE[: PREFERENCE.index(got)])


def test_gpu_pools_pick_nccl_hosts_pick_ucx_and_strangers_the_object_store():
    gpu = {"nccl": 0, "ucx": ("10.0.0.1", 1), OBJECT_STORE: None}
    tier = {"ucx": ("10.0.0.2", 2), OBJECT_STORE: None}
    assert choose(gpu, gpu) == "nccl"
    assert choose(tier, gpu) == "ucx"
    assert choose({OBJECT_STORE: None}, gpu) == OBJECT_STORE
    assert choose({}, {}) == OBJECT_STORE


@given(
    st.sampled_from(["n1", "n2"]), st.sampled_from(["n1", "n2"]),
    st.sampled_from([("m", 1, 4096), ("m", 2, 2048)]),
    st.sampled_from([("m", 1, 4096), ("m", 2, 2048)]),
)  # fmt: skip
def test_peer_reads_only_between_pools_of_one_node_and_one_layout(n1, n2, l1, l2):
    holder = {"peer": {"node": n1, "layout": list(l1)}, "nccl": {}, OBJECT_STORE: None}
    reader = {"peer": {"node": n2, "layout": list(l2)}, "nccl": {}, OBJECT_STORE: None}
    assert choose(holder, reader) == ("peer" if (n1, l1) == (n2, l2) else "nccl")


@given(offers, offers, st.sets(st.sampled_from(PREFERENCE)))
def test_skipped_transports_are_never_chosen_and_the_rest_keep_their_order(holder, reader, skip):
    skip = tuple(n for n in skip if n != OBJECT_STORE)
    got = choose(holder, reader, skip=skip)
    shared = [n for n in PREFERENCE if n in holder and n in reader and n not in skip]
    assert got == (shared[0] if shared else OBJECT_STORE)
    assert got not in skip

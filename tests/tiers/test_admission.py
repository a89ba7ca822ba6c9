"""TinyLFU, the lower tiers' admission filter: count-min never under-counts, aging halves, a
key seen once never displaces a key seen many times, the same seed gives the same sketch."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from raykv.errors import ConfigError, InvalidInput
from raykv.tiers.admission import MAX_COUNT, TinyLFU, make_admission

keys = st.binary(min_size=32, max_size=32)  # block hashes
traces = st.lists(st.sampled_from([bytes([i]) * 32 for i in range(40)]), max_size=300)


@settings(max_examples=60, deadline=None)
@given(
    trace=st.lists(keys, min_size=1, max_size=40).flatmap(
        lambda ks: st.lists(st.sampled_from(ks), max_size=300)
    ),
    capacity=st.integers(1, 500),
)
def test_count_min_never_under_estimates(trace: list[bytes], capacity: int) -> None:
    f = TinyLFU(capacity)
    f.sample_size = len(trace) + 1  # no aging inside the trace: the true counts hold
    for k in trace:
        f.record(k)
    for k, n in Counter(trace).items():
        assert f.estimate(k) >= min(n, MAX_COUNT)


@settings(max_examples=60, deadline=None)
@given(trace=traces)
def test_aging_halves_every_count_and_clears_the_doorkeeper(trace: list[bytes]) -> None:
    f = TinyLFU(64)
    for k in trace:
        f.record(k)
    before = {k: f.estimate(k) for k in set(trace)}
    counters = {k: before[k] - f._in_door(f._slots(k)[1]) for k in before}
    f.age()
    for k in before:
        assert f.estimate(k) == counters[k] >> 1  # the doorkeeper bit is gone too


def test_aging_runs_every_sample_of_ten_accesses_per_slot() -> None:
    f = TinyLFU(8)
    hot = b"h" * 32
    for _ in range(MAX_COUNT + 1):
        f.record(hot)
    assert f.estimate(hot) == MAX_COUNT + 1  # capped counters + the doorkeeper bit
    for i in range(f.sample_size - f.additions):  # distinct keys until the sample is full
        f.record(i.to_bytes(32, "little"))
    assert f.additions == f.sample_size // 2
    assert f.estimate(hot) == MAX_COUNT >> 1


@settings(max_examples=60, deadline=None)
@given(once=keys, many=keys, times=st.integers(2, 40), noise=st.lists(keys, max_size=50))
@example(once=bytes(32), many=bytes(31) + b"\x01", times=2, noise=[bytes(32)] * 2)  # CI's
def test_a_key_seen_once_is_not_admitted_over_a_key_seen_many_times(
    once: bytes, many: bytes, times: int, noise: list[bytes]
) -> None:
    if once == many:
        return
    noise = [k for k in noise if k not in (once, many)]  # ``once`` is seen once, ``many`` times
    f = TinyLFU(256)
    for k in [many] * times + noise + [once]:
        f.record(k)
    assert not f.admit(once, many)
    assert f.admit(many, once)
    assert f.admit(once, None)  # room: nothing is evicted, the write is taken


@settings(max_examples=30, deadline=None)
@given(trace=traces, seed=st.integers(0, 2**32))
def test_same_seed_same_sketch_and_another_seed_another(trace: list[bytes], seed: int) -> None:
    a, b, c = TinyLFU(16, seed), TinyLFU(16, seed), TinyLFU(16, seed + 1)
    for k in trace:
        a.record(k)
        b.record(k)
        c.record(k)
    assert a._counts == b._counts and a._door == b._door
    assert [a.estimate(k) for k in trace] == [b.estimate(k) for k in trace]
    if len(set(trace)) > 3:  # indexes come from the seed: another seed, other counters
        assert a._door != c._door


def test_make_admission_names_and_errors() -> None:
    f = make_admission(100)
    assert isinstance(f, TinyLFU) and f.capacity == 100
    with pytest.raises(ConfigError, match=r"unknown admission policy 'lru'.*tinylfu"):
        make_admission(100, "lru")
    with pytest.raises(ConfigError, match="capacity"):
        make_admission(0)
    with pytest.raises(InvalidInput, match="bytes"):
        f.record("not a hash")  # type: ignore[arg-type]


def test_a_huge_lower_tier_gets_a_bounded_sketch() -> None:
    """A TiB disk tier of small entries (1 << 34 slots here) holds at most
    ``MAX_SKETCH_SLOTS`` slots' worth of counters (its opening took seconds and GiBs)."""
    from raykv.tiers.admission import MAX_SKETCH_SLOTS

    f = TinyLFU(1 << 34)
    assert f.capacity == 1 << 34
    assert len(f._counts) + len(f._door) <= 32 * MAX_SKETCH_SLOTS
    f.record(b"k")
    f.record(b"k")
    assert f.estimate(b"k") == 2 and f.admit(b"k", b"other")

"""Choosing UCX: nothing runs or advertises it without ucxx, without the transport secret,
or with ``RAYKV_UCX=0`` (everything then moves over the object store); its settings come
from the node's environment and bad ones name the fix."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raykv.errors import ConfigError
from raykv.transport import choose
from raykv.transport.ucx import runtime as rt
from raykv.transport.ucx.config import UcxConfig
from raykv.transport.ucx.wire import FIRST_CHUNK_KEYS, next_chunk, ranges, stripes_for


async def _export(model, keys):
    raise AssertionError("never called")


@pytest.mark.parametrize("why", ["no ucxx", "no secret", "off"])
def test_no_ucx_without_ucxx_the_secret_or_when_off(monkeypatch, why) -> None:
    from raykv.transport.ucx import ucx_reader
    from raykv.transport.ucx.server import ucx_server

    monkeypatch.setenv("RAYKV_TRANSPORT_SECRET", "s" * 32)
    if why == "no ucxx":
        monkeypatch.setattr(rt, "available", lambda: False)
    elif why == "no secret":
        monkeypatch.delenv("RAYKV_TRANSPORT_SECRET")
    else:
        monkeypatch.setenv("RAYKV_UCX", "0")
    assert ucx_reader() is None
    assert ucx_server(_export, host="127.0.0.1") is None
    # a member without UCX advertises only the object store: every pair routes there
    assert choose({"object-store": None}, {"object-store": None, "ucx": ("h", 1)}) == "object-store"
    assert choose({"object-store": None, "ucx": ("h", 1)}, {"object-store": None}) == "object-store"


def test_ucx_is_chosen_when_both_ends_run_it() -> None:
    both = {"object-store": None, "ucx": ("10.0.0.1", 4000)}
    assert choose(both, both) == "ucx"


def test_settings_come_from_the_environment() -> None:
    c = UcxConfig.from_env({"RAYKV_UCX_TLS": "tcp", "RAYKV_UCX_STRIPES": "8",
                            "RAYKV_UCX_TIMEOUT_S": "2.5",
                            "RAYKV_UCX_NET_DEVICES": "lo"})  # fmt: skip
    assert (c.tls, c.stripes, c.timeout_s, c.enabled) == ("tcp", 8, 2.5, True)
    assert c.net_devices == "lo" and UcxConfig.from_env({}).net_devices is None
    assert c.transfer_timeout(10**9) == pytest.approx(2.5 + 1 / 0.05)
    with pytest.raises(ConfigError, match="RAYKV_UCX"):
        UcxConfig.from_env({"RAYKV_UCX_STRIPES": "many"})
    with pytest.raises(ConfigError, match="stripes"):
        UcxConfig.from_env({"RAYKV_UCX_STRIPES": "0"})


@pytest.mark.parametrize(("cores", "stripes"), [(1, 1), (2, 1), (7, 1), (8, 2), (12, 3),
                                                (16, 4), (128, 4)])  # fmt: skip
def test_stripes_default_to_one_per_4_cores_up_to_4(monkeypatch, cores, stripes) -> None:
    """Each stripe runs a UCX worker (a progress thread making its socket copies) at each
    end: one per 4 cores the process may run on, 1 to 4, unless RAYKV_UCX_STRIPES says."""
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert UcxConfig.from_env({}).stripes == UcxConfig().stripes == stripes
    assert UcxConfig.from_env({"RAYKV_UCX_STRIPES": "3"}).stripes == 3


def test_stripes_cut_a_buffer_into_few_large_aligned_ranges() -> None:
    for nbytes in (0, 1, 4095, 4096, 10**6, 128 << 20):
        for parts in (1, 3, 4, 8):
            cuts = ranges(nbytes, parts)
            assert len(cuts) <= parts
            assert sum(b - a for a, b in cuts) == nbytes
            assert all(a % 4096 == 0 and b > a for a, b in cuts)
    assert stripes_for(128 << 20, 4, 1 << 20) == 4
    assert stripes_for(1 << 20, 4, 1 << 20) == 1


@given(keys=st.integers(0, 5000), most=st.integers(1, 600))
def test_a_batch_s_chunks_cover_its_keys_once_in_chunks_both_ends_compute(keys, most) -> None:
    """The chunk schedule the server sends and the reader posts its receives for ahead of
    each header: from a first chunk of at most FIRST_CHUNK_KEYS, every next chunk is
    non-empty and at most ``most`` keys (or the small remainder taken whole), and the chunks
    add up to the batch exactly (a receive posted for a chunk that never comes would be
    left behind)."""
    sizes, size = [], min(keys, FIRST_CHUNK_KEYS)
    while size:
        sizes.append(size)
        size = next_chunk(keys - sum(sizes), size, most)
    assert sum(sizes) == keys
    assert all(0 < s <= max(most, 2 * FIRST_CHUNK_KEYS) for s in sizes[1:])

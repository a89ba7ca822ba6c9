"""NCCL windows' agreement (``raykv.transport.collective.window``), on the CPU with a stand-in
for the extension: registration is collective, so the two ends of a pair must enter it both or
neither. Each end states its offer (NCCL version, allocation size, tensor layout) and registers
only where the two are equal; the reader keeps the holder's memory and drops it once the
holder's process is gone. The registration itself runs on GPUs:
tests/transport/test_collective_gpu.py."""

import os
import subprocess
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from raykv.transport.collective import window
from raykv.transport.collective.pair import Pair
from raykv.transport.collective.window import Windows


class _Store:
    """The pair's rendezvous store: ``get`` waits for the key, as a ``TCPStore`` does."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: str) -> None:
        with self._cv:
            self._data[key] = value.encode()
            self._cv.notify_all()

    def get(self, key: str) -> bytes:
        with self._cv:
            assert self._cv.wait_for(lambda: key in self._data, timeout=10), key
            return self._data[key]


class _Module:
    """The extension's two window calls; each end's NCCL version by its thread's name."""

    def __init__(self, versions: dict[str, int]) -> None:
        self.versions, self.registered = versions, []

    def nccl_window_version(self) -> int:
        return self.versions[threading.current_thread().name]

    def nccl_window(self, comm: int, memory: torch.Tensor, rank: int):
        self.registered.append(rank)
        return torch.full((memory.numel(),), 7 + rank, dtype=torch.uint8), ""


END = st.tuples(
    st.sampled_from([None, 64, 80]),  # the pool's allocation (None: not exportable)
    st.sampled_from([((0, (64,)),), ((0, (32,)), (32, (32,)))]),  # its tensors' layout
    st.sampled_from([0, 22809, 22903]),  # the NCCL version windows work with (0: none)
)


@settings(max_examples=60, deadline=None)
@given(holder=END, reader=END)
def test_both_ends_register_or_neither(holder, reader) -> None:
    module = _Module({"end0": holder[2], "end1": reader[2]})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(window.ops, "kernel_module", lambda: module)
        _pair_forms(module, holder, reader)


def _pair_forms(module: _Module, holder, reader) -> None:
    store, pair = _Store(), Pair("s", "r", 0, ("127.0.0.1", 1))
    windows = [Windows(), Windows()]

    def end(rank: int, size, layout) -> None:
        memory = torch.zeros(size, dtype=torch.uint8) if size else None
        windows[rank].form(pair, rank, 1234, store, memory, layout)

    threads = [
        threading.Thread(target=end, args=(r, *spec[:2]), name=f"end{r}")
        for r, spec in enumerate((holder, reader))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    offers = [spec[2] and spec[0] and (spec[0], spec[1], spec[2]) for spec in (holder, reader)]
    agreed = bool(offers[0]) and offers[0] == offers[1]
    assert sorted(module.registered) == ([0, 1] if agreed else [])
    got = windows[1].peer(pair)
    assert (got is not None) == agreed
    if agreed:  # the reader holds the holder's memory (as the extension mapped it)
        assert got.numel() == holder[0] and int(got[0]) == 8
    assert windows[0].peer(pair) is None  # the holder reads nothing


def test_no_offer_without_exportable_memory_or_the_extension(monkeypatch) -> None:
    monkeypatch.setattr(window.ops, "kernel_module", lambda: None)
    assert window.offer(torch.zeros(8, dtype=torch.uint8), ()) == ""
    module = _Module({threading.current_thread().name: 22809})
    monkeypatch.setattr(window.ops, "kernel_module", lambda: module)
    assert window.offer(None, ()) == ""
    assert window.offer(torch.zeros(8, dtype=torch.uint8), ()).startswith("22809/8/")


def test_a_window_whose_holder_process_is_gone_is_dropped() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    windows, alive, dead = Windows(), Pair("a", "r", 0, ("h", 1)), Pair("b", "r", 0, ("h", 1))
    windows._peers[alive] = (torch.zeros(1), os.getpid())
    windows._peers[dead] = (torch.zeros(1), gone.pid)
    assert windows.dead() == [dead]
    assert windows.drop(dead) and not windows.drop(dead)
    assert windows.peer(dead) is None and windows.peer(alive) is not None


def test_a_holder_this_process_cannot_see_is_never_read(monkeypatch) -> None:
    """Registered (the holder entered the collective too), but a holder pid this process does
    not see (another pid namespace, or gone) could never be swept: the reader keeps nothing."""
    module = _Module({threading.current_thread().name: 22809})
    monkeypatch.setattr(window.ops, "kernel_module", lambda: module)
    gone = subprocess.Popen(["true"])
    gone.wait()
    memory, layout = torch.zeros(64, dtype=torch.uint8), ((0, (64,)),)
    store, pair = _Store(), Pair("s", "r", 0, ("127.0.0.1", 1))
    store.set("offer0", f"{gone.pid}|{window.offer(memory, layout)}")
    windows = Windows()
    windows.form(pair, 1, 1234, store, memory, layout)
    assert module.registered == [1] and windows.peer(pair) is None

"""NCCL pairs between GPUs, each process seeing only its own GPU (as under Ray): scattered
blocks arrive byte-equal as one message per rank pair (16 MiB), TP-1 and, with
4 GPUs (or two groups crossed over 2), TP-2 and MLA (in shares, each passed on inside the
reader's group); a sender that dies leaves its
receiver with a ``TransportError`` within the timeout, never a hang."""

import multiprocessing as mp
import os
import time
from typing import Any

import pytest
import torch

from raykv.bench.transport_nccl import NcclConfig, nccl_gpus, nccl_run

pytestmark = pytest.mark.gpu
GPUS = nccl_gpus()


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}")
def test_scattered_blocks_arrive_equal_between_two_gpus() -> None:
    rep = nccl_run(NcclConfig(blocks=256, rounds=1, burst=2), timeout_s=240)
    (row,) = rep["rows"]
    assert row["equal"] and row["all_blocks"], row  # the peer reads ran last, into zeroes
    assert row["peer"] > 0 and row["peer_in_flight"] > 0, row
    assert row["in_flight_gpu"] > 0 and row["contiguous_gpu"] > 0, row  # the GPUs alone
    if torch.cuda.can_device_access_peer(0, 1):  # the pair's NCCL window formed: read through it
        assert row["window"] > 0 and row["window_in_flight"] > 0, row


@pytest.mark.skipif(GPUS < 4, reason=f"needs 4 GPUs, found {GPUS}")
def test_tp2_rank_pairs_and_mla_between_two_groups() -> None:
    rep = nccl_run(NcclConfig(tp=2, blocks=256, rounds=1, burst=2), timeout_s=240)
    assert [r["layout"] for r in rep["rows"]] == ["split", "mla"]
    assert all(r["equal"] and r["all_blocks"] for r in rep["rows"]), rep["rows"]
    assert rep["rows"][1]["wire_mib"] == rep["rows"][1]["mib_per_pair"]  # MLA: one copy


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}")
def test_tp2_groups_crossed_over_two_gpus_move_rank_pairs_and_mla_shares(monkeypatch) -> None:
    """Each GPU holds one rank of each TP-2 group (A0 and B1 on GPU 0, A1 and B0 on GPU 1):
    every pair crosses GPUs, so the MLA shares (each reader rank receives one from A and
    one from its replica at once, on separate streams) run where only two GPUs are."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,1,0")  # A0, A1, B0, B1
    # 2100 x 64 KiB: two shares of 65.6 MiB (>= SHARE_MIN_BYTES), each two messages
    rep = nccl_run(NcclConfig(tp=2, blocks=2100, rounds=1, burst=3), timeout_s=240)
    assert [r["layout"] for r in rep["rows"]] == ["split", "mla"]
    assert all(r["equal"] and r["all_blocks"] for r in rep["rows"]), rep["rows"]


def _peer(side: str, addr, q) -> None:
    import asyncio

    from raykv.errors import TransportError
    from raykv.transport.collective import Collective
    from raykv.transport.collective.pair import Pair

    torch.cuda.set_device(0)
    coll = Collective(side, "cuda", timeout_s=5)
    entries = [torch.randint(0, 255, (16, 4096), dtype=torch.uint8, device="cuda")]
    pair = Pair("s", "r", 0, addr)
    loop = asyncio.new_event_loop()
    if side == "s":
        loop.run_until_complete(coll.start_send(pair, entries, [1, 2, 3], 4096))
        time.sleep(1)
        os._exit(0)  # dies before the second batch
    got = loop.run_until_complete(coll.recv_batch(pair, entries, [4, 5, 6], 4096))
    t0 = time.monotonic()
    try:
        loop.run_until_complete(coll.recv_batch(pair, entries, [7, 8, 9], 4096))
        q.put((got, "no error", time.monotonic() - t0))
    except TransportError as e:
        q.put((got, str(e)[:80], time.monotonic() - t0))


def _sender_and_receiver(target, items: int = 1) -> Any:
    """Runs ``target(side, addr, q)`` as the sender ("s", GPU 0) and the receiver ("r", GPU 1),
    each process seeing only its GPU; returns what was put on the queue (``items`` > 1: a
    list of that many)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = ("127.0.0.1", int(store.port))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for i, side in enumerate(("s", "r")):
        old = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = str(i)
        procs.append(ctx.Process(target=target, args=(side, addr, q), daemon=True))
        procs[-1].start()
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
    out = [q.get(timeout=120) for _ in range(items)]
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return out[0] if items == 1 else out


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}")
def test_a_dead_sender_is_a_transport_error_within_the_timeout() -> None:
    got, err, waited = _sender_and_receiver(_peer)
    assert got == 3
    assert "receive from s failed" in err and waited < 5 + 3, (err, waited)


def _tamper_peer(side: str, addr, q) -> None:
    import asyncio

    from raykv.transport.collective import Collective
    from raykv.transport.collective.pair import Pair

    torch.cuda.set_device(0)
    width, n = 64 << 10, 600  # row messages of 512 and 88 rows, the sums behind the last
    g = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (n + 8, width), generator=g, dtype=torch.uint8).cuda()
    coll = Collective(side, "cuda", timeout_s=30)
    pair = Pair("s", "r", 0, addr)
    loop = asyncio.new_event_loop()
    ids = list(range(n))
    if side == "s":

        def flip(buf: torch.Tensor) -> None:  # after the gather: row 530 differs on the wire
            buf[530 * width + 5] ^= 1

        coll.tamper = flip
        loop.run_until_complete(coll.start_send(pair, [src], ids, width))
        coll.tamper = None
        loop.run_until_complete(coll.start_send(pair, [src], ids, width))
        time.sleep(2)
        return
    dst = torch.zeros_like(src)
    first = loop.run_until_complete(coll.recv_batch(pair, [dst], ids, width))
    head = bool(torch.equal(dst[:530], src[:530]))
    second = loop.run_until_complete(coll.recv_batch(pair, [dst], ids, width))
    q.put((first, head, second, bool(torch.equal(dst[:n], src[:n]))))


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}")
def test_a_row_corrupted_on_the_wire_ends_the_batch_there() -> None:
    """The receiver's count of intact rows (the C++ pipeline's kernel where it runs) cuts a
    2-message batch at the first row whose wire sum differs; the next batch is whole."""
    first, head, second, whole = _sender_and_receiver(_tamper_peer)
    assert (first, head, second, whole) == (530, True, 600, True)


def _bad_ids_peer(side: str, addr, q) -> None:
    import asyncio

    from raykv.errors import InvalidInput
    from raykv.transport.collective import Collective
    from raykv.transport.collective.pair import Pair

    torch.cuda.set_device(0)
    width, g = 4096, torch.Generator().manual_seed(3)  # the same rows in both processes
    src = torch.randint(0, 256, (16, width), generator=g, dtype=torch.uint8).cuda()
    coll = Collective(side, "cuda", timeout_s=10)
    loop = asyncio.new_event_loop()
    first, fresh = Pair("s", "r", 0, addr), Pair("s", "r", 1, addr)
    if side == "s":
        loop.run_until_complete(coll.start_send(first, [src], [1, 2, 3], width))  # forms it
        try:  # a formed pair's batch is checked in C++, before anything is enqueued
            loop.run_until_complete(coll.start_send(first, [src], [1, 16, 3], width))
            q.put(("s", "no error"))
        except InvalidInput as e:
            q.put(("s", str(e)))
        loop.run_until_complete(coll.start_send(fresh, [src], [1, 2, 3], width))
        time.sleep(2)
        return
    dst = torch.zeros_like(src)
    loop.run_until_complete(coll.recv_batch(first, [dst], [4, 5, 6], width))
    try:
        loop.run_until_complete(coll.recv_batch(first, [dst], [7, 9, 7], width))
        err = "no error"
    except InvalidInput as e:
        err = str(e)
    got = loop.run_until_complete(coll.recv_batch(fresh, [dst], [10, 11, 12], width))
    q.put(("r", err, got, bool(torch.equal(dst[10:13], src[1:4]))))


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}")
def test_bad_block_ids_on_a_formed_pair_are_refused_at_both_ends() -> None:
    """An id outside the pool (sender) and an id twice (receiver) are InvalidInput naming the
    id, refused before anything is enqueued; the next generation of the pair moves a batch."""
    out = {o[0]: o[1:] for o in _sender_and_receiver(_bad_ids_peer, items=2)}
    assert "block id 16" in out["s"][0] and "16 blocks" in out["s"][0], out
    assert "block id 7 appears more than once" in out["r"][0], out
    assert out["r"][1:] == (3, True), out


def _window_peer(side: str, addr, q, sizes=(64, 64)) -> None:
    """Holder "s" and reader "r", each pool one exportable allocation of ``sizes`` rows of
    64 KiB (as a pool's ranks keep it); the pair's first batch stages, then the reader looks
    for the window, reads through it, and sees it dropped once the holder's process is gone."""
    import asyncio

    from raykv.ops.pools import PoolCopy
    from raykv.tiers.peer_memory import PeerExport, carve
    from raykv.transport.collective import Collective
    from raykv.transport.collective.pair import Pair
    from raykv.transport.peer_read import read_blocks, stated_sums

    torch.cuda.set_device(0)
    width, rows = 64 << 10, sizes[0 if side == "s" else 1]
    export = PeerExport([(rows, width)], torch.device("cuda", 0))
    (pool,) = export.tensors
    g = torch.Generator().manual_seed(11)
    data = torch.randint(0, 256, (rows, width), generator=g, dtype=torch.uint8)
    coll = Collective(side, "cuda", timeout_s=30)
    coll.window_memory = (export.buffer, export.spec.tensors)
    pair = Pair("s", "r", 0, addr)
    loop = asyncio.new_event_loop()
    ids = list(range(1, 17))
    if side == "s":
        pool.copy_(data.cuda())
        loop.run_until_complete(coll.start_send(pair, [pool], ids, width))
        time.sleep(3)
        os._exit(0)  # the holder's process goes: the reader drops its window
    staged = loop.run_until_complete(coll.recv_batch(pair, [pool], ids, width))
    memory = coll.window(pair)
    if memory is None:
        q.put((staged, None, None, None))
        return
    (src,) = carve(memory, export.spec.tensors)
    sums = stated_sums(PoolCopy([src]), ids)  # the holder's, as it states them
    pool.zero_()
    dst = list(range(20, 36))
    good = loop.run_until_complete(read_blocks(PoolCopy([src], [pool]), ids, dst, sums, 30))
    equal = bool(torch.equal(pool[dst].cpu(), data[ids]))
    deadline = time.monotonic() + 30
    while coll.window(pair) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
        coll.sweep_windows()
    q.put((staged, good, equal, coll.window(pair) is None))


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}")
def test_a_pairs_nccl_window_maps_the_holders_pool_until_the_holder_is_gone() -> None:
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("GPUs 0 and 1 cannot map each other's memory: NCCL forms no window")
    staged, good, equal, dropped = _sender_and_receiver(_window_peer)
    assert staged == 16  # the pair's first batch staged as ever
    assert good == 16 and equal, (good, equal)  # then read in place, every byte
    assert dropped  # the holder's process gone: the pair (and the mapping) dropped


def _unequal_pools(side: str, addr, q) -> None:
    _window_peer(side, addr, q, sizes=(64, 80))


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 GPUs, found {GPUS}")
def test_pools_of_different_sizes_form_no_window_and_stage() -> None:
    staged, good, _, _ = _sender_and_receiver(_unequal_pools)
    assert staged == 16 and good is None

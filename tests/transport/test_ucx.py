"""``raykv.transport.ucx`` between two processes without Ray (``raykv.bench.ucx_peer`` serves
a CPU-tier arena of scattered blocks): bytes equal and verified, striped or not; a peer that
dies mid-transfer is a ``TransportError`` within the bounded timeout (never a hang, nothing
handed out); two hosts in network namespaces joined by a veth pair; nothing listens on a
non-loopback address (no sockaddr listener: worker-address endpoints, ``UCX_NET_DEVICES=lo``)."""

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch

pytest.importorskip("ucxx")

from raykv.bench.ucx_peer import block_rows
from raykv.errors import TransportError
from raykv.transport import verify
from raykv.transport.ucx import UcxTransport
from raykv.transport.ucx.config import UcxConfig
from raykv.transport.ucx.runtime import UcxRuntime

SECRET = "transport-test-secret-0123456789"
LO = {"UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp"}  # every UCX socket binds 127.0.0.1
os.environ.update(LO)  # this process's UCX (the runtime starts once per process)
BLOCKS, WIDTH = 64, 16 << 10
KEYS = [i.to_bytes(8, "little") for i in range(BLOCKS)]


def cfg(**kw) -> UcxConfig:
    return UcxConfig(tls="tcp", net_devices="lo", **kw)


def peer(*args: str, prefix: tuple[str, ...] = (), host: str = "127.0.0.1", dev: str = "lo"):
    """A ``ucx_peer`` process (UCX on ``dev`` only); returns (process, its endpoints)."""
    env = {**os.environ, "RAYKV_TRANSPORT_SECRET": SECRET, "UCX_WARN_UNUSED_ENV_VARS": "n",
           "UCX_NET_DEVICES": dev}  # fmt: skip
    cmd = [*prefix, sys.executable, "-m", "raykv.bench.ucx_peer", "--tls", "tcp",
           "--net-devices", dev, "--host", host, *args]  # fmt: skip
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = " "
    while line and not line.startswith("{"):
        line = p.stdout.readline()
    assert line, f"peer exited {p.wait()}"
    return p, json.loads(line)


def stop(p) -> None:
    p.stdin.close()
    try:
        p.wait(10)
    except subprocess.TimeoutExpired:
        p.kill()


def fetch(t: UcxTransport, where, keys=KEYS, timeout: float = 60):
    return UcxRuntime.get("tcp").submit(t.fetch("peer", "m", keys, where["raykv"])).result(timeout)


@pytest.mark.parametrize("stripes", [1, 3])
def test_scattered_blocks_arrive_whole_and_verified(stripes) -> None:
    p, where = peer("--blocks", str(BLOCKS), "--block-bytes", str(WIDTH))
    try:
        t = UcxTransport(SECRET.encode(), cfg(stripes=stripes, stripe_min_bytes=1))
        want = block_rows(BLOCKS, WIDTH, 0)
        for n in (BLOCKS, 5, 0):  # the endpoints are reused; an empty batch is fine too
            b = fetch(t, where, KEYS[:n])
            assert b.count == n and verify(b) == n
            if n:
                assert b.rows.shape == (1, n, WIDTH) and b.rows.is_contiguous()
                assert torch.equal(b.rows, want[:, :n])
        # a batch still held keeps its bytes: the next fetch lands in another buffer
        held = fetch(t, where, KEYS[10:20])
        again = fetch(t, where, KEYS[:10])
        assert torch.equal(held.rows, want[:, 10:20]) and torch.equal(again.rows, want[:, :10])
        assert held.rows.data_ptr() != again.rows.data_ptr()
        del held, again
        # keys past what the peer holds: only the leading ones come back
        b = fetch(t, where, [*KEYS[:3], (10**6).to_bytes(8, "little"), KEYS[4]])
        assert b.count == 3 and verify(b) == 3
        t.close()
    finally:
        stop(p)


@pytest.mark.parametrize("stripes", [1, 3])
def test_a_holder_s_prefix_ending_in_a_later_chunk_ends_the_batch_there(stripes) -> None:
    """The reader posts each next chunk's receives before its header: where the holder's
    prefix ends inside such a chunk (40 of 64 keys held: chunks of 8, 16, then 16 of 20)
    or right at a chunk's start (8 held: the second chunk has no rows), the chunk still
    comes at the size posted, its leading rows are handed out and nothing after them; the
    connections carry the next batch whole (no receive was left posted)."""
    for held in (40, 8):
        p, where = peer("--blocks", str(held), "--block-bytes", str(WIDTH))
        try:
            t = UcxTransport(SECRET.encode(), cfg(stripes=stripes, stripe_min_bytes=1))
            want = block_rows(held, WIDTH, 0)
            for _ in range(2):
                b = fetch(t, where, KEYS)
                assert b.count == held and verify(b) == held
                assert torch.equal(b.rows, want)
            b = fetch(t, where, KEYS[:held])
            assert b.count == held and torch.equal(b.rows, want)
            t.close()
        finally:
            stop(p)


@pytest.mark.parametrize("stripes", [1, 3])
def test_rows_go_out_in_place_and_land_in_place_nowhere_else(stripes) -> None:
    """A server that lends (a CPU tier) sends each chunk from the member's own rows, and
    ends each lend once (after its rows are out); a reader that offers ``land`` receives
    each chunk there, handed on viewing it. 36 of 64 keys held (the third chunk comes short,
    padded with zeros), the first chunk not offered: no byte lands outside what was offered."""
    from raykv.tiers.checksum import row_checksums
    from raykv.transport import Lent
    from raykv.transport.ucx.server import UcxServer

    held, sentinel = 36, 0xAB
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 256, (1, held, WIDTH), generator=g, dtype=torch.uint8)
    sums = list(row_checksums(rows[0]))
    lends, ends, asked = [], [], []

    async def export(model: str, keys: list[bytes], out=None, lend: float = 0.0):
        idx = [int.from_bytes(k, "little") for k in keys]
        n = next((i for i, b in enumerate(idx) if b >= held), len(idx))
        assert lend > 0 and idx[:n] == list(range(idx[0], idx[0] + n))
        lends.append(n)
        view = rows[:, idx[0] : idx[0] + n].numpy()
        return Lent(n, view, [[sums[i] for i in idx[:n]]], lambda: ends.append(n))

    dest = torch.full((BLOCKS, WIDTH), sentinel, dtype=torch.uint8)

    def land(at: int, count: int, copies: int, width: int, seconds: float):
        asked.append((at, count))
        assert copies == 1 and width == WIDTH and seconds > 0
        return None if at == 0 else dest[at : at + count].view(-1)

    c = cfg(stripes=stripes, stripe_min_bytes=1, chunk_bytes=16 * WIDTH)
    server = UcxServer(SECRET.encode(), export, host="127.0.0.1", config=c, lends=True)
    ep = server.start()
    t = UcxTransport(SECRET.encode(), c)

    sent: list[int] = []  # chunks handed when the request was sent (``asked``)

    async def stream():
        got = []
        async for b in t.stream("s", "m", KEYS, ep, land, lambda: sent.append(len(got))):
            got.append((b.count, b.rows.data_ptr(), b.rows.clone(), b.checksums))
        return got

    try:
        got = UcxRuntime.get("tcp").submit(stream()).result(60)
        assert sent == [0]  # told once, before any chunk
        assert [n for n, *_ in got] == [8, 16, 12] and asked == [(0, 8), (8, 16), (24, 16)]
        assert torch.equal(torch.cat([r[0] for _, _, r, _ in got]), rows[0])
        assert got[0][1] != dest[0].data_ptr()  # not offered: received into staging
        assert [p for _, p, _, _ in got[1:]] == [dest[8].data_ptr(), dest[24].data_ptr()]
        assert torch.equal(dest[8:held], rows[0, 8:])  # landed in place
        assert (dest[held:40] == 0).all()  # the short chunk's padding, in its offered rows
        assert (dest[:8] == sentinel).all() and (dest[40:] == sentinel).all()
        assert lends == [8, 16, 12]
        deadline = time.monotonic() + 10
        while sorted(ends) != sorted(lends):  # each lend ends once its rows are out
            assert time.monotonic() < deadline, (lends, ends)
            time.sleep(0.05)
        b = fetch(t, {"raykv": ep}, KEYS[:held])  # no land: staging; the connections reused
        assert b.count == held and torch.equal(b.rows, rows)
    finally:
        t.close()
        server.stop()


def test_a_reader_leaving_mid_batch_ends_every_lend() -> None:
    """A reader that stops after the first chunk cuts the transfer: every chunk the server
    lent (sent, on the wire, or exported and never sent) is released, none twice, none
    left leased."""
    from raykv.transport import Lent
    from raykv.transport.ucx.server import UcxServer

    rows = torch.zeros((1, BLOCKS, WIDTH), dtype=torch.uint8)
    lends, ends = [], []

    async def export(model: str, keys: list[bytes], out=None, lend: float = 0.0):
        idx = [int.from_bytes(k, "little") for k in keys]
        token = object()
        lends.append(token)
        await asyncio.sleep(0.01)  # the reader leaves while chunks are exported and sent
        return Lent(len(idx), rows[:, idx[0] : idx[0] + len(idx)].numpy(),
                    [[0] * len(idx)], lambda: ends.append(token))  # fmt: skip

    # a send to a reader that left ends by its bounded timeout: 2 s here
    c = cfg(stripes=2, stripe_min_bytes=1, chunk_bytes=8 * WIDTH, timeout_s=2.0)
    server = UcxServer(SECRET.encode(), export, host="127.0.0.1", config=c, lends=True)
    ep = server.start()
    t = UcxTransport(SECRET.encode(), c)

    async def first_only():
        async for b in t.stream("s", "m", KEYS, ep):
            return b.count

    try:
        assert UcxRuntime.get("tcp").submit(first_only()).result(60) == 8
        deadline = time.monotonic() + 10
        while len(ends) < len(lends) or not lends:
            assert time.monotonic() < deadline, (len(lends), len(ends))
            time.sleep(0.05)
        time.sleep(0.2)
        assert len(lends) < 8  # the batch was cut (64 keys would take 8 chunks or more)
        assert sorted(map(id, ends)) == sorted(map(id, lends))  # each once
    finally:
        t.close()
        server.stop()


def test_a_reader_that_offered_its_rows_leaves_once_no_receive_can_write_them(monkeypatch):
    """Rows may land in the reader's own rows: a reader that leaves mid-batch returns only
    once its connections are gone (a receive still posted could write there until then),
    even when dropping them is slow; one that offered nothing leaves after a short wait."""
    from raykv.transport.ucx.server import UcxServer

    rows = torch.zeros((1, BLOCKS, WIDTH), dtype=torch.uint8)

    async def export(model: str, keys: list[bytes], out=None):
        if keys[0] != KEYS[0]:  # the holder stalls after the first chunk: the reader leaves
            await asyncio.sleep(30)  # with the next chunk's receives posted
        return len(keys), rows[:, : len(keys)].numpy().copy(), [[0] * len(keys)]

    slow_bye = UcxTransport._bye

    async def bye(self, peer) -> None:  # a slow teardown: 3 s before the abort
        await asyncio.sleep(3.0)
        await slow_bye(self, peer)

    monkeypatch.setattr(UcxTransport, "_bye", bye)
    c = cfg(stripes=2, stripe_min_bytes=1, chunk_bytes=8 * WIDTH)
    server = UcxServer(SECRET.encode(), export, host="127.0.0.1", config=c)
    ep = server.start()
    t = UcxTransport(SECRET.encode(), c)
    dest = torch.empty((BLOCKS, WIDTH), dtype=torch.uint8)

    async def leave_after_one(land) -> bool:
        async with contextlib.aclosing(t.stream("s", "m", KEYS, ep, land)) as chunks:
            async for _ in chunks:
                peer = next(iter(t._peers.values()))
                break
        return all(e.closed for e in peer.eps)

    try:
        run = UcxRuntime.get("tcp").submit
        assert run(leave_after_one(lambda at, n, c, w, s: dest[at : at + n].view(-1))).result(60)
        assert not run(leave_after_one(None)).result(60)  # offered nothing: left after 1 s
    finally:
        t.close()
        server.stop()


def test_a_peer_dying_mid_transfer_is_a_transport_error_in_bounded_time() -> None:
    # 64 MiB at >= 0.05 GB/s: the transfer may take ~2 s; the peer dies 50 ms into it
    p, where = peer("--blocks", "256", "--block-bytes", str(256 << 10), "--die-after-ms", "50")
    try:
        c = cfg(stripes=2, stripe_min_bytes=1, timeout_s=3)
        t = UcxTransport(SECRET.encode(), c)
        keys = [i.to_bytes(8, "little") for i in range(256)]
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            fetch(t, where, keys, timeout=120)
        assert time.monotonic() - t0 < c.transfer_timeout(256 * (256 << 10)) + 5
        assert p.wait(10) == 3  # it did die (in the middle of sending)
        # the next fetch to the dead peer fails fast too (its endpoints were dropped)
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            fetch(t, where, keys[:1], timeout=60)
        assert time.monotonic() - t0 < 3 * c.timeout_s
        assert t.counts["batches"] == 0
    finally:
        if p.poll() is None:
            stop(p)


def _netns_ok() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"rkv-probe-{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


@pytest.fixture
def two_hosts():
    """Namespaces a (10.231.0.1) and b (10.231.0.2), joined by a veth pair; yields the
    namespaces and their veth devices (each side's ``UCX_NET_DEVICES``)."""
    if not _netns_ok():
        pytest.skip("network namespaces need root and `ip netns` (not permitted here)")
    tag = uuid.uuid4().hex[:6]
    a, b, va, vb = f"rkv-a-{tag}", f"rkv-b-{tag}", f"rkva{tag}", f"rkvb{tag}"

    def ip(*args: str, ns: str | None = None) -> None:
        cmd = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
        subprocess.run(cmd, check=True, capture_output=True)

    try:
        ip("netns", "add", a)
        ip("netns", "add", b)
        ip("link", "add", va, "type", "veth", "peer", "name", vb)
        ip("link", "set", va, "netns", a)
        ip("link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, "10.231.0.1/24"), (b, vb, "10.231.0.2/24")):
            ip("addr", "add", addr, "dev", dev, ns=ns)
            ip("link", "set", dev, "up", ns=ns)
            ip("link", "set", "lo", "up", ns=ns)
        yield a, b, va, vb
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_hosts_in_network_namespaces(two_hosts) -> None:
    a, b, va, vb = two_hosts
    p, where = peer("--blocks", "32", "--block-bytes", str(WIDTH),
                    prefix=("ip", "netns", "exec", a), host="10.231.0.1", dev=va)  # fmt: skip
    try:
        assert where["raykv"][0] == "10.231.0.1"
        # the reader runs in namespace b: the only way to a is the veth pair
        code = (
            "import json,sys,torch;"
            "from raykv.transport.ucx import UcxTransport;"
            "from raykv.transport.ucx.config import UcxConfig;"
            "from raykv.transport.ucx.runtime import UcxRuntime;"
            "from raykv.transport import verify;"
            "from raykv.bench.ucx_peer import block_rows;"
            "t=UcxTransport(sys.argv[1].encode(),UcxConfig(tls='tcp',net_devices=sys.argv[3],"
            "stripes=2,stripe_min_bytes=1));"
            "k=[i.to_bytes(8,'little') for i in range(32)];"
            "b=UcxRuntime.get('tcp').submit(t.fetch('a','m',k,json.loads(sys.argv[2]))).result(60);"
            f"assert verify(b)==32 and torch.equal(b.rows,block_rows(32,{WIDTH},0));"
            "print('ok',b.nbytes)"
        )
        env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n", "UCX_NET_DEVICES": vb}
        out = subprocess.run(
            ["ip", "netns", "exec", b, sys.executable, "-c", code, SECRET,
             json.dumps(where["raykv"]), vb],
            capture_output=True, text=True, timeout=120, env=env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"ok {32 * WIDTH}" in out.stdout
    finally:
        stop(p)


def test_tp_copies_in_chunks_arrive_copy_major() -> None:
    """A batch of 2 TP copies sent in several chunks is one [copies, n, width] buffer."""
    from raykv.tiers.checksum import row_checksums
    from raykv.transport.ucx.server import UcxServer

    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (2, 40, 4096), generator=g, dtype=torch.uint8)
    sums = [list(row_checksums(rows[c])) for c in range(2)]

    async def export(model: str, keys: list[bytes], out=None):  # out: not used here
        idx = [int.from_bytes(k, "little") for k in keys]
        n = next((i for i, b in enumerate(idx) if b >= 30), len(idx))  # holds 0..29
        return n, rows[:, idx[:n]].numpy(), [[s[i] for i in idx[:n]] for s in sums]

    c = cfg(stripes=2, stripe_min_bytes=1, chunk_bytes=3 * 2 * 4096)
    server = UcxServer(SECRET.encode(), export, host="127.0.0.1", config=c)
    ep = server.start()
    t = UcxTransport(SECRET.encode(), c)
    try:
        b = UcxRuntime.get("tcp").submit(t.fetch("s", "m", KEYS[:40], ep)).result(60)
        assert b.count == 30 and verify(b) == 30 and torch.equal(b.rows, rows[:, :30])
        assert server.stats()["batches"] > 3  # it came in chunks
        assert asyncio.iscoroutinefunction(export)
        assert server.stats()["connections"] == 2
        t.close()  # says bye: the server drops both stripes' connections
        deadline = time.monotonic() + 10
        while server.stats()["connections"]:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.1)
    finally:
        t.close()
        server.stop()


def test_a_server_gathers_into_buffers_it_reuses_once_their_rows_are_out() -> None:
    """Each chunk after the first is gathered into a buffer the server hands the member
    (``out``): a spare one once an earlier chunk's sends completed, so fetches after the
    first take no fresh pages; every chunk still arrives whole and verified (no buffer is
    refilled while its rows are on the wire)."""
    from raykv.tiers.checksum import row_checksums
    from raykv.transport.ucx.server import CHUNKS_IN_FLIGHT, UcxServer

    g = torch.Generator().manual_seed(9)
    rows = torch.randint(0, 256, (1, 48, 4096), generator=g, dtype=torch.uint8)
    sums = list(row_checksums(rows[0]))
    given: list[int] = []

    async def export(model: str, keys: list[bytes], out=None):
        idx = [int.from_bytes(k, "little") for k in keys]
        if out is None:
            return len(idx), rows[:, idx].numpy().copy(), [[sums[i] for i in idx]]
        given.append(out.ctypes.data)
        dst = out.reshape(-1)[: len(idx) * 4096].reshape(1, len(idx), 4096)
        dst[0] = rows[0, idx].numpy()
        return len(idx), dst, [[sums[i] for i in idx]]

    c = cfg(stripes=2, stripe_min_bytes=1, chunk_bytes=4 * 4096)
    server = UcxServer(SECRET.encode(), export, host="127.0.0.1", config=c)
    ep = server.start()
    t = UcxTransport(SECRET.encode(), c)
    try:
        for _ in range(3):
            b = UcxRuntime.get("tcp").submit(t.fetch("s", "m", KEYS[:48], ep)).result(60)
            assert b.count == 48 and verify(b) == 48 and torch.equal(b.rows, rows)
        assert len(given) > len(set(given))  # buffers came back and were used again
        # at most CHUNKS_IN_FLIGHT chunks on the wire and one gathering (one spare in turn)
        assert len(set(given)) <= CHUNKS_IN_FLIGHT + 2
    finally:
        t.close()
        server.stop()


@pytest.mark.parametrize(("served", "read"), [(2, 3), (3, 2)])
def test_each_stripe_runs_on_a_ucx_worker_of_its_own_on_both_sides(served, read) -> None:
    """A server runs ``stripes`` UCX workers (each its own progress thread: one worker's
    socket copies run on one core) and advertises each one's address; a reader's stripe
    ``i`` goes from its worker ``i`` to the server's worker ``i`` modulo how many the server
    runs, and the server answers from the worker the hello came to. Either side may run more
    stripes than the other; the rows arrive whole either way."""
    from raykv.tiers.checksum import row_checksums
    from raykv.transport.ucx.server import UcxServer

    g = torch.Generator().manual_seed(11)
    rows = torch.randint(0, 256, (1, 40, 4096), generator=g, dtype=torch.uint8)
    sums = list(row_checksums(rows[0]))

    async def export(model: str, keys: list[bytes], out=None):
        idx = [int.from_bytes(k, "little") for k in keys]
        return len(idx), rows[:, idx].numpy().copy(), [[sums[i] for i in idx]]

    rt = UcxRuntime.get("tcp")
    server = UcxServer(SECRET.encode(), export, host="127.0.0.1",
                       config=cfg(stripes=served, stripe_min_bytes=1))  # fmt: skip
    ep = server.start()
    t = UcxTransport(SECRET.encode(), cfg(stripes=read, stripe_min_bytes=1, chunk_bytes=8 * 4096))
    try:
        assert len(ep[1]) == len(set(ep[1])) == served
        b = rt.submit(t.fetch("s", "m", KEYS[:40], ep)).result(60)
        assert b.count == 40 and verify(b) == 40 and torch.equal(b.rows, rows)

        async def handles() -> list[int]:
            return [(await rt.worker(i)).worker.handle for i in range(max(served, read))]

        workers = rt.submit(handles()).result(10)
        (peer,) = t._peers.values()
        assert [c.ep.ucp_worker for c in peer.eps] == workers[:read]
        conns = sorted(server._eps.items())
        assert [i for (_, i), _ in conns] == list(range(read))
        assert [c.ep.ucp_worker for _, c in conns] == [workers[i % served] for i in range(read)]
    finally:
        t.close()
        server.stop()


def _listening(pid: int) -> list[tuple[str, int]]:
    import psutil

    conns = psutil.Process(pid).net_connections(kind="inet")
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def test_nothing_listens_on_a_non_loopback_address() -> None:
    """While a server serves (and after a striped fetch), every listening socket of the
    serving process and of the reader is on 127.0.0.1 (UCX's tcp transport on ``lo``);
    none on 0.0.0.0, ::, or any other address."""
    p, where = peer("--blocks", "16", "--block-bytes", str(WIDTH))
    try:
        t = UcxTransport(SECRET.encode(), cfg(stripes=2, stripe_min_bytes=1))
        assert verify(fetch(t, where, KEYS[:16])) == 16
        for pid in (p.pid, os.getpid()):
            socks = _listening(pid)
            assert socks, f"process {pid} listens on nothing: UCX's tcp transport should"
            assert all(ip == "127.0.0.1" for ip, _ in socks), (pid, socks)
        t.close()
    finally:
        stop(p)


def test_an_idle_server_and_reader_use_no_cpu() -> None:
    """A server waiting for hellos and for requests on open connections (receives posted),
    and a reader holding those connections, sleep: ucxx completes their receives from its
    notifier thread (Python futures). Without them every posted receive was awaited by
    spinning the loop, a whole core per process as long as it served."""
    import psutil

    p, where = peer("--blocks", "16", "--block-bytes", str(WIDTH))
    try:
        t = UcxTransport(SECRET.encode(), cfg(stripes=2, stripe_min_bytes=1))
        assert verify(fetch(t, where, KEYS[:16])) == 16  # connections open, receives posted
        procs = [psutil.Process(p.pid), psutil.Process(os.getpid())]
        before = [sum(q.cpu_times()[:2]) for q in procs]
        time.sleep(2.0)
        used = [sum(q.cpu_times()[:2]) - b for q, b in zip(procs, before, strict=True)]
        assert max(used) < 0.5, f"CPU seconds in 2 s idle (server, reader): {used}"
        t.close()
    finally:
        stop(p)


def test_wrong_secret_and_garbage_hellos_are_refused_and_counted() -> None:
    import numpy as np
    import ucxx

    from raykv.transport.ucx.server import UcxServer

    async def export(model: str, keys: list[bytes], out=None):  # out: not used here
        raise AssertionError("a refused peer reads nothing")

    server = UcxServer(SECRET.encode(), export, host="127.0.0.1", config=cfg(timeout_s=2))
    ep = server.start()
    wrong = UcxTransport(b"not-the-secret-at-all-0000", cfg(timeout_s=2))
    rt = UcxRuntime.get("tcp")
    try:
        with pytest.raises(TransportError, match="secret"):
            rt.submit(wrong.fetch("s", "m", KEYS[:2], ep)).result(30)
        assert wrong.counts["refused"] == 1

        async def garbage() -> None:  # not a raykv hello: refused before any reply
            addr = ucxx.get_ucx_address_from_buffer(bytes.fromhex(ep[1][0]))
            e = await ucxx.create_endpoint_from_worker_address(addr)
            await e.send(np.frombuffer(b"GET / HTTP/1.1\r\n" * 4, np.uint8), tag=ep[2],
                         force_tag=True)  # fmt: skip
            await asyncio.sleep(0.5)
            e.abort()

        rt.submit(garbage()).result(30)
        deadline = time.monotonic() + 10
        while server.stats()["refused"] < 2:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.1)
        assert server.stats()["batches"] == 0 and server.stats()["connections"] == 0
    finally:
        wrong.close()
        server.stop()


def _receive(t: UcxTransport, where, keys, timeout: float = 60):
    """``receive`` of ``t.stream`` on a loop of its own (a reader's, not UCX's), as a tier's
    pull reads: (the result or the error, [(position, rows)] the sink got, in order)."""
    from raykv.transport import receive

    got: list = []

    async def sink(at: int, rows) -> None:
        got.append((at, rows.rows.clone()))

    async def run():
        return await asyncio.wait_for(receive(t.stream("peer", "m", keys, where), sink), timeout)

    try:
        return asyncio.run(run()), got
    except TransportError as e:
        return e, got


def test_a_corrupt_row_mid_batch_ends_the_stream_after_the_intact_rows() -> None:
    """Chunks are verified as they arrive: the sink gets the rows before the bad one (several
    chunks, in order, each before the fetch ended), never the bad row or anything after; the
    connection is dropped (the server was mid-batch) and the next fetch reconnects."""
    from raykv.tiers.checksum import row_checksums
    from raykv.transport.ucx.server import UcxServer

    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, 256, (1, 64, 4096), generator=g, dtype=torch.uint8)
    sums = list(row_checksums(rows[0]))
    bad = 41

    async def export(model: str, keys: list[bytes], out=None):  # out: not used here
        idx = [int.from_bytes(k, "little") for k in keys]
        out = rows[:, idx].clone()
        if bad in idx:
            out[0, idx.index(bad), 100] ^= 0x01  # one bit, after it was stored
        return len(idx), out.numpy(), [[sums[i] for i in idx]]

    c = cfg(stripes=2, stripe_min_bytes=1, chunk_bytes=8 * 4096)
    server = UcxServer(SECRET.encode(), export, host="127.0.0.1", config=c)
    ep = server.start()
    t = UcxTransport(SECRET.encode(), c)
    try:
        res, got = _receive(t, ep, KEYS[:64])
        assert res.count == bad and res.corrupt and res.nbytes == bad * 4096
        assert [at for at, _ in got] == list(
            itertools.accumulate([0] + [r.shape[1] for _, r in got[:-1]])
        )
        assert len(got) > 3  # in chunks, as they came
        assert torch.equal(torch.cat([r for _, r in got], dim=1), rows[:, :bad])
        res, got = _receive(t, ep, KEYS[:20])  # reconnects; an intact batch arrives whole
        assert res.count == 20 and not res.corrupt
        assert torch.equal(torch.cat([r for _, r in got], dim=1), rows[:, :20])
    finally:
        t.close()
        server.stop()


def test_a_peer_dying_mid_stream_leaves_only_whole_verified_chunks() -> None:
    """The peer dies while it streams: the reader's stream ends with ``TransportError``
    within the bounded timeout, and its sink got only chunks that arrived whole and passed
    their checksums (a prefix of the batch), nothing half-received."""
    p, where = peer("--blocks", "256", "--block-bytes", str(256 << 10), "--die-after-ms", "30")
    try:
        c = cfg(stripes=2, stripe_min_bytes=1, timeout_s=3, chunk_bytes=4 << 20)
        t = UcxTransport(SECRET.encode(), c)
        keys = [i.to_bytes(8, "little") for i in range(256)]
        t0 = time.monotonic()
        res, got = _receive(t, where["raykv"], keys, timeout=120)
        assert isinstance(res, TransportError), res
        assert time.monotonic() - t0 < c.transfer_timeout(256 * (256 << 10)) + 5
        assert p.wait(10) == 3
        want = block_rows(256, 256 << 10, 0)
        n = sum(r.shape[1] for _, r in got)
        assert n < 256
        if got:
            assert torch.equal(torch.cat([r for _, r in got], dim=1), want[:, :n])
        t.close()
    finally:
        if p.poll() is None:
            stop(p)


def test_a_stream_from_a_peer_with_another_secret_moves_nothing() -> None:
    """Auth comes first on a streamed fetch too: a reader with the wrong secret is refused
    before any chunk (its sink is never called), and the server counts it."""
    from raykv.transport.ucx.server import UcxServer

    async def export(model: str, keys: list[bytes], out=None):  # out: not used here
        raise AssertionError("a refused peer reads nothing")

    server = UcxServer(SECRET.encode(), export, host="127.0.0.1", config=cfg(timeout_s=2))
    ep = server.start()
    wrong = UcxTransport(b"not-the-secret-at-all-0000", cfg(timeout_s=2))
    try:
        res, got = _receive(wrong, ep, KEYS[:4])
        assert isinstance(res, TransportError) and "secret" in str(res) and got == []
        deadline = time.monotonic() + 10
        while server.stats()["refused"] < 1:
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.1)
        assert server.stats()["batches"] == 0
    finally:
        wrong.close()
        server.stop()


def test_a_fault_of_the_server_itself_is_logged_and_counted(caplog) -> None:
    """A connection the server ends by a fault of its own (here its send path raising) is
    a WARNING and an ``errors`` count, not the debug line of a peer that went away: its
    reader only sees a timeout."""
    import logging
    from unittest import mock

    from raykv.transport.ucx.server import UcxServer

    rows = torch.zeros((1, 4, 4096), dtype=torch.uint8)

    async def export(model: str, keys: list[bytes], out=None):  # out: not used here
        return len(keys), rows[:, : len(keys)].numpy(), [[0] * len(keys)]

    async def broken(*_a, **_k):
        raise RuntimeError("a bug on the serving side")

    server = UcxServer(SECRET.encode(), export, host="127.0.0.1", config=cfg(timeout_s=2))
    ep = server.start()
    t = UcxTransport(SECRET.encode(), cfg(timeout_s=2))
    try:
        with mock.patch.object(UcxServer, "_send", broken), caplog.at_level(logging.WARNING):
            res, _ = _receive(t, ep, KEYS[:4])
            assert isinstance(res, TransportError)
            deadline = time.monotonic() + 10
            while server.stats()["errors"] < 1:
                assert time.monotonic() < deadline, server.stats()
                time.sleep(0.1)
        assert any("failed here" in r.getMessage() for r in caplog.records)
    finally:
        t.close()
        server.stop()


_SEGMENTS_OF_A_FRESH_RUNTIME = """
from raykv.transport.ucx.runtime import UcxRuntime

async def segments():
    import ucxx
    c = ucxx.core._get_ctx().config
    return c.get("TX_SEG_SIZE"), c.get("RX_SEG_SIZE")  # what the context was given (not env)

print(*UcxRuntime.get("tcp", "lo").submit(segments()).result(30))
"""


@pytest.mark.parametrize(
    ("env", "want"),
    [({}, "1M 1M"), ({"UCX_TCP_RX_SEG_SIZE": "64K"}, "None None"),
     ({"UCX_TCP_TX_SEG_SIZE": "512K", "UCX_TCP_RX_SEG_SIZE": "2M"}, "None None")],
)  # fmt: skip
def test_the_runtime_uses_1_mib_tcp_segments_unless_the_node_sets_its_own(env, want) -> None:
    """raykv's UCX context over tcp: 1 MiB send / receive segments (UCX's 8 KiB / 64 KiB held
    one endpoint to ~1 GB/s); a node that sets either of UCX's own gets none of ours (UCX reads
    its environment) and UCX starts (our 1 MiB send segment beside its 64 KiB receive segment
    stopped UCX from starting)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TCP_")}
    out = subprocess.run([sys.executable, "-c", _SEGMENTS_OF_A_FRESH_RUNTIME],
                         env={**clean, **env, "UCX_WARN_UNUSED_ENV_VARS": "n"},
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2].strip() == want

"""``CollectiveTransport``: blocks move over torch.distributed, one message per batch.

Every process that holds a rank's KV (a pool and each of its TP ranks) has one
``Collective``: its end of raykv's **pairwise** process groups. A group has exactly two
ranks, the sender (rank 0) and the receiver (rank 1) of one direction between two
endpoints (``Pair``: source ident, destination ident, generation, rendezvous store). It is
built directly on a ``PrefixStore`` over the coordinator's ``TCPStore`` (no global
``init_process_group``), lazily, the first time the pair moves a batch; an endpoint's ident
names its actor incarnation, so a re-placed pool simply forms new pairs. Backend NCCL where
the KV lives on a GPU (advertised as ``nccl``), gloo where it lives in host memory
(``gloo``): the same code, so CI runs the protocol with gloo and GPU machines with NCCL.
Under Ray each GPU actor sees its own GPU as the current CUDA device (``cuda:0`` after
``CUDA_VISIBLE_DEVICES``); nothing here assumes a global index.

A batch is ONE message: the sender gathers the blocks with the paged-copy kernel
(``raykv.ops.gather_blocks``) into one staging buffer ``[rows | wire sums]`` (each row's
position-weighted int64 word sum, computed where the rows are, on the GPU for NCCL), sends
it, and the receiver checks every row's sum on arrival (plus, where the rows are in host
memory, the xxh3 checksums the rows were stored with) and scatters the rows into its blocks
(``raykv.ops.scatter_blocks``); only the leading intact ones become valid. A corrupt row
ends the batch there (the rest are misses, counted by the caller). On a GPU the xxh3 of the
stored bytes is not recomputed (it runs on the host: a 2 GiB batch would cross PCIe twice);
the sender's sums are taken from the bytes it gathered, so the wire is checked end to end
and the stored xxh3 checksums travel with the blocks (an offload re-checks them).

Operations of one pair run in order on one thread of their own (NCCL and gloo point-to-point
ops match in issue order, and both ends issue one op per batch), never on the actor's event
loop, and every wait is bounded (``timeout_s``): a peer that dies or never answers ends as
``TransportError`` and the pair's group is aborted; the caller bumps the generation, so the
next batch forms a fresh group instead of reusing a broken one.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from raykv import ops
from raykv.errors import TransportError
from raykv.tiers.checksum import row_checksums
from raykv.transport.select import GLOO, NCCL

TIMEOUT_S = float(os.environ.get("RAYKV_COLLECTIVE_TIMEOUT_S", "30"))
_SUM_BYTES = 8  # one int64 wire sum per row
_SUM_CHUNK = 256 << 20  # bytes of rows summed per step
_SPIN_S, _POLL_S = 0.002, 0.0001  # poll NCCL completion: spin first, then sleep between polls
log = logging.getLogger(__name__)


def backend_for(device: torch.device | str) -> str:
    """``nccl`` for KV on a GPU, ``gloo`` for KV in host memory."""
    return NCCL if torch.device(device).type == "cuda" else GLOO


def serve_rendezvous(host: str) -> tuple[Any, str, int]:
    """A ``TCPStore`` server on ``host`` (a free port) for the pairs' rendezvous: the
    coordinator hosts it; returns (store, host, port)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        host, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60)
    )
    return store, host, int(store.port)


def node_address() -> str:
    """This node's address as Ray knows it (127.0.0.1 on a loopback cluster), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # no Ray here: a single-host use
        pass
    return "127.0.0.1"


@dataclass(frozen=True)
class Pair:
    """One direction between two endpoints: ``src`` sends, ``dst`` receives."""

    src: str
    dst: str
    gen: int
    store: tuple[str, int]

    @property
    def prefix(self) -> str:
        return f"raykv/{self.src}>{self.dst}/{self.gen}/"

    @property
    def link(self) -> tuple[str, str]:
        return self.src, self.dst


# --- the wire format: [n rows of width bytes | n int64 sums] -------------------------------

_WEIGHTS: dict[tuple[int, str], torch.Tensor] = {}


def _weights(n: int, device: torch.device) -> torch.Tensor:
    """Odd int64 weights, fixed: a change of any word changes the weighted sum (mod 2**64)."""
    key = (n, str(device))
    w = _WEIGHTS.get(key)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED)
        w = torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=torch.int64) * 2 + 1
        w = _WEIGHTS[key] = w.to(device)
    return w


def wire_sums(rows: torch.Tensor) -> torch.Tensor:
    """Per row of uint8 ``[n, width]``: the position-weighted wrapping sum of its words
    (int64 ``[n]``, on the rows' device; no host round trip)."""
    n, width = rows.shape
    out = torch.empty(n, dtype=torch.int64, device=rows.device)
    step = max(1, _SUM_CHUNK // max(width, 1))  # bounded scratch memory (2 GiB batches)
    for i in range(0, n, step):
        part = rows[i : i + step]
        words = part.view(torch.int64) if width % 8 == 0 else part.to(torch.int64)
        torch.sum(words * _weights(words.shape[1], rows.device), dim=1, out=out[i : i + step])
    return out


def wire_bytes(n: int, width: int) -> int:
    return n * (width + _SUM_BYTES)


def split_wire(buf: torch.Tensor, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows uint8 ``[n, width]``, sums int64 ``[n]``) views of a wire buffer."""
    rows = buf[: n * width].view(n, width)
    return rows, buf[n * width : wire_bytes(n, width)].view(torch.int64)


def stage(entries: Sequence[torch.Tensor], block_ids: Sequence[int], width: int) -> torch.Tensor:
    """One wire buffer of ``block_ids``' rows (one paged copy) and their sums, on the
    entries' device. Runs before the caller's next await: the rows are read now."""
    device = entries[0].device
    buf = torch.empty(wire_bytes(len(block_ids), width), dtype=torch.uint8, device=device)
    rows, sums = split_wire(buf, len(block_ids), width)
    ops.gather_blocks(entries, torch.tensor(list(block_ids), dtype=torch.long), rows)
    sums.copy_(wire_sums(rows))
    return buf


def check_wire(rows: torch.Tensor, sums: torch.Tensor, expected: Sequence[int] | None) -> int:
    """How many leading rows arrived intact: their wire sums match, and where the rows are
    in host memory their xxh3 checksums equal ``expected`` (the ones they were stored with;
    None: unchecked)."""
    ok = (wire_sums(rows) == sums).cpu().tolist()
    good = next((i for i, x in enumerate(ok) if not x), len(ok))
    if expected is not None and rows.device.type == "cpu" and good:
        got = row_checksums(rows[:good])
        good = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), good
        )
    return good


# --- one process's end of its pairs --------------------------------------------------------


class Collective:
    """This process's pairwise groups, one ordered thread per pair, bounded waits."""

    def __init__(
        self,
        ident: str,
        device: torch.device | str,
        timeout_s: float = TIMEOUT_S,
        host: str | None = None,
    ) -> None:
        self.ident = ident
        self.host = host or node_address()  # gloo listens here
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = backend_for(self.device)
        self.timeout_s = timeout_s
        self._groups: dict[Pair, Any] = {}
        self._threads: dict[Pair, ThreadPoolExecutor] = {}
        self._stores: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()
        self._warmed: set[Pair] = set()  # NCCL pairs whose communicator is up
        # tests: called with each wire buffer right before it is sent
        self.tamper: Callable[[torch.Tensor], None] | None = None

    # -- groups --

    def _store(self, addr: tuple[str, int]) -> Any:
        import torch.distributed as dist

        with self._lock:
            s = self._stores.get(addr)
            if s is None:
                s = self._stores[addr] = dist.TCPStore(
                    addr[0], int(addr[1]), is_master=False,
                    timeout=datetime.timedelta(seconds=self.timeout_s),
                )  # fmt: skip
        return s

    def _group(self, pair: Pair) -> Any:
        """The pair's 2-rank group (formed now if new: both ends form it together)."""
        pg = self._groups.get(pair)
        if pg is not None:
            return pg
        import torch.distributed as dist

        store = dist.PrefixStore(pair.prefix, self._store(pair.store))
        rank = 0 if pair.src == self.ident else 1
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.backend == NCCL:
            # we abort a stuck pair ourselves; NCCL's watchdog must not kill the actor
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
            os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout * 4
            pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
        else:  # bound to this node's address (not whatever the hostname resolves to)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            pg = dist.ProcessGroupGloo(store, rank, 2, opts)
        self._groups[pair] = pg
        return pg

    def _abort(self, pair: Pair) -> None:
        self._warmed.discard(pair)
        pg = self._groups.pop(pair, None)
        if pg is None:
            return
        for name in ("abort", "_abort", "shutdown"):
            fn = getattr(pg, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception as e:  # already broken: nothing more to release
                    log.debug("collective %s: %s of %s failed: %r", self.ident, name, pair, e)
                return

    def forget(self, pair: Pair) -> None:
        """Drop the groups of ``pair``'s direction older than its generation (a reader
        moved on after a failure)."""
        stale = [p for p in list(self._groups) if p.link == pair.link and p.gen < pair.gen]
        for p in stale:
            ex = self._threads.pop(p, None)
            if ex is not None:
                ex.submit(self._abort, p)
                ex.shutdown(wait=False)
            else:
                self._abort(p)

    # -- one op, on the pair's thread --

    def _wait(self, pair: Pair, work: Any) -> None:
        deadline = time.monotonic() + self.timeout_s
        if self.backend == GLOO:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            return
        spin = time.monotonic() + _SPIN_S
        while not work.is_completed():  # NCCL: wait() would only order streams
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"no completion within {self.timeout_s:.0f}s")
            if now > spin:
                time.sleep(_POLL_S)
        work.wait()

    def _op(self, pair: Pair, buf: torch.Tensor, send: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        try:
            pg = self._group(pair)
            if send:
                if self.tamper is not None:
                    self.tamper(buf)
                work = pg.send([buf], 1, 0)
            else:
                work = pg.recv([buf], 0, 0)
            self._wait(pair, work)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        except Exception as e:
            self._abort(pair)
            raise TransportError(
                f"{self.backend} {'send to' if send else 'receive from'} "
                f"{pair.dst if send else pair.src} failed ({type(e).__name__}: "
                f"{str(e)[:200]}); the batch is a miss here, its pair is formed again next time"
            ) from e

    async def _run(self, pair: Pair, fn: Callable[[], Any]) -> Any:
        """``fn`` on the pair's own thread (its ops in order), at most ``timeout_s`` (plus the
        rendezvous) without blocking the event loop."""
        self.forget(pair)
        ex = self._threads.get(pair)
        if ex is None:
            ex = self._threads[pair] = ThreadPoolExecutor(1, thread_name_prefix="raykv-pair")
        fut = asyncio.wrap_future(ex.submit(fn))
        try:
            return await asyncio.wait_for(fut, 2 * self.timeout_s + 5)
        except TimeoutError:
            self._threads.pop(pair, None)
            ex.submit(self._abort, pair)
            ex.shutdown(wait=False)
            raise TransportError(
                f"{self.backend} pair {pair.src} -> {pair.dst} did not finish within "
                f"{2 * self.timeout_s + 5:.0f}s; the batch is a miss"
            ) from None

    async def _warm(self, pair: Pair, buf: torch.Tensor, send: bool) -> None:
        """An op on a formed NCCL pair: issued from the event loop (it does not block), its
        completion polled without blocking the loop, bounded like every other wait."""
        try:
            pg = self._groups[pair]
            if send and self.tamper is not None:
                self.tamper(buf)
            work = pg.send([buf], 1, 0) if send else pg.recv([buf], 0, 0)
            now = time.monotonic()
            deadline, spin = now + self.timeout_s, now + _SPIN_S
            while not work.is_completed():
                now = time.monotonic()
                if now > deadline:
                    raise TimeoutError(f"no completion within {self.timeout_s:.0f}s")
                await asyncio.sleep(0 if now < spin else _POLL_S)
            work.wait()
        except Exception as e:
            self._warmed.discard(pair)
            self._abort(pair)
            raise TransportError(
                f"nccl {'send to' if send else 'receive from'} "
                f"{pair.dst if send else pair.src} failed ({type(e).__name__}: "
                f"{str(e)[:200]}); the batch is a miss here, its pair is formed again next time"
            ) from e

    async def _move(self, pair: Pair, buf: torch.Tensor, send: bool) -> None:
        if pair in self._warmed and pair in self._groups:
            await self._warm(pair, buf, send)
            return
        await self._run(pair, lambda: self._op(pair, buf, send))
        if self.backend == NCCL:  # formed, its communicator up: later ops go inline
            self._warmed.add(pair)

    async def send(self, pair: Pair, buf: torch.Tensor) -> None:
        await self._move(pair, buf, True)

    async def recv(self, pair: Pair, buf: torch.Tensor) -> None:
        await self._move(pair, buf, False)

    def close(self) -> None:
        for p in list(self._groups):
            self._abort(p)
        for ex in self._threads.values():
            ex.shutdown(wait=False)
        self._threads.clear()


# --- blocks over a pair ----------------------------------------------------------------------


async def send_blocks(
    coll: Collective, pair: Pair, entries: Sequence[torch.Tensor], block_ids: Sequence[int],
    width: int,
) -> int:  # fmt: skip
    """Gather ``block_ids`` (now, before the first await) and send them as one message.
    Returns the bytes sent."""
    buf = stage(entries, block_ids, width)
    await coll.send(pair, buf)
    return int(buf.numel())


async def recv_blocks(
    coll: Collective,
    pair: Pair,
    entries: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    width: int,
    expected: Sequence[int] | None = None,
    forward: Sequence[Pair] = (),
) -> int:
    """Receive one message of ``len(block_ids)`` rows from ``pair.src``, check it
    (``check_wire``) and pass it on to ``forward`` (replicas of the same copy, e.g. an MLA
    latent: it crossed once). Returns how many leading blocks hold intact rows; only those
    may become valid (on a GPU every row is scattered while the check runs, so one host sync
    covers both: the blocks are the reader's own and not valid yet; host rows are checked
    first and only the good ones written)."""
    n = len(block_ids)
    buf = torch.empty(wire_bytes(n, width), dtype=torch.uint8, device=coll.device)
    await coll.recv(pair, buf)
    rows, sums = split_wire(buf, n, width)
    if coll.device.type == "cuda":
        # scatter while the check runs behind it on the stream: one host sync for both. The
        # blocks are the reader's own, not valid yet: rows past a bad one are never validated
        ops.scatter_blocks(rows, entries, torch.tensor(list(block_ids)))
        good = check_wire(rows, sums, expected)
    else:  # host rows: check first (the xxh3 of every row), write only the good ones
        good = check_wire(rows, sums, expected)
        if good:
            ops.scatter_blocks(rows[:good], entries, torch.tensor(list(block_ids[:good])))
    for p in forward:
        await coll.send(p, buf)
    return good


class CollectiveTransport:
    """The ``Transport`` entry for ``nccl`` / ``gloo``: this process's ``Collective``. Its
    batches land straight in the receiving ranks' blocks (``direct``), so the pool drives
    it rank to rank (``raykv.service.pairs``) rather than through ``fetch``."""

    direct = True

    def __init__(self, collective: Collective) -> None:
        self.collective = collective
        self.name = collective.backend

    def endpoint(self) -> dict[str, Any]:
        return {"ident": self.collective.ident, "device": str(self.collective.device)}

    async def stream(
        self, source: str, model: str, keys: Sequence[bytes], endpoint: Any = None
    ) -> AsyncIterator[Any]:
        raise TransportError(
            f"{self.name} moves batches rank to rank into the reader's blocks (the pool's "
            "collective fetch); use the object store for a streamed fetch"
        )
        yield  # an async generator, like every transport's stream

"""``CollectiveTransport``: blocks move over torch.distributed, one message per batch.

Every process that holds a rank's KV (a pool and each of its TP ranks) has one
``Collective``: its end of raykv's **pairwise** process groups. A group has exactly two
ranks, the sender (rank 0) and the receiver (rank 1) of one direction between two
endpoints (``pair.Pair``: source, destination, generation, rendezvous). It is
built directly on a ``PrefixStore`` over the coordinator's ``TCPStore`` (no global
``init_process_group``), lazily, the first time the pair moves a batch; an endpoint's ident
names its actor incarnation, so a re-placed pool simply forms new pairs. Backend NCCL where
the KV lives on a GPU (advertised as ``nccl``), gloo where it lives in host memory
(``gloo``): the same code, so CI runs the protocol with gloo and GPU machines with NCCL.
Under Ray each GPU actor sees its own GPU as the current CUDA device (``cuda:0`` after
``CUDA_VISIBLE_DEVICES``); nothing here assumes a global index.

A batch crosses as one message up to 32 MiB, larger ones as a few (``wire``:
chunks of rows, the last one with every row's wire sum; never one per block), pipelined: the
sender's paged-copy kernel gathers chunk k+1 (taking each row's wire sum as it copies) while
chunk k is on the wire, and the receiver scatters chunk k into its blocks (recomputing the
sums as it copies) while chunk k+1 arrives. On a GPU every step is queued on CUDA streams in
one go (from C++ where the kernel extension has the NCCL pipeline,
``kernels/wire_pipeline.cpp``; the receiver's copies on a side stream of its own, so a peer
that never sends cannot stall the pool's stream) and the host waits once per batch. Only the
leading rows whose sums match become valid (a corrupt row ends the batch there; the rest are
misses, counted by the caller). Where the rows are in host memory (gloo) the checksums they
were stored with (row sums, the same function as the wire sums) are checked too; on a GPU they
travel with the blocks and are not recomputed on the host (a 2 GiB batch would cross PCIe
twice).

Operations of one pair run in order on one thread of their own (NCCL and gloo point-to-point
ops match in issue order, and both ends issue the same messages per batch), never on the
actor's event loop, and every wait is bounded (``timeout_s``): a peer that dies or never
answers ends as ``TransportError`` and the pair's group is aborted; the caller bumps the
generation, so the next batch forms a fresh group instead of reusing a broken one. A pair's
first batch runs on its thread (forming the group blocks until both ends join); once its
NCCL communicator is up later batches are issued straight from the event loop and their
completion is polled. Where both ends of an NCCL pair offer their pool as one exportable
allocation of the same size and layout, the pair registers it as an NCCL window when it forms
(``window``): between GPUs that can load from each other the reader then
reads the holder's blocks in place (``window``) instead of staging them.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from raykv import ops
from raykv.errors import InvalidInput, TransportError
from raykv.transport import completion
from raykv.transport.base import DirectTransport
from raykv.transport.collective.pair import Pair, node_address
from raykv.transport.collective.window import Windows
from raykv.transport.collective.wire import WirePlan, count_intact, leading_matches, shares
from raykv.transport.select import GLOO, NCCL

TIMEOUT_S = float(os.environ.get("RAYKV_COLLECTIVE_TIMEOUT_S", "30"))
CROSS, INNER = 0, 1  # a receiver's lanes: batches from another group / from its own replicas
log = logging.getLogger(__name__)


def backend_for(device: torch.device | str) -> str:
    """``nccl`` for KV on a GPU, ``gloo`` for KV in host memory."""
    return NCCL if torch.device(device).type == "cuda" else GLOO


def pipeline_call(fn: Callable[..., Any], what: str, *args: Any) -> Any:
    """``fn(*args)``: an entry of the C++ wire pipeline (``kernels/wire_pipeline.cpp``),
    ``wire_send`` or ``wire_recv`` (``args[3]`` the block ids, ``args[4]`` the pool's block
    count), its result (None for a send). Those entries check a batch's block ids as they read
    them and return the first bad one as an int, ``position * 4 + reason``, before anything is
    enqueued: the pipeline formats no message and throws nothing for bad input (both took the
    process down on the device's H100 host). That code is raised here as raykv's
    ``InvalidInput`` (``ops.bad_ids``)."""
    out = fn(*args)
    if isinstance(out, int):
        if out >= 0:
            raise ops.bad_ids(what, args[3], args[4], out)
        return None
    return out


@dataclass
class _Pending:
    """What one issued batch waits for: its ops, the receiver's last CUDA event, and the
    tensors that must live until then."""

    works: list[Any]
    event: Any = None
    keep: list[Any] = field(default_factory=list)


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
        self._stores: dict[tuple[str, int, int], Any] = {}  # (host, port, thread): client
        self._lock = threading.Lock()
        self._warmed: set[Pair] = set()  # NCCL pairs whose communicator is up
        self._sides: dict[int, Any] = {}  # the receiver's side stream per lane (GPU)
        self._wires: dict[int, Any] = {}  # the C++ pipeline's wire stream per lane (GPU)
        self._forward: Any = None  # the stream a receiver passes messages on from (GPU)
        self._comms: dict[Pair, int] = {}  # NCCL communicators of formed pairs (0: none)
        self._tables: dict[int, tuple[Any, tuple, ops.WireTable | None]] = {}  # _wire_table
        # this process's pool as one exportable allocation and its tensors' layout, which its
        # NCCL pairs register as a window (``window``); None: they stage
        self.window_memory: tuple[torch.Tensor, Any] | None = None
        self.windows = Windows()
        # tests: called with each message right before it is sent
        self.tamper: Callable[[torch.Tensor], None] | None = None

    # -- groups --

    def _store(self, addr: tuple[str, int]) -> Any:
        """This thread's client of the rendezvous store at ``addr``: one per pair thread, as a
        client's blocking wait holds its socket (two pairs forming at once in one process, an
        MLA share's receive and its replica's, would wait on each other's keys forever)."""
        import torch.distributed as dist

        with self._lock:
            key = (*addr, threading.get_ident())
            s = self._stores.get(key)
            if s is None:
                s = self._stores[key] = dist.TCPStore(
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

    def _form_comm(self, pair: Pair, pg: Any) -> None:
        """The group's NCCL communicator for the C++ pipeline (it exists after the group's
        first collective); both ends call this together, in the pair's first batch."""
        if pair in self._comms:
            return
        comm = 0
        if hasattr(pg, "_comm_ptr"):
            pg.allreduce([torch.zeros(1, device=self.device)])
            torch.cuda.current_stream(self.device).synchronize()
            comm = int(pg._comm_ptr())
        if self.backend == NCCL:
            self.windows.form_pair(pair, self.ident, comm, self._store(pair.store),
                                   self.window_memory)  # fmt: skip
        self._comms[pair] = comm

    def window(self, pair: Pair) -> torch.Tensor | None:
        """The holder's pool mapped here through ``pair``'s NCCL window (reader side; formed
        with the pair's first batch), or None: the pair stages its batches."""
        return self.windows.peer(pair)

    def sweep_windows(self) -> None:
        """Drop the pairs (and so the mappings) of window holders whose process is gone."""
        for p in self.windows.dead():
            self._drop(p)

    def _wire_table(self, entries: Sequence[torch.Tensor], width: int) -> ops.WireTable | None:
        """The C++ pipeline's view of ``entries`` where this process can run it (NCCL, the
        kernel built with it, spans aligned for fused sums), else None: the Python pipeline
        runs. Every end of a pair decides alike (same build, same layout), so both take the
        same path. Remembered per entries object (a pool passes the same list every batch;
        its items are compared by identity, so a list changed in place is looked at again):
        the entries are checked and their segment table built once, not per batch."""
        if self.backend != NCCL:
            return None
        hit = self._tables.get(id(entries))  # held here, so the id is not reused meanwhile
        if (
            hit is None
            or len(hit[1]) != len(entries)
            or any(a is not b for a, b in zip(hit[1], entries, strict=False))
        ):
            hit = (entries, tuple(entries), ops.wire_table(entries))
            self._tables[id(entries)] = hit
            while len(self._tables) > 64:
                self._tables.pop(next(iter(self._tables)))
        table = hit[2]
        if table is not None and table.width != width:
            raise InvalidInput(
                f"collective batch: rows of {width} bytes, but one block of every entry is "
                f"{table.width} bytes; pass row_bytes(entries)"
            )
        return table

    def _streams(self, lane: int = CROSS) -> tuple[Any, Any]:
        """(wire, forward): the streams the C++ pipeline's NCCL calls of ``lane`` run on."""
        if lane not in self._wires:
            self._wires[lane] = torch.cuda.Stream(self.device)
        if self._forward is None:
            self._forward = torch.cuda.Stream(self.device)
        return self._wires[lane], self._forward

    def _abort(self, pair: Pair) -> None:
        if self.windows.drop(pair):  # reads through its window finish before it unmaps
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError as e:  # a broken context: nothing left to wait for
                log.warning("collective %s: cannot wait for window reads (%r)", self.ident, e)
        self._comms.pop(pair, None)
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
            self._drop(p)

    def _drop(self, pair: Pair) -> None:
        """Abort ``pair`` after whatever its thread is doing."""
        ex = self._threads.pop(pair, None)
        if ex is not None:
            ex.submit(self._abort, pair)
            ex.shutdown(wait=False)
        else:
            self._abort(pair)

    # -- waiting for an issued batch, bounded --

    def _done(self, pending: _Pending) -> bool:
        return all(w.is_completed() for w in pending.works) and (
            pending.event is None or pending.event.query()
        )

    def _settle(self, pending: _Pending) -> None:
        for w in pending.works:  # surfaces an op's error (NCCL: completed, so no stall)
            if self.backend == GLOO:
                w.wait(datetime.timedelta(seconds=self.timeout_s))
            else:
                w.wait()

    def _wait_here(self, pending: _Pending) -> None:
        """Block this (pair) thread until ``pending`` is done, at most ``timeout_s``."""
        if self.backend == NCCL:  # NCCL: wait() would only order streams; poll
            completion.block_until_done(lambda: self._done(pending), self.timeout_s)
        self._settle(pending)

    async def _wait_loop(self, pending: _Pending) -> None:
        """The same from the event loop, without blocking it (NCCL only; spun on the loop
        first, then checked on the watcher thread: ``raykv.transport.completion``)."""
        await completion.until_done(lambda: self._done(pending), self.timeout_s)
        self._settle(pending)

    # -- running a batch's ops over its pairs --

    def _warm(self, pairs: Sequence[Pair]) -> bool:
        return all(p in self._warmed and p in self._groups for p in pairs)

    def _failure(self, pairs: Sequence[Pair], send: bool, e: BaseException) -> Exception:
        """The error a failed batch ends with; its pairs are aborted either way (the other end
        may have issued its half: the next batch forms fresh groups rather than mismatch)."""
        for p in pairs:
            self._abort(p)
        if isinstance(e, InvalidInput):  # bad block ids, refused before anything was enqueued
            return e
        peer = pairs[0].dst if send else pairs[0].src
        return TransportError(
            f"{self.backend} {'send to' if send else 'receive from'} {peer} failed "
            f"({type(e).__name__}: {str(e)[:200]}); the batch is a miss here, its pair is "
            "formed again next time"
        )

    def _issue(
        self,
        pairs: Sequence[Pair],
        program: Callable[[list[Any]], _Pending],
        send: bool,
        native: bool = False,
    ) -> Awaitable[_Pending]:
        """Runs ``program`` with the pairs' groups: on formed NCCL pairs now, from the caller
        (it only queues work), else on the first pair's thread, forming the groups there
        (both ends form them together; with ``native`` also their NCCL communicators, for
        the C++ pipeline). Returns what completes the batch, bounded."""
        for p in pairs:
            self.forget(p)
        if self._warm(pairs):
            try:
                pending = program([self._groups[p] for p in pairs])
            except Exception as e:
                err = self._failure(pairs, send, e)

                async def failed() -> _Pending:
                    raise err

                return failed()

            async def finish() -> _Pending:
                try:
                    await self._wait_loop(pending)
                except Exception as e:
                    raise self._failure(pairs, send, e) from e
                return pending

            return finish()

        def cold() -> _Pending:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            try:
                pgs = [self._group(p) for p in pairs]
                if native:
                    for p, pg in zip(pairs, pgs, strict=True):
                        self._form_comm(p, pg)
                pending = program(pgs)
                self._wait_here(pending)
            except Exception as e:
                raise self._failure(pairs, send, e) from e
            return pending

        async def run() -> _Pending:
            pending = await self._run(pairs[0], cold)
            if self.backend == NCCL:  # communicators up: later batches are issued inline
                self._warmed.update(pairs)
            return pending

        return run()

    async def _run(self, pair: Pair, fn: Callable[[], Any]) -> Any:
        """``fn`` on the pair's own thread (its ops in order), at most ``timeout_s`` (plus the
        rendezvous) without blocking the event loop."""
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

    # -- batches of blocks --

    def _host_ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The ids as int64, pinned on a GPU host: each chunk's copy reads them on the device
        without the host waiting for the device."""
        cuda = self.device.type == "cuda"
        ids = torch.empty(len(block_ids), dtype=torch.long, pin_memory=cuda)
        ids.numpy()[:] = block_ids
        return ids

    def _side_stream(self, lane: int = CROSS, after_pool: bool = True) -> Any:
        """The receiver's own stream of ``lane`` (GPU), after what the pool queued so far
        (``after_pool``; the C++ pipeline orders it itself)."""
        if lane not in self._sides:
            self._sides[lane] = torch.cuda.Stream(self.device)
        if after_pool:
            self._sides[lane].wait_stream(torch.cuda.current_stream(self.device))
        return self._sides[lane]

    def _side(self, lane: int = CROSS) -> contextlib.AbstractContextManager:
        """The receiver's stream of ``lane`` as the current one on a GPU (nothing on the
        CPU)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.cuda.stream(self._side_stream(lane))

    def start_send(
        self, pair: Pair, entries: Sequence[torch.Tensor], block_ids: Sequence[int], width: int
    ) -> Awaitable[int]:
        """Gathers every row of ``block_ids`` now, in stream order (a later write to those
        blocks cannot reach this batch), and sends the batch; the awaitable ends with the
        bytes sent. On a formed NCCL pair each message is queued right behind its gather."""
        plan = WirePlan.of(len(block_ids), width)
        table = self._wire_table(entries, width)
        buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.device)

        def send(pg: Any, msg: torch.Tensor) -> Any:
            if self.tamper is not None:
                self.tamper(msg)
            return pg.send([msg], 1, 0)

        def enqueue(comm: int, gather: bool) -> _Pending:  # the C++ pipeline
            if self.tamper is not None:
                self.tamper(buf)
            wire = self._streams()[0]
            pipeline_call(
                table.module.wire_send, "collective send",
                comm, 1, table.table, block_ids, table.num_blocks, buf.data_ptr(), width,
                plan.counts, gather, table.ctas, wire.cuda_stream,
            )  # fmt: skip
            done = torch.cuda.Event()
            done.record(wire)
            return _Pending([], done, [buf])

        def pipelined(pgs: list[Any]) -> _Pending:
            if table is not None and self._comms.get(pair):
                return enqueue(self._comms[pair], True)
            works: list[Any] = []
            messages = plan.messages(buf)

            def each(start: int, count: int) -> None:  # the last message: rows and sums
                works.append(send(pgs[0], messages[len(works)]))

            rows, sums = plan.split(buf)
            ops.gather_blocks(entries, ids, rows, sums=sums, chunks=plan.counts, each=each)
            return _Pending(works, None, [buf, ids])

        def sends(pgs: list[Any]) -> _Pending:
            if table is not None and self._comms.get(pair):
                return enqueue(self._comms[pair], False)
            return _Pending([send(pgs[0], m) for m in plan.messages(buf)], None, [buf, ids])

        if self._warm([pair]):
            native = table is not None and bool(self._comms.get(pair))
            ids = None if native else self._host_ids(block_ids)  # the pipeline uploads its own
            done = self._issue([pair], pipelined, True)
        else:  # the group forms on the pair's thread later: gather everything now
            ids = self._host_ids(block_ids)
            rows, sums = plan.split(buf)
            ops.gather_blocks(entries, ids, rows, sums=sums)
            done = self._issue([pair], sends, True, native=table is not None)

        async def sent() -> int:
            await done
            return int(buf.numel())

        return sent()

    async def recv_batch(
        self,
        pair: Pair,
        entries: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        width: int,
        expected: Sequence[int] | None = None,
        forward: Sequence[Pair] = (),
        lane: int = CROSS,
    ) -> int:
        """Receive ``len(block_ids)`` rows from ``pair.src`` into ``block_ids``, passing each
        message on to ``forward`` (replicas of the same copy, e.g. an MLA latent: it crossed
        once) as it arrives. Returns how many leading blocks hold intact rows; only those may
        become valid (every row is scattered, the check follows: the blocks are the reader's
        own and not valid yet). ``lane``: the GPU streams it runs on, ``CROSS`` for a batch
        from another group, ``INNER`` for one a replica of this group passes on (see
        ``recv_shares``: an inner batch waits for the sender's cross batch, so the two must
        not queue on one stream)."""
        plan, cuda = WirePlan.of(len(block_ids), width), self.device.type == "cuda"
        table = self._wire_table(entries, width)
        buf = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.device)
        good: list[torch.Tensor] = []  # the count of intact rows, once the batch is done

        def enqueue(comm: int, forwards: list[int]) -> _Pending:  # the C++ pipeline
            wire, fwd_stream = self._streams(lane)
            side = self._side_stream(lane, after_pool=False)  # the pipeline orders it
            good.append(
                pipeline_call(
                    table.module.wire_recv, "collective receive",
                    comm, 0, table.table, block_ids, table.num_blocks, buf.data_ptr(), width,
                    plan.counts, table.ctas, side.cuda_stream, wire.cuda_stream, forwards,
                    fwd_stream.cuda_stream,
                )
            )  # fmt: skip
            done = torch.cuda.Event()
            done.record(side)
            return _Pending([], done, [buf])

        def program(pgs: list[Any]) -> _Pending:
            comms = [self._comms.get(p, 0) for p in (pair, *forward)]
            if table is not None and all(comms):
                return enqueue(comms[0], comms[1:])
            ids = self._host_ids(block_ids)
            # the recomputed sums, and the count of intact rows
            got = torch.empty(plan.n, dtype=torch.int64, device=self.device)
            good.append(torch.empty(1, dtype=torch.int64, pin_memory=cuda))
            feed, fwd = pgs[0], pgs[1:]
            rows, wire_sums = plan.split(buf)
            messages = plan.messages(buf)
            with self._side(lane):
                recvs = [feed.recv([m], 0, 0) for m in messages]  # all posted at once
                works = list(recvs) if cuda else []  # gloo: waited below (a second wait hangs)
                arrived = iter(zip(recvs, messages, strict=True))

                def take() -> None:  # the next message is in (on a GPU: for the side stream)
                    r, m = next(arrived)
                    r.wait() if cuda else r.wait(datetime.timedelta(seconds=self.timeout_s))
                    works.extend(f.send([m], 1, 0) for f in fwd)

                ops.scatter_blocks(  # the last message brings the sums too
                    rows, entries, ids, sums=got, chunks=plan.counts, each=lambda s, c: take()
                )
                good[0].copy_(leading_matches(got, wire_sums), non_blocking=cuda)
                event = torch.cuda.Event() if cuda else None
                if event is not None:
                    event.record()
            return _Pending(works, event, [buf, ids, got])

        await self._issue([pair, *forward], program, False, native=table is not None)
        if cuda:  # the stored checksums are not recomputed on a GPU (count_intact)
            return int(good[0][0])
        return count_intact(int(good[0][0]), plan.split(buf)[0], expected)

    async def recv_shares(
        self,
        cross: Pair,
        replicas: Sequence[str],
        entries: Sequence[torch.Tensor],
        block_ids: Sequence[int],
        width: int,
        expected: Sequence[int] | None = None,
    ) -> int:
        """This rank's receive of a copy that ``replicas`` (the idents of this group's ranks
        holding it, in rank order; this rank is ``cross.dst``) share, e.g. an MLA latent
        under TP: share ``j`` of ``block_ids`` (``shares``; a small batch is one share, of
        replica 0) crosses from the holder's replica ``j`` to ours, which passes it on to the
        other replicas as it arrives; the other shares come from them. One copy crosses
        between the groups, each link carries a share of it, and every replica ends with all
        of it. Returns how many leading blocks hold intact rows (the count stops in the
        first share short of intact)."""
        me = list(replicas).index(cross.dst)
        cuts = shares(len(block_ids), len(replicas), width)
        others = [j for j in range(len(replicas)) if j != me]
        live = [j for j in [me, *others] if cuts[j]]  # the crossing share issued first
        calls = []
        for j in live:
            ids = list(block_ids[cuts[j].start : cuts[j].stop])
            exp = None if expected is None else list(expected[cuts[j].start : cuts[j].stop])
            if j == me:  # from the holder's replica, passed on to ours
                fwd = [Pair(cross.dst, replicas[x], cross.gen, cross.store) for x in others]
                calls.append(self.recv_batch(cross, entries, ids, width, exp, fwd, CROSS))
            else:  # from our replica j, which got it from the holder's
                feed = Pair(replicas[j], cross.dst, cross.gen, cross.store)
                calls.append(self.recv_batch(feed, entries, ids, width, exp, (), INNER))
        counts = dict(zip(live, await asyncio.gather(*calls), strict=True))
        good = 0
        for j, cut in enumerate(cuts):
            good += counts.get(j, 0)
            if counts.get(j, 0) < len(cut):
                break
        return good

    def close(self) -> None:
        for p in list(self._groups):
            self._abort(p)
        for ex in self._threads.values():
            ex.shutdown(wait=False)
        self._threads.clear()


# --- the Transport entry -------------------------------------------------------------------


class CollectiveTransport(DirectTransport):
    """The ``Transport`` entry for ``nccl`` / ``gloo`` (``raykv.transport.select`` routes a pair
    over it): this process's ``Collective``. Its batches land straight in the receiving ranks'
    blocks (``direct``), so the pool drives it rank to rank (``raykv.service.pool.pairs``) rather
    than through ``fetch``."""

    instead = "nccl and gloo move batches rank to rank into the reader's blocks"

    def __init__(self, collective: Collective) -> None:
        self.collective = collective
        self.name = collective.backend

    def endpoint(self) -> dict[str, Any]:
        return {"ident": self.collective.ident, "device": str(self.collective.device)}

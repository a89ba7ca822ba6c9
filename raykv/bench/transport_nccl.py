"""The NCCL section of ``raykv bench transport`` (``raykv.bench.transport``).

* NCCL (``nccl_*``): ``2 x tp`` processes, one GPU each, every one seeing only its own GPU
  (``CUDA_VISIBLE_DEVICES``, as under Ray). Group A (GPUs 0..tp-1) holds a paged KV (4 layers,
  K and V, 16 tokens, 2 KV heads of 128, bf16: 64 KiB per block and rank), group B reads. Rank
  r of A sends ``--blocks`` scattered blocks to rank r of B through raykv's transport
  (``raykv.transport.collective``: one ``wire`` message up to 32 MiB, larger batches in a few,
  pipelined: the paged gather takes each chunk's wire sums as it copies and the chunk leaves
  while the next is gathered; the receiver scatters each chunk, recomputing its sums, while the
  next one arrives), against one contiguous NCCL send of the same bytes per rank pair (queued,
  and waited for one at a time) and (tp 1) one NCCL send/recv per block. With ``--tp N`` also an
  MLA-like layout (one copy per TP group): it crosses once, in shares (rank j of A sends share j
  to rank j of B, which passes it on to its other ranks: ``Collective.recv_shares``; whole from
  rank 0 where a share would be under ``SHARE_MIN_BYTES``); the wire bytes are one copy. Its
  baselines: one contiguous send of the whole copy over rank pair 0, and the *crossing* alone
  (each rank pair sends its share contiguously, all at once, nothing passed on). Timed on the
  receivers: ``rounds`` of ``burst`` back-to-back batches after a barrier, median round; GB/s of
  payload (the rows) per rank pair. *raykv* waits for each batch before it issues the next (one
  load at a time; the burst awaited in one run of an event loop, as a pool's loop runs all
  along); *in flight* issues the burst's batches back to back and then waits for them together
  (several loads at once). Likewise *contiguous queued* issues its sends one after another
  without a host wait (a torch ``Work.wait()`` on NCCL only orders streams), *contiguous one at
  a time* waits for each: raykv one at a time compares with the latter, in flight with the
  former. With CUDA both of those run once more queued behind a GPU sleep and timed with CUDA
  events (*GPUs alone*: no host time in them, the ceiling the host's work adds to). The reader's
  one control round trip (a Ray actor call, ~1 ms) is not in these numbers. ``--cpu-smoke`` runs
  the same processes with gloo on the CPU (a check of the bench, not a measurement).
* Peer reads (``raykv.transport.peer_read``, split-heads rows, per rank pair): A's pool lives
  in memory B's process
  maps (``raykv.tiers.peer_memory``; shared memory on the CPU); B's kernel copies A's blocks
  straight into its own with their wire sums (``raykv.ops.pools.PoolCopy``, one extension call) and
  checks them against the sums A stated. The halves run one after the other, as in the
  service: A states the sums of its blocks, then B reads; *peer* is B's read alone (the
  holder's sums known: a pool takes them as its blocks become valid and keeps them while they
  stay valid), *unsummed* adds A's pass (a read that comes before those sums are in). B's
  blocks are zeroed before the peer rounds, so the bytes-equal check after them is theirs.
* NCCL windows (``raykv.transport.collective.window``, CUDA): B's pool is one exportable
  allocation too, and the pair's first batch registers both as an NCCL window; where every
  rank pair got one, *window* is the same read in place from A's pool as NCCL mapped it (what
  the service's NCCL route does between GPUs of one host), checked equal after its rounds.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from raykv.errors import ConfigError
from raykv.layout.presets import get_preset
from raykv.transport.collective.wire import SHARE_MIN_BYTES, shares

NCCL_TARGET = 0.8  # raykv >= 0.8 x one contiguous NCCL send of the same bytes
# a GPU sleep per 320 MiB of a burst (~20 ms at 2 GHz): the host issues ten 32 MiB chunks in
# well under 1 ms, so the whole burst is queued before the sleep ends
AHEAD_CYCLES, AHEAD_BYTES = 40_000_000, 320 << 20


@dataclass(frozen=True)
class NcclConfig:
    tp: int = 1
    blocks: int = 512
    layers: int = 4
    kv_heads: int = 2
    head_dim: int = 128
    block_size: int = 16
    rounds: int = 7
    burst: int = 10
    cuda: bool = True
    preset: str | None = None  # the layout of a model preset (``for_preset``)
    latent: bool = False  # MLA: one latent entry per layer, the same on every rank

    @classmethod
    def for_preset(cls, name: str, tokens: int, tp: int = 1, **kw: Any) -> NcclConfig:
        """A batch of ``tokens`` in preset ``name``'s KV layout, per rank as its TP-``tp``
        pools hold it (the planner's heads per rank; MLA: the latent, one copy per group):
        issue 13's cross-group load is ``for_preset("llama-3-8b", 32768, 2)``."""
        from raykv.layout import MLA, FullAttention
        from raykv.layout.specs import dtype_bytes

        specs = list(get_preset(name).layers().values())
        kind = type(specs[0])
        if kind not in (FullAttention, MLA) or any(s != specs[0] for s in specs):
            raise ConfigError(
                f"the NCCL bench takes a preset whose layers are all one full-attention or "
                f"one MLA spec; {name!r} mixes {sorted({type(s).__name__ for s in specs})}"
            )
        spec = specs[0]
        if dtype_bytes(spec.dtype) != 2:
            raise ConfigError(f"the NCCL bench moves 2-byte KV; {name!r} is {spec.dtype}")
        block_size = kw.pop("block_size", cls.block_size)
        if tokens < block_size or tokens % block_size:
            raise ConfigError(
                f"--tokens {tokens} is not a positive multiple of the block size {block_size}"
            )
        if kind is MLA:
            heads, dim = 1, spec.kv_lora_rank + spec.qk_rope_head_dim
        else:
            heads, dim = spec.kv_heads_per_rank(tp), spec.head_dim
        return cls(
            tp=tp, blocks=tokens // block_size, layers=len(specs), kv_heads=heads,
            head_dim=dim, block_size=block_size, preset=name, latent=kind is MLA, **kw,
        )  # fmt: skip

    @property
    def kinds(self) -> int:  # entries per layer: K and V, or one latent
        return 1 if self.latent else 2

    @property
    def row_bytes(self) -> int:  # every entry of every layer, bf16
        return self.layers * self.kinds * self.block_size * self.kv_heads * self.head_dim * 2

    @property
    def num_blocks(self) -> int:
        return 2 * self.blocks + 8

    @property
    def layouts(self) -> list[str]:
        """``split``: each rank pair moves its own rows; ``mla``: one copy per TP group
        crosses once. A preset has its own; the synthetic layout runs both under TP."""
        if self.preset is not None:
            return ["mla" if self.latent else "split"]
        return ["split", "mla"] if self.tp > 1 else ["split"]


def nccl_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# --- the pools -------------------------------------------------------------------------------
# random bytes per rank, in fresh tensors or in memory another process of the host maps; the
# blocks a batch moves; rows gathered for the checks


def pool(
    cfg: NcclConfig, device: torch.device, seed: int, into: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The paged KV's entries (K and V, or the latent, of each layer), random bytes from
    ``seed``, made on ``device`` (a preset's pool is GiBs); ``into``: one uint8 tensor per layer
    to hold them (memory a peer maps), else fresh tensors."""
    g = torch.Generator(device).manual_seed(seed)
    out = []
    for i in range(cfg.layers):
        raw = torch.randint(0, 256, layer_shape(cfg), generator=g, dtype=torch.uint8,
                            device=device)  # fmt: skip
        if into is not None:
            into[i].copy_(raw.view(-1))
            raw = into[i].view(raw.shape)
        out += raw.view(torch.bfloat16).unbind(0)
    return out


def layer_shape(cfg: NcclConfig) -> tuple[int, ...]:
    """One layer's entries as bytes: ``[kinds, blocks, block_size, heads, 2 * head_dim]``."""
    return (cfg.kinds, cfg.num_blocks, cfg.block_size, cfg.kv_heads, 2 * cfg.head_dim)


def layer_bytes(cfg: NcclConfig) -> int:
    return math.prod(layer_shape(cfg))


def shared_pool(cfg: NcclConfig, device: torch.device, seed: int):
    """(entries, handle): the holder's KV in memory a process of this host maps with
    ``GpuKV.open_handles``-style handles (a CUDA ``PeerSpec``, CPU shared-memory specs)."""
    shapes = [(layer_bytes(cfg),)] * cfg.layers
    if device.type == "cuda":
        from raykv.tiers.peer_memory import PeerExport

        export = PeerExport(shapes, device)
        return pool(cfg, device, seed, export.tensors), export
    from raykv.tiers import shm

    made = [shm.create(shape, f"bench{i}") for i, shape in enumerate(shapes)]
    return pool(cfg, device, seed, [t for t, _ in made]), [spec for _, spec in made]


def open_pool(cfg: NcclConfig, device: torch.device, handle) -> list[torch.Tensor]:
    """The holder's entries mapped here (``shared_pool``'s handle)."""
    from raykv.tiers.peer_memory import open_tensors

    return entries_of(cfg, open_tensors(handle, device))


def entries_of(cfg: NcclConfig, raws: list[torch.Tensor]) -> list[torch.Tensor]:
    """A pool's entries over its raw uint8 tensors, one per layer."""
    return [e for raw in raws for e in raw.view(layer_shape(cfg)).view(torch.bfloat16).unbind(0)]


def block_ids(cfg: NcclConfig, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(cfg.num_blocks - 1, generator=g)[: cfg.blocks] + 1).tolist()


def rows(entries: list[torch.Tensor], ids: list[int], width: int) -> torch.Tensor:
    from raykv import ops

    dst = torch.empty((len(ids), width), dtype=torch.uint8, device=entries[0].device)
    ops.gather_blocks(entries, torch.tensor(ids), dst)
    return dst


# --- one process -----------------------------------------------------------------------------


def _group(store, prefix: str, rank: int, size: int, cuda: bool):
    import torch.distributed as dist

    ps = dist.PrefixStore(prefix, store)
    if cuda:
        return dist.ProcessGroupNCCL(ps, rank, size, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(ps, rank, size, datetime.timedelta(seconds=120))


def _nccl_worker(side: str, r: int, cfg: NcclConfig, addr: tuple[str, int], q) -> None:
    try:
        q.put((side, r, _nccl_measure(side, r, cfg, addr)))
    except Exception as e:  # the parent reports it
        q.put((side, r, {"error": f"{type(e).__name__}: {e}"}))


def _nccl_measure(side: str, r: int, cfg: NcclConfig, addr: tuple[str, int]) -> dict:
    import pickle

    import torch.distributed as dist

    from raykv import ops
    from raykv.ops.pools import PoolCopy
    from raykv.transport.collective import Collective
    from raykv.transport.collective.pair import Pair
    from raykv.transport.peer_read import read_blocks, stated_sums

    device = torch.device("cuda", 0) if cfg.cuda else torch.device("cpu")
    if cfg.cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore(addr[0], addr[1], is_master=False)
    a, me = side == "A", f"{side}{r}"
    world = _group(store, "world/", r if a else cfg.tp + r, 2 * cfg.tp, False)  # barriers
    base = _group(store, f"base/{r}/", 0 if a else 1, 2, cfg.cuda)
    coll = Collective(me, device, timeout_s=120)
    if a or cfg.cuda:  # in memory the other end maps (peer reads; on CUDA the NCCL window)
        entries, handle = shared_pool(cfg, device, (1000 if a else 2000) + r)
    else:
        entries = pool(cfg, device, 2000 + r)
    if a:
        store.set(f"peer/{r}", pickle.dumps(handle if isinstance(handle, list) else handle.spec))
    if cfg.cuda:  # as a pool's ranks keep it (``raykv.service.pool.pairs``)
        coll.window_memory = (handle.buffer, handle.spec.tensors)
    src_ids, dst_ids = block_ids(cfg, 1), block_ids(cfg, 2)
    width, n = cfg.row_bytes, cfg.blocks
    loop = asyncio.new_event_loop()
    flat = torch.empty(n * width, dtype=torch.uint8, device=device)
    if a:
        flat.copy_(rows(entries, src_ids, width).view(-1))

    def pair(src: str, dst: str) -> Pair:
        return Pair(src, dst, 0, addr)

    cut = shares(n, cfg.tp, width)[r]  # this rank pair's share of an MLA copy
    replicas = [f"B{x}" for x in range(cfg.tp)]

    async def nothing() -> int:
        return 0

    def batch(layout: str) -> Any:
        """One batch's awaitable (a send is issued now, a receive once awaited). MLA: each
        rank of A sends its share of the one copy, each rank of B receives its share and
        passes it on to its group (``Collective.recv_shares``)."""
        if a:
            ids = src_ids[cut.start : cut.stop] if layout == "mla" else src_ids
            if not ids:
                return nothing()
            return coll.start_send(pair(me, f"B{r}"), entries, ids, width)
        if layout == "mla":
            return coll.recv_shares(pair(f"A{r}", me), replicas, entries, dst_ids, width)
        return coll.recv_batch(pair(f"A{r}", me), entries, dst_ids, width)

    async def raykv(layout: str) -> int:
        return await batch(layout)

    def in_flight(layout: str, burst: int) -> int:
        """``burst`` batches issued back to back, then awaited together (several requests'
        loads at once): every batch is issued before the first one is waited for."""
        t0 = time.perf_counter()
        batches = [batch(layout) for _ in range(burst)]
        if a:  # on a formed pair each call enqueues its batch: the host's cost per batch
            issue.append((time.perf_counter() - t0) / burst)
        return loop.run_until_complete(_together(batches))

    issue: list[float] = []  # seconds the sender's host spent issuing one batch (in flight)

    holder = PoolCopy(entries)  # A: its blocks' sums

    def contiguous(layout: str) -> None:  # queued: wait() orders streams, the host goes on
        if layout == "mla" and r:
            return
        (base.send([flat], 1, 0) if a else base.recv([flat], 0, 0)).wait()

    def contiguous_waited(layout: str) -> None:  # the host waits for each, as raykv's column
        contiguous(layout)
        sync()

    even = shares(n, cfg.tp, width, 0)[r]  # the crossing alone: an even share per rank pair

    def crossing(layout: str) -> None:  # MLA: each rank pair its share, contiguous, at once
        m = flat[even.start * width : even.stop * width]
        if m.numel():
            (base.send([m], 1, 0) if a else base.recv([m], 0, 0)).wait()

    def crossing_waited(layout: str) -> None:
        crossing(layout)
        sync()

    def per_block(layout: str) -> None:
        views = flat.view(n, width)
        works = [
            base.send([views[i]], 1, 0) if a else base.recv([views[i]], 0, 0) for i in range(n)
        ]
        for w in works:
            w.wait()

    def sync() -> None:
        if cfg.cuda:
            torch.cuda.synchronize(device)

    def barrier() -> None:
        sync()
        world.allreduce([torch.zeros(1)]).wait()

    layouts = cfg.layouts

    def one_by_one(fn):
        def batches(layout: str, burst: int):
            for _ in range(burst):
                got = fn(layout)
            return got

        return batches

    def awaited_one_by_one(fn):
        """Each batch awaited before the next starts, in one run of the event loop: a pool's
        loop is always running, so starting it per batch (~10 us) is the bench's cost, not
        the transport's."""

        async def batches(layout: str, burst: int):
            for _ in range(burst):
                got = await fn(layout)
            return got

        return lambda layout, burst: loop.run_until_complete(batches(layout, burst))

    readers: dict[str, tuple[Any, Any]] = {}  # B's copy and read of each read in place

    def in_place(label: str, src: list[torch.Tensor] | None) -> dict:
        """A read in place of A's blocks, as the service runs one: A states its blocks'
        sums (the control call), then B's kernel copies them from ``src`` (A's pool as
        mapped here) into its own, taking the same sums. ``label`` one at a time and
        ``label_in_flight``."""
        reader = None if a else PoolCopy(src, entries)
        stated = [] if a else stated_sums(PoolCopy(src), src_ids)

        def read() -> Any:
            return read_blocks(reader, src_ids, dst_ids, stated, 120)

        async def one(layout: str) -> int:
            if a:
                return len(stated_sums(holder, src_ids))
            return await read()

        def in_flight(layout: str, burst: int) -> int:
            if a:
                sums = [holder.start(src_ids) for _ in range(burst)]
                sync()
                return len(holder.sums(sums[-1]))
            return loop.run_until_complete(_together([read() for _ in range(burst)]))

        readers[label] = (reader, read)
        return {label: awaited_one_by_one(one), f"{label}_in_flight": in_flight}

    # peer reads: B maps A's pool itself (``raykv.tiers.peer_memory``)
    mapped = None if a else open_pool(cfg, device, pickle.loads(store.get(f"peer/{r}")))
    peers = in_place("peer", mapped)
    # the pair's NCCL window (``raykv.transport.collective.window``), formed with its first batch:
    # where every rank pair has one, B reads A's pool as NCCL mapped it
    windows: dict = {}
    if cfg.cuda and "split" in cfg.layouts:
        loop.run_until_complete(batch("split"))
        window = None if a else coll.window(pair(f"A{r}", me))
        if not a:
            store.set(f"window/{r}", "1" if window is not None else "0")
        if all(store.get(f"window/{j}") == b"1" for j in range(cfg.tp)):
            from raykv.tiers.peer_memory import carve

            src = None if a else entries_of(cfg, carve(window, handle.spec.tensors))
            windows = in_place("window", src)
    halves = {**peers, **windows}

    gpu_seconds: list[float] = []  # the last burst's GPU time (``ahead``)

    def ahead(fn):
        """``fn``'s burst queued behind a GPU sleep long enough for the host to issue all of
        it, timed with CUDA events from the sleep's end to the burst's: the GPUs' time alone,
        no host time in it (both ends leave the barrier together, so their sleeps end within
        the barrier's skew)."""

        def batches(layout: str, burst: int):
            stream = torch.cuda.current_stream(device)
            torch.cuda._sleep(AHEAD_CYCLES * max(1, math.ceil(burst * n * width / AHEAD_BYTES)))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            got = fn(layout, burst)  # returns once every batch of the burst is done
            end.record(stream)
            end.synchronize()
            gpu_seconds[:] = [start.elapsed_time(end) / 1e3]
            return got

        return batches

    methods = {
        "raykv": awaited_one_by_one(raykv),
        "in_flight": in_flight,
        "contiguous": one_by_one(contiguous),
        "contiguous_waited": one_by_one(contiguous_waited),
    }
    if cfg.cuda:
        methods["in_flight_gpu"] = ahead(in_flight)
        methods["contiguous_gpu"] = ahead(one_by_one(contiguous))
    if cfg.tp == 1:
        methods["per_block"] = one_by_one(per_block)
    crossings = {"crossing": one_by_one(crossing), "crossing_waited": one_by_one(crossing_waited)}
    out: dict = {"device": torch.cuda.get_device_name(device) if cfg.cuda else "cpu"}

    wanted: dict[str, torch.Tensor] = {}  # A's rows per layout, made once (a preset: GiBs)

    def equal(layout: str) -> bool:
        """Every byte B holds now equals A's (its rank's copy; MLA: share j from rank j)."""
        if layout not in wanted:
            parts = [(r, range(n))] if layout != "mla" else enumerate(shares(n, cfg.tp, width))
            wanted[layout] = torch.cat([
                rows(pool(cfg, device, 1000 + j), src_ids[c.start : c.stop], width)
                for j, c in parts if c
            ])  # fmt: skip
        return bool(torch.equal(rows(entries, dst_ids, width), wanted[layout]))

    for layout in layouts:
        extra = halves if layout == "split" else crossings if cfg.tp > 1 else {}
        for name, fn in {**methods, **extra}.items():
            if name in readers and not a:  # what a read in place writes is checked on its own
                ops.scatter_blocks(
                    torch.zeros((n, width), dtype=torch.uint8, device=device), entries,
                    torch.tensor(dst_ids),
                )  # fmt: skip
            burst = 2 if name == "per_block" else cfg.burst
            barrier()
            fn(layout, 1)  # warm: forms the pair's communicator
            sync()
            times = []
            for _ in range(cfg.rounds):
                barrier()
                # a peer read's halves run one after the other, as in the service (the
                # holder's sums answer the control call, then the reader copies): A times
                # its half while B waits, then B its half
                mine = not (name in halves and not a)
                if mine:
                    t0 = time.perf_counter()
                    got = fn(layout, burst)
                    sync()
                    took = gpu_seconds[0] if name.endswith("_gpu") else time.perf_counter() - t0
                    times.append(took / burst)
                if name in halves:
                    barrier()
                if not mine:
                    t0 = time.perf_counter()
                    got = fn(layout, burst)
                    sync()
                    times.append((time.perf_counter() - t0) / burst)
                if name in ("raykv", "in_flight", "in_flight_gpu", *halves) and not a:
                    out.setdefault(f"{layout}/good", []).append(got)
            out[f"{layout}/{name}"] = statistics.median(times)
            if name in readers and not a:
                out[f"{layout}/{name}/equal"] = equal(layout)
        if not a:
            out[f"{layout}/equal"] = equal(layout)
            wanted.pop(layout)
    if issue:  # the warm-up burst of 1 left out
        out["phase/send_issue_ms"] = statistics.median(issue[1:] or issue) * 1e3
    # where one batch's time goes, each phase alone (after the checks: it writes B's blocks)
    out.update(_phases(a, cfg, entries, src_ids if a else dst_ids, width, sync))
    # the peer read's parts alone, A's then B's (B's blocks were checked above)
    for turn in (True, False):
        barrier()
        if a == turn:
            reader, read = readers["peer"]
            out.update(_peer_phases(holder if a else reader, src_ids, dst_ids, sync, loop, read))
    barrier()
    coll.close()
    return out


async def _together(batches: list) -> int:
    """Awaits every batch (started in order), returns the last one's result."""
    return (await asyncio.gather(*batches))[-1]


def _timed(sync, fn) -> float:
    """Milliseconds of ``fn`` alone, waited for (median of 20)."""
    times = []
    for _ in range(20):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _phases(sender: bool, cfg: NcclConfig, entries, ids, width: int, sync) -> dict:
    """Milliseconds of each copy of raykv's batch alone, whole batch (median of 20): the
    paged copy with the wire sums taken as it copies, and without them."""
    from raykv import ops

    device = entries[0].device
    staged = torch.empty((len(ids), width), dtype=torch.uint8, device=device)
    sums = torch.empty(len(ids), dtype=torch.int64, device=device)
    ids_t = torch.tensor(ids)
    if sender:
        return {
            "phase/gather_ms": _timed(sync, lambda: ops.gather_blocks(entries, ids_t, staged)),
            "phase/gather+sums_ms": _timed(
                sync, lambda: ops.gather_blocks(entries, ids_t, staged, sums=sums)
            ),
        }
    return {
        "phase/scatter_ms": _timed(sync, lambda: ops.scatter_blocks(staged, entries, ids_t)),
        "phase/scatter+sums_ms": _timed(
            sync, lambda: ops.scatter_blocks(staged, entries, ids_t, sums=sums)
        ),
    }


def _peer_phases(copy, src_ids, dst_ids, sync, loop, read) -> dict:
    """Milliseconds of a peer read's parts alone (median of 20): the holder's sums (with the
    host's wait for them), the reader's copy with sums (one extension call), and the whole
    read (``read_blocks``)."""
    from raykv.transport.peer_read import stated_sums

    if copy.dst is None:
        return {"phase/peer_holder_sums_ms": _timed(sync, lambda: stated_sums(copy, src_ids))}
    return {
        "phase/peer_copy+sums_ms": _timed(sync, lambda: copy.start(src_ids, dst_ids)),
        "phase/peer_read_ms": _timed(sync, lambda: loop.run_until_complete(read())),
    }


# --- the parent ------------------------------------------------------------------------------


def nccl_run(cfg: NcclConfig, timeout_s: float = 480.0) -> dict:
    """Start the ``2 x tp`` processes (each seeing one GPU), gather their timings."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    addr = ("127.0.0.1", int(store.port))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(max(nccl_gpus(), 1))]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for i, (side, r) in enumerate(
        [("A", r) for r in range(cfg.tp)] + [("B", r) for r in range(cfg.tp)]
    ):
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if cfg.cuda:
            os.environ["CUDA_VISIBLE_DEVICES"] = gpus[i]  # the child sees its GPU as cuda:0
        p = ctx.Process(target=_nccl_worker, args=(side, r, cfg, addr, q), daemon=True)
        p.start()
        procs.append(p)
        if env is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env
    results: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the NCCL bench did not finish within {timeout_s:.0f}s")
            side, r, res = q.get(timeout=left)
            if "error" in res:
                raise RuntimeError(f"NCCL bench process {side}{r}: {res['error']}")
            results[(side, r)] = res
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return nccl_report(cfg, results)


def nccl_main(
    nccl: bool | None = None,
    tp: int = 1,
    blocks: int = 512,
    rounds: int = 7,
    cpu_smoke: bool = False,
    echo=print,
    preset: str | None = None,
    tokens: int | None = None,
) -> dict | None:
    """The NCCL section if asked for (None: where this machine has 2 x tp GPUs); its report,
    or None when skipped (said through ``echo``). ``preset``: batches of ``tokens`` (default
    ``blocks`` blocks' worth) in that model's KV layout per rank (``NcclConfig.for_preset``)
    instead of the synthetic 64 KiB blocks."""
    if tokens is not None and preset is None:
        raise ConfigError("--tokens sizes a --preset's batch; give --preset too, or --blocks")
    cfg = NcclConfig(tp=tp, blocks=blocks, rounds=rounds, cuda=not cpu_smoke)
    if preset is not None:  # checked before the GPUs are, so a wrong name fails anywhere
        cfg = NcclConfig.for_preset(preset, tokens or blocks * cfg.block_size, tp, rounds=rounds,
                                    cuda=cfg.cuda)  # fmt: skip
    if nccl is None:
        nccl = cpu_smoke or nccl_gpus() >= 2 * tp
    if not nccl:
        echo(f"NCCL: skipped ({nccl_gpus()} GPUs; --tp {tp} needs {2 * tp})")
        return None
    if cfg.cuda and nccl_gpus() < 2 * tp:
        raise SystemExit(
            f"the NCCL section with --tp {tp} needs {2 * tp} GPUs, this machine has "
            f"{nccl_gpus()}; lower --tp, or --no-nccl"
        )
    if cpu_smoke:
        cfg = replace(cfg, blocks=min(cfg.blocks, 32), rounds=2, burst=2)
    return nccl_run(cfg)


# --- the report ------------------------------------------------------------------------------
# GB/s of payload per rank pair from the receivers' medians, the like-for-like ratios against
# the contiguous sends, and the table ``raykv bench transport`` prints


def nccl_report(cfg: NcclConfig, results: dict) -> dict:
    """GB/s of payload per rank pair (the receivers' medians) and the ratios."""
    readers = [results[("B", r)] for r in range(cfg.tp)]
    payload = cfg.blocks * cfg.row_bytes
    rows = []
    for layout in cfg.layouts:
        crossing = 1 if layout == "mla" else cfg.tp  # rank pairs whose rows cross groups

        def rate(method: str, layout: str = layout) -> float | None:
            key = f"{layout}/{method}"
            if key not in readers[0]:
                return None
            return payload / max(b[key] for b in readers) / 1e9  # the slowest receiver

        raykv, contig, per_block = rate("raykv"), rate("contiguous"), rate("per_block")
        in_flight, waited = rate("in_flight"), rate("contiguous_waited")
        # the same bursts queued behind a GPU sleep, timed on the GPU: no host time (CUDA)
        in_flight_gpu, contig_gpu = rate("in_flight_gpu"), rate("contiguous_gpu")
        cross, cross_waited = rate("crossing"), rate("crossing_waited")

        def peer_rate(method: str, first: bool, layout: str = layout) -> float | None:
            """The slowest reader's copy; ``first``: after the holder's sums (a block's
            first export; the holder remembers them while the block stays valid)."""
            key = f"{layout}/{method}"
            if key not in readers[0]:
                return None
            holder = max(results[("A", r)][key] for r in range(cfg.tp)) if first else 0.0
            return payload / (holder + max(b[key] for b in readers)) / 1e9

        def ratio(x: float | None, base: float | None) -> float | None:
            return x / base if x and base else None

        in_place = {}  # reads in place: peer reads, and through the pair's NCCL window
        for how in ("peer", "window"):
            one, flight = peer_rate(how, False), peer_rate(f"{how}_in_flight", False)
            first = peer_rate(how, True)
            in_place.update({
                how: one,
                f"{how}_vs_contiguous_waited": ratio(one, waited),
                f"{how}_first": first,
                f"{how}_first_vs_contiguous_waited": ratio(first, waited),
                f"{how}_in_flight": flight,
                f"{how}_in_flight_vs_contiguous": ratio(flight, contig),
            })  # fmt: skip
        checks = [k for k in readers[0] if k.startswith(f"{layout}/") and k.endswith("equal")]
        rows.append({
            "layout": layout,
            "tp": cfg.tp,
            "blocks": cfg.blocks,
            "block_kib": cfg.row_bytes // 1024,
            "mib_per_pair": payload / 2**20,
            "wire_mib": crossing * payload / 2**20,
            "raykv": raykv,
            "contiguous": contig,
            "per_block": per_block,
            "contiguous_waited": waited,
            "raykv_vs_contiguous_waited": raykv / waited if waited else None,
            "raykv_vs_contiguous": raykv / contig if contig else None,
            "in_flight": in_flight,
            "in_flight_vs_contiguous": in_flight / contig if contig and in_flight else None,
            "raykv_vs_per_block": raykv / per_block if per_block else None,
            "in_flight_gpu": in_flight_gpu,
            "contiguous_gpu": contig_gpu,
            "in_flight_gpu_vs_contiguous_gpu": (
                in_flight_gpu / contig_gpu if in_flight_gpu and contig_gpu else None
            ),
            "crossing": cross,
            "crossing_waited": cross_waited,
            "raykv_vs_crossing_waited": raykv / cross_waited if cross_waited else None,
            "in_flight_vs_crossing": in_flight / cross if cross and in_flight else None,
            **in_place,
            "equal": all(b[k] for b in readers for k in checks),
            "all_blocks": all(g == cfg.blocks for b in readers for g in b[f"{layout}/good"]),
        })  # fmt: skip
    phases = {k: v for b in (results[("A", 0)], readers[0]) for k, v in b.items() if "phase/" in k}
    return {"config": asdict(cfg), "device": readers[0]["device"], "rows": rows, "phases": phases}


def nccl_format(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"NCCL: {report['device']}, tp {cfg['tp']}, "
        + (
            f"{cfg['preset']}'s KV layout ({cfg['blocks'] * cfg['block_size']} tokens), "
            if cfg.get("preset")
            else ""
        )
        + f"{cfg['blocks']} scattered blocks of "
        f"{report['rows'][0]['block_kib']} KiB per rank pair, GB/s of payload (median of "
        f"{cfg['rounds']} rounds of {cfg['burst']} batches); target raykv >= "
        f"{NCCL_TARGET} x contiguous, like for like: one at a time (the host waits for each "
        "batch) and queued (raykv: in flight)",
        "| layout | tp | MiB per pair | MiB on the wire | raykv one at a time | contiguous one "
        "at a time | ratio | raykv in flight | contiguous queued | ratio | raykv one at a time "
        "/ contiguous queued | per-block | raykv / per-block | bytes equal |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f(x: float | None, d: int = 2) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    for r in report["rows"]:
        ok = "yes" if r["equal"] and r["all_blocks"] else "NO"
        lines.append(
            f"| {r['layout']} | {r['tp']} | {r['mib_per_pair']:.0f} | {r['wire_mib']:.0f} | "
            f"{f(r['raykv'])} | {f(r.get('contiguous_waited'))} | "
            f"{f(r.get('raykv_vs_contiguous_waited'), 3)} | {f(r.get('in_flight'))} | "
            f"{f(r['contiguous'])} | {f(r.get('in_flight_vs_contiguous'), 3)} | "
            f"{f(r['raykv_vs_contiguous'], 3)} | {f(r['per_block'])} | "
            f"{f(r['raykv_vs_per_block'])} | {ok} |"
        )
    for r in report["rows"]:
        if r.get("in_flight_gpu_vs_contiguous_gpu"):
            lines.append(
                f"{r['layout']}, the GPUs alone (each burst queued behind a GPU sleep, so no "
                f"host time; CUDA events): raykv in flight {f(r['in_flight_gpu'])} GB/s, "
                f"contiguous queued {f(r['contiguous_gpu'])} GB/s = "
                f"{f(r['in_flight_gpu_vs_contiguous_gpu'], 3)} x"
            )
        if r.get("crossing"):
            lines.append(
                f"{r['layout']}: the one copy crosses in shares, one per rank pair (whole from "
                f"rank 0 where a share would be under {SHARE_MIN_BYTES >> 20} MiB), passed on "
                f"inside B's group; against the crossing alone (each rank pair sends an even "
                f"share contiguously, all at once, nothing passed on): one at a time "
                f"{f(r['crossing_waited'])} GB/s, raykv "
                f"{f(r['raykv_vs_crossing_waited'], 3)} x; queued {f(r['crossing'])} GB/s, "
                f"raykv in flight {f(r['in_flight_vs_crossing'], 3)} x"
            )
        for how, what in (
            ("window", "raykv through the pair's NCCL window (what a pool reads from a pool of "
             "its host: NCCL maps the holder's blocks, the reader's kernel copies them)"),
            ("peer", "peer reads (opt-in: the reader maps the holder's pool itself)"),
        ):  # fmt: skip
            if r.get(how):
                lines.append(
                    f"{what}, {r['layout']}: one at a time {f(r[how])} GB/s = "
                    f"{f(r[f'{how}_vs_contiguous_waited'], 3)} x contiguous one at a time; in "
                    f"flight {f(r[f'{how}_in_flight'])} GB/s = "
                    f"{f(r[f'{how}_in_flight_vs_contiguous'], 3)} x contiguous queued; blocks "
                    f"not summed yet (the holder's pass first) {f(r[f'{how}_first'])} GB/s = "
                    f"{f(r[f'{how}_first_vs_contiguous_waited'], 3)} x"
                )
    if report.get("phases"):
        lines.append(
            "phases of one batch alone (rank pair 0, ms): "
            + ", ".join(f"{k[6:-3]} {v:.3f}" for k, v in sorted(report["phases"].items()))
        )
    return "\n".join(lines)

"""`raykv bench copy`: scattered paged blocks <-> pinned host, raykv's kernel vs the baselines.

For each layout and block count, both directions (GPU -> pinned CPU "d2h", pinned CPU -> GPU
"h2d"), one run measures side by side:
  raykv       gather_blocks / scatter_blocks in the default mode ("staged" unless
              $RAYKV_COPY_MODE says otherwise): the kernel gathers all layers, K and V, into
              device chunks while the copy engine moves the previous chunk (pipelined)
  raykv-direct  the same kernel reading/writing pinned memory through UVA (mode "direct")
  contiguous  one copy of the same bytes between a contiguous GPU buffer and pinned memory
  per-block   one cudaMemcpyAsync per block, layer and K/V, all from one C++ call
  per-layer   the same memcpys driven as vLLM's swap_blocks was: a Python loop over layers and
              K/V, one C++ call each that loops over the blocks
  staging     torch index_select into a GPU staging buffer, then one copy (h2d: one copy,
              then index_copy_)
GB/s counts the payload (blocks x row bytes) once. CUDA events time each call; warm-up first,
median of several repetitions. Without CUDA it runs tiny sizes on the torch reference so CI can
smoke-test it; those numbers say nothing about a GPU.

`--duplex`: both directions at once, as an engine offloading one request while loading
another. A store (gather_blocks of n scattered blocks to pinned rows) on one CUDA stream and a
load (scatter_blocks of n other rows into n other, disjoint blocks) on another, each taking
every row's checksum as a tier job does (``sums=``), each timed alone and both together from
one start, against the same pair of contiguous pinned copies of the same bytes (GPU -> pinned
and pinned -> GPU, each on its own stream). GB/s per direction
(its bytes over the time from the common start to its own end) and total (both directions'
bytes over the time until the later one ends); ratios raykv / contiguous and together / one
after the other. On CPU the two run in two threads on the reference (a smoke test).
"""

from __future__ import annotations

import datetime
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch

from raykv import ops

METHODS = ("raykv", "raykv-direct", "contiguous", "per-block", "per-layer", "staging")


@dataclass(frozen=True)
class CopyLayout:
    """Paged KV: per layer [2, num_kernel_blocks, kernel_block_size, kv_heads, head_dim]."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    kernel_block_size: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def blocks_per_block(self) -> int:
        return self.block_size // self.kernel_block_size


@dataclass(frozen=True)
class BenchConfig:
    layouts: tuple[CopyLayout, ...]
    counts: tuple[int, ...]
    warmup: int
    reps: int
    device: str


LLAMA3_8B_B16 = CopyLayout("llama3-8b block16", 32, 8, 128, 16, 16)
LLAMA3_8B_B128 = CopyLayout("llama3-8b block128/kernel64", 32, 8, 128, 128, 64)


def default_config(quick: bool, device: str | None = None) -> BenchConfig:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":  # smoke test: tiny layouts on the reference path
        tiny = (
            CopyLayout("tiny block16", 2, 2, 16, 16, 16),
            CopyLayout("tiny block128/kernel64", 2, 2, 16, 128, 64),
        )
        return BenchConfig(tiny, (4, 16), warmup=1, reps=2, device=device)
    if quick:
        return BenchConfig((LLAMA3_8B_B16, LLAMA3_8B_B128), (64, 256), 1, 3, device)
    return BenchConfig((LLAMA3_8B_B16, LLAMA3_8B_B128), (64, 256, 1024), 2, 7, device)


# --- one layout's buffers --------------------------------------------------------------------


class _Pool:
    """Paged KV of one layout (random bits, never zeros), a host row buffer, a GPU staging one."""

    def __init__(self, layout: CopyLayout, max_count: int, device: torch.device):
        k, self.device = layout.blocks_per_block, device
        self.num_blocks = max_count * 5 // 4 + 8  # ids scattered over a pool larger than any copy
        shape = (2, self.num_blocks * k, layout.kernel_block_size, layout.kv_heads, layout.head_dim)
        self.layers = [_random(shape, layout.dtype, device) for _ in range(layout.layers)]
        self.entries = [ops.logical_view(t[h], k) for t in self.layers for h in (0, 1)]
        self.row_bytes = ops.row_bytes(self.entries)
        pinned = device.type == "cuda"
        self.staging = _random((max_count, self.row_bytes), torch.uint8, device)
        self.host = torch.empty(max_count, self.row_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.host.copy_(self.staging)  # random content without a slow host-side fill

    def entry_major(self, n: int) -> list[torch.Tensor]:
        """Staging laid out entry by entry (index_select writes each part contiguously)."""
        flat = self.staging.view(-1)[: n * self.row_bytes]
        parts, offset = [], 0
        for e in self.entries:
            width = ops.block_bytes(e)
            part = flat[offset : offset + n * width].view(ops.as_int(e).dtype)
            parts.append(part.view(n, *e.shape[1:]))
            offset += n * width
        return parts


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    t.view(torch.uint8).random_(0, 256)
    return t


# --- the methods ------------------------------------------------------------------------


def _methods(pool: _Pool, ids: torch.Tensor, to_host: bool) -> dict[str, Callable[[], None]]:
    n, host, staging = ids.numel(), pool.host[: ids.numel()], pool.staging[: ids.numel()]
    module = ops.kernel_module() if pool.device.type == "cuda" else None
    loop = _loop_pointers(pool, ids, host, to_host)
    per_entry = _per_entry(loop, len(pool.entries))
    parts = pool.entry_major(n)
    as_int = [ops.as_int(e) for e in pool.entries]
    flat_staging = pool.staging.view(-1)[: n * pool.row_bytes]
    flat_host = host.view(-1)

    def raykv(mode: str | None = None) -> None:
        if to_host:
            ops.gather_blocks(pool.entries, ids, host, mode=mode)
        else:
            ops.scatter_blocks(host, pool.entries, ids, mode=mode)

    def raykv_direct() -> None:
        raykv("direct")

    def contiguous() -> None:
        if to_host:
            host.copy_(staging, non_blocking=True)
        else:
            staging.copy_(host, non_blocking=True)

    def per_block() -> None:
        if module is not None:
            module.memcpy_loop(*loop)
            return
        for dst, src in _python_loop(pool, ids, host, to_host):
            dst.copy_(src, non_blocking=True)

    def per_layer() -> None:
        if module is not None:
            for spans in per_entry:
                module.memcpy_loop(*spans)
            return
        per_block()  # no kernel module: the python loop above is all there is

    def staging_copy() -> None:
        ids_now = ids.to(pool.device, non_blocking=True)
        if to_host:
            for e, part in zip(as_int, parts, strict=True):
                torch.index_select(e, 0, ids_now, out=part)
            flat_host.copy_(flat_staging, non_blocking=True)
        else:
            flat_staging.copy_(flat_host, non_blocking=True)
            for e, part in zip(as_int, parts, strict=True):
                e.index_copy_(0, ids_now, part)

    return {
        "raykv": raykv,
        "raykv-direct": raykv_direct,
        "contiguous": contiguous,
        "per-block": per_block,
        "per-layer": per_layer,
        "staging": staging_copy,
    }


def _loop_pointers(pool: _Pool, ids: torch.Tensor, host: torch.Tensor, to_host: bool):
    """(dst, src, sizes) int64 arrays: one span per (block, entry), the memcpy loop's input."""
    block = ids.numpy().astype(np.int64)[:, None]
    starts = np.array([e.data_ptr() for e in pool.entries], dtype=np.int64)[None, :]
    strides = np.array([e.stride(0) * e.element_size() for e in pool.entries], dtype=np.int64)
    widths = np.array([ops.block_bytes(e) for e in pool.entries])
    offsets = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)[None, :]
    paged = starts + block * strides[None, :]
    rows = host.data_ptr() + np.arange(len(block), dtype=np.int64)[:, None] * pool.row_bytes
    rows = rows + offsets
    sizes = np.broadcast_to(widths.astype(np.int64)[None, :], paged.shape)
    dst, src = (rows, paged) if to_host else (paged, rows)
    as_tensor = [torch.from_numpy(np.ascontiguousarray(a).reshape(-1)) for a in (dst, src, sizes)]
    return tuple(as_tensor)


def _per_entry(loop, num_entries: int) -> list[tuple[torch.Tensor, ...]]:
    """The memcpy loop's spans regrouped entry by entry: one (dst, src, sizes) per entry."""
    by_entry = [t.view(-1, num_entries).t().contiguous() for t in loop]
    return [tuple(t[j] for t in by_entry) for j in range(num_entries)]


def _python_loop(pool: _Pool, ids: torch.Tensor, host: torch.Tensor, to_host: bool):
    offset, views = 0, []
    for e in pool.entries:
        width, as_int = ops.block_bytes(e), ops.as_int(e)
        part = host[:, offset : offset + width].view(as_int.dtype)
        views.append((as_int, part.view(ids.numel(), *e.shape[1:])))
        offset += width
    for i, b in enumerate(ids.tolist()):
        for e, part in views:
            yield (part[i], e[b]) if to_host else (e[b], part[i])


# --- timing ------------------------------------------------------------------------------------


def _time_ms(fn: Callable[[], None], device: torch.device, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _verify(fn: Callable[[], None], pool: _Pool, ids: torch.Tensor, to_host: bool) -> bool:
    """One untimed run of a raykv method over a poisoned destination, checked on a few rows
    against the torch reference."""
    few, n = ids[:4], ids.numel()
    if to_host:
        pool.host[:n].fill_(0xA5)
    fn()
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    want = torch.empty(few.numel(), pool.row_bytes, dtype=torch.uint8)
    ops.gather_reference(pool.entries, few, want)
    return torch.equal(pool.host[: few.numel()], want)


# the CPU smoke run has no GPU and no pinned memory: say what actually moved
_DIRECTIONS = {
    True: {True: "gpu->pinned", False: "pinned->gpu"},
    False: {True: "pool->rows", False: "rows->pool"},
}


def run(
    config: BenchConfig,
    on_start: Callable[[dict], None] | None = None,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """The report; on_start sees it before the first measurement (results still empty),
    on_result each result as it is measured (a long run shows its rows as it goes)."""
    device = torch.device(config.device)
    report = {
        **_machine(device),
        "mode": ops._DEFAULT_MODE,
        "per_block_loop": "C++ cudaMemcpyAsync loop (per-layer: one call per layer and K/V)"
        if device.type == "cuda" and ops.kernel_module() is not None
        else "python loop of tensor.copy_",
        "config": {
            **asdict(config),
            "layouts": [{**asdict(lay), "dtype": str(lay.dtype)} for lay in config.layouts],
        },
        "results": [],
    }
    if on_start is not None:
        on_start(report)
    for layout in config.layouts:
        pool = _Pool(layout, max(config.counts), device)
        gen = torch.Generator().manual_seed(0)
        for n in config.counts:
            ids = torch.randperm(pool.num_blocks, generator=gen)[:n].to(torch.int64)
            for to_host in (True, False):
                fns, row, verified = _methods(pool, ids, to_host), {}, True
                for name in METHODS:
                    row[name] = _time_ms(fns[name], device, config.warmup, config.reps)
                    if name.startswith("raykv"):
                        verified = verified and _verify(fns[name], pool, ids, to_host)
                gbytes = n * pool.row_bytes / 1e9
                gbps = {m: gbytes / (ms / 1e3) for m, ms in row.items()}
                result = {
                    "layout": layout.name,
                    "blocks": n,
                    "direction": _DIRECTIONS[device.type == "cuda"][to_host],
                    "bytes": n * pool.row_bytes,
                    "ms": row,
                    "gbps": gbps,
                    "raykv_over_contiguous": gbps["raykv"] / gbps["contiguous"],
                    "raykv_over_per_block": gbps["raykv"] / gbps["per-block"],
                    "raykv_over_per_layer": gbps["raykv"] / gbps["per-layer"],
                    "direct_over_contiguous": gbps["raykv-direct"] / gbps["contiguous"],
                    "verified": verified,
                }
                report["results"].append(result)
                if on_result is not None:
                    on_result(result)
        del pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


def _machine(device: torch.device) -> dict:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "path": ops.kernel_status() if device.type == "cuda" else "torch reference (CPU)",
    }


def format_table(report: dict) -> str:
    return "\n".join(_header_lines(report) + [_row_line(r) for r in report["results"]])


def _header_lines(report: dict) -> list[str]:
    lines = [
        f"raykv bench copy  {report['date']}  device: {report['device']}  torch {report['torch']}",
        f"raykv path: {report['path']}",
        f"raykv mode: {report['mode']} (raykv-direct: mode direct)",
        f"per-block baseline: {report['per_block_loop']}",
    ]
    if report["device"] == "cpu":
        lines.append("NO CUDA: tiny sizes on the torch reference; a smoke test, not a measurement")
    lines.append("GB/s of payload (blocks x row bytes); ratios are raykv's GB/s over a baseline's")
    head = (
        f"{'layout':<27} {'blocks':>6} {'direction':<11} {'MiB':>7} "
        + " ".join(f"{m:>12}" for m in METHODS)
        + f" {'raykv/contig':>12} {'direct/contig':>13} {'raykv/per-blk':>13}"
        + f" {'raykv/per-lyr':>13} ok"
    )
    return [*lines, head, "-" * len(head)]


def _row_line(r: dict) -> str:
    return (
        f"{r['layout']:<27} {r['blocks']:>6} {r['direction']:<11} "
        f"{r['bytes'] / 2**20:>7.0f} "
        + " ".join(f"{r['gbps'][m]:>12.2f}" for m in METHODS)
        + f" {r['raykv_over_contiguous']:>12.3f} {r['direct_over_contiguous']:>13.3f}"
        + f" {r['raykv_over_per_block']:>13.2f} {r['raykv_over_per_layer']:>13.2f}"
        + f" {'yes' if r['verified'] else 'NO'}"
    )


# -- --duplex: a store and a load at once ----------------------------------------------

DUPLEX_TARGET = 0.9  # raykv's store + load together >= 0.9 x two concurrent contiguous copies
DUPLEX_METHODS = ("raykv", "contiguous")
# (key, column) per measured rate: each direction alone, then both started together
DUPLEX_RATES = (
    ("store_alone", "store alone"),
    ("load_alone", "load alone"),
    ("store_together", "store duplex"),
    ("load_together", "load duplex"),
    ("total_together", "total duplex"),
)


class _DuplexPool:
    """Paged KV of one layout with room for two disjoint sets of `max_count` blocks, the store's
    pinned destination rows, the load's pinned source rows (random bits), and the contiguous
    baseline's GPU source and destination."""

    def __init__(self, layout: CopyLayout, max_count: int, device: torch.device):
        k, self.device = layout.blocks_per_block, device
        self.num_blocks = 2 * max_count + 8  # the store's and the load's blocks, scattered
        shape = (2, self.num_blocks * k, layout.kernel_block_size, layout.kv_heads, layout.head_dim)
        self.layers = [_random(shape, layout.dtype, device) for _ in range(layout.layers)]
        self.entries = [ops.logical_view(t[h], k) for t in self.layers for h in (0, 1)]
        self.row_bytes = ops.row_bytes(self.entries)
        pinned = device.type == "cuda"
        self.gpu_out = _random((max_count, self.row_bytes), torch.uint8, device)  # d2h source
        self.gpu_in = torch.empty_like(self.gpu_out)  # h2d destination
        self.host_out = torch.empty(max_count, self.row_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.host_in = torch.empty(max_count, self.row_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.host_in.copy_(self.gpu_out)  # random rows to load, without a slow host-side fill
        self.host_out.fill_(0)


def duplex_device_bytes(layout: CopyLayout, max_count: int) -> int:
    """GPU memory `_DuplexPool` takes for `max_count`, plus both directions' staging chunks."""
    row = layout.layers * 2 * layout.block_size * layout.kv_heads * layout.head_dim
    row *= torch.empty((), dtype=layout.dtype).element_size()
    return row * ((2 * max_count + 8) + 2 * max_count) + 2 * ops._STAGING_BYTES


def _duplex_counts(layout: CopyLayout, counts: tuple[int, ...], device: torch.device):
    """(counts that fit in the GPU's free memory, [(count, GiB needed)] of those that do not)."""
    if device.type != "cuda":
        return list(counts), []
    free = torch.cuda.mem_get_info(device)[0] - (1 << 30)  # headroom for the allocator
    fits = [n for n in counts if duplex_device_bytes(layout, n) <= free]
    return fits, [(n, duplex_device_bytes(layout, n) / 2**30) for n in counts if n not in fits]


def _duplex_jobs(pool: _DuplexPool, store_ids: torch.Tensor, load_ids: torch.Tensor) -> dict:
    """Per method, (store, load): the store writes pool.host_out, the load reads pool.host_in."""
    n = store_ids.numel()
    host_out, host_in = pool.host_out[:n], pool.host_in[:n]
    gpu_out, gpu_in = pool.gpu_out[:n], pool.gpu_in[:n]
    # each row's checksum taken as it is copied, as a tier job takes it (invariant 12)
    device = pool.entries[0].device
    store_sums, load_sums = (torch.empty(n, dtype=torch.int64, device=device) for _ in "sl")

    def raykv_store() -> None:
        ops.gather_blocks(pool.entries, store_ids, host_out, sums=store_sums)

    def raykv_load() -> None:
        ops.scatter_blocks(host_in, pool.entries, load_ids, sums=load_sums)

    def contiguous_store() -> None:
        host_out.copy_(gpu_out, non_blocking=True)

    def contiguous_load() -> None:
        gpu_in.copy_(host_in, non_blocking=True)

    return {"raykv": (raykv_store, raykv_load), "contiguous": (contiguous_store, contiguous_load)}


class _Lanes:
    """Runs jobs at once from one start, each on its own lane (a CUDA stream; a thread on CPU),
    and times each from that start to its own end."""

    def __init__(self, device: torch.device, count: int):
        self.device = device
        if device.type == "cuda":
            self.streams = [torch.cuda.Stream(device) for _ in range(count)]
        else:
            self.threads = ThreadPoolExecutor(max_workers=count)

    def once(self, jobs: list[Callable[[], None]]) -> list[float]:
        """Milliseconds from the common start to each job's end."""
        if self.device.type != "cuda":
            t0 = time.perf_counter()

            def timed(fn: Callable[[], None]) -> float:
                fn()
                return (time.perf_counter() - t0) * 1e3

            return list(self.threads.map(timed, jobs))
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(self.device))
        ends = []
        for fn, stream in zip(jobs, self.streams, strict=False):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                fn()
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record(stream)
        for end in ends:
            end.synchronize()
        return [start.elapsed_time(end) for end in ends]

    def time(self, jobs: list[Callable[[], None]], warmup: int, reps: int) -> list[float]:
        """Median milliseconds per job, and last the median of the later end (both done)."""
        for _ in range(warmup):
            self.once(jobs)
        runs = [self.once(jobs) for _ in range(reps)]
        return [statistics.median(r[j] for r in runs) for j in range(len(jobs))] + [
            statistics.median(max(r) for r in runs)
        ]

    def close(self) -> None:
        if self.device.type != "cuda":
            self.threads.shutdown()


def _check_rows(pool: _DuplexPool, ids: torch.Tensor, rows: torch.Tensor) -> bool:
    """rows == the torch reference's gather of ids, on every row on CPU and on the first and
    last four (the pipeline's first and last chunks) on a GPU."""
    n = ids.numel()
    picks = (
        torch.arange(n)
        if pool.device.type != "cuda" or n <= 8
        else torch.cat([torch.arange(4), torch.arange(n - 4, n)])
    )
    want = torch.empty(picks.numel(), pool.row_bytes, dtype=torch.uint8)
    ops.gather_reference(pool.entries, ids[picks], want)
    return torch.equal(rows[picks].cpu(), want)


def _verify_duplex(pool: _DuplexPool, lanes: _Lanes, store, load, store_ids, load_ids) -> bool:
    """One untimed store + load together over a poisoned store destination and a pool whose
    load targets are poisoned; both checked against the torch reference."""
    n = store_ids.numel()
    pool.host_out[:n].fill_(0xA5)
    for e in pool.entries:
        ops.as_int(e).index_fill_(0, load_ids.to(pool.device), 0x5A)
    lanes.once([store, load])
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    return _check_rows(pool, store_ids, pool.host_out[:n]) and _check_rows(
        pool, load_ids, pool.host_in[:n]
    )


def _duplex_point(pool: _DuplexPool, lanes: _Lanes, n: int, config: BenchConfig, gen) -> dict:
    picked = torch.randperm(pool.num_blocks, generator=gen)[: 2 * n].to(torch.int64)
    if pool.device.type == "cuda":  # pinned ids upload without a host-side staging copy
        picked = picked.pin_memory()
    store_ids, load_ids = picked[:n], picked[n:]
    jobs, ms, gbps = _duplex_jobs(pool, store_ids, load_ids), {}, {}
    gbytes = n * pool.row_bytes / 1e9
    verified = True
    for method, (store, load) in jobs.items():
        store_ms = lanes.time([store], config.warmup, config.reps)[0]
        load_ms = lanes.time([load], config.warmup, config.reps)[0]
        store_t, load_t, both_t = lanes.time([store, load], config.warmup, config.reps)
        ms[method] = {
            "store_alone": store_ms,
            "load_alone": load_ms,
            "store_together": store_t,
            "load_together": load_t,
            "total_together": both_t,
        }
        rates = {k: gbytes / (v / 1e3) for k, v in ms[method].items()}
        rates["total_together"] *= 2  # both directions' bytes
        rates["total_serial"] = 2 * gbytes / ((store_ms + load_ms) / 1e3)
        gbps[method] = rates
        if method == "raykv":
            verified = _verify_duplex(pool, lanes, store, load, store_ids, load_ids)
    raykv, contig = gbps["raykv"], gbps["contiguous"]
    ratio = raykv["total_together"] / contig["total_together"]
    return {
        "blocks": n,
        "bytes": n * pool.row_bytes,  # per direction
        "ms": ms,
        "gbps": gbps,
        "raykv_over_contiguous": {k: raykv[k] / contig[k] for k, _ in DUPLEX_RATES},
        "together_over_serial": {
            m: gbps[m]["total_together"] / gbps[m]["total_serial"] for m in DUPLEX_METHODS
        },
        "target": DUPLEX_TARGET,
        "meets_target": ratio >= DUPLEX_TARGET,
        "verified": verified,
    }


def run_duplex(
    config: BenchConfig,
    on_start: Callable[[dict], None] | None = None,
    on_result: Callable[[dict], None] | None = None,
) -> dict:
    """The --duplex report: per layout and block count, raykv's store and load alone and
    together against two contiguous copies alone and together. A count whose buffers do not fit
    in the GPU's free memory is reported as skipped, with the GiB it needs."""
    device = torch.device(config.device)
    report = {
        **_machine(device),
        "kind": "duplex",
        "mode": ops._DEFAULT_MODE,
        "target": DUPLEX_TARGET,
        "config": {
            **asdict(config),
            "layouts": [{**asdict(lay), "dtype": str(lay.dtype)} for lay in config.layouts],
        },
        "results": [],
    }
    if on_start is not None:
        on_start(report)
    lanes = _Lanes(device, 2)
    try:
        for layout in config.layouts:
            fits, skipped = _duplex_counts(layout, config.counts, device)
            for n, need in skipped:
                result = {"layout": layout.name, "blocks": n, "skipped": f"needs {need:.1f} GiB"}
                report["results"].append(result)
                if on_result is not None:
                    on_result(result)
            if not fits:
                continue
            pool = _DuplexPool(layout, max(fits), device)
            gen = torch.Generator().manual_seed(0)
            for n in fits:
                result = {"layout": layout.name, **_duplex_point(pool, lanes, n, config, gen)}
                report["results"].append(result)
                if on_result is not None:
                    on_result(result)
            del pool
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        lanes.close()
    return report


def format_duplex_table(report: dict) -> str:
    lines = _duplex_header_lines(report)
    for r in report["results"]:
        lines += _duplex_row_lines(r)
    return "\n".join(lines)


def _duplex_header_lines(report: dict) -> list[str]:
    lines = [
        f"raykv bench copy --duplex  {report['date']}  device: {report['device']}  "
        f"torch {report['torch']}  CUDA {report['cuda']}",
        f"raykv path: {report['path']}",
        f"raykv mode: {report['mode']}",
    ]
    if report["device"] == "cpu":
        lines.append("NO CUDA: tiny sizes on the torch reference, two threads; a smoke test")
    lines += [
        "store: n scattered blocks -> pinned rows; load: n pinned rows -> n other blocks; "
        "contiguous: the same bytes GPU buffer -> pinned and pinned -> GPU buffer",
        "each on its own stream; 'duplex' = both started together; GB/s per direction, total = "
        "both directions; serial = one after the other",
        f"target: raykv total duplex >= {report['target']} x contiguous total duplex",
    ]
    head = (
        f"{'layout':<27} {'blocks':>6} {'MiB/dir':>7} {'':<13}"
        + " ".join(f"{col:>12}" for _, col in DUPLEX_RATES)
        + f" {'total serial':>12} {'duplex/serial':>13} ok"
    )
    return [*lines, head, "-" * len(head)]


def _duplex_row_lines(r: dict) -> list[str]:
    if "skipped" in r:
        return [f"{r['layout']:<27} {r['blocks']:>6} skipped: {r['skipped']} of GPU memory"]
    lead = f"{r['layout']:<27} {r['blocks']:>6} {r['bytes'] / 2**20:>7.0f} "
    lines = []
    for m in DUPLEX_METHODS:
        g = r["gbps"][m]
        lines.append(
            (lead if m == "raykv" else " " * len(lead))
            + f"{m:<13}"
            + " ".join(f"{g[k]:>12.2f}" for k, _ in DUPLEX_RATES)
            + f" {g['total_serial']:>12.2f} {r['together_over_serial'][m]:>13.3f}"
            + (f" {'yes' if r['verified'] else 'NO'}" if m == "raykv" else "")
        )
    ratio = r["raykv_over_contiguous"]
    met = "met" if r["meets_target"] else "NOT met"
    lines.append(
        " " * len(lead)
        + f"{'raykv/contig':<13}"
        + " ".join(f"{ratio[k]:>12.3f}" for k, _ in DUPLEX_RATES)
        + f"  target {r['target']} on total duplex: {met}"
    )
    return lines


def main(
    quick: bool = False,
    json_path: str | None = None,
    counts: tuple[int, ...] = (),
    reps: int = 0,
    device: str | None = None,
    duplex: bool = False,
) -> dict:
    config = default_config(quick, device)
    if counts:
        config = replace(config, counts=tuple(counts))
    if reps:
        config = replace(config, reps=reps)
    runner, header, rows = (
        (run_duplex, _duplex_header_lines, _duplex_row_lines)
        if duplex
        else (run, _header_lines, lambda r: [_row_line(r)])
    )
    if json_path == "-":
        report = runner(config)
        print(json.dumps(report, indent=2))
    else:  # the table row by row as measured, the same text format_(duplex_)table gives
        report = runner(
            config,
            on_start=lambda rep: print("\n".join(header(rep)), flush=True),
            on_result=lambda r: print("\n".join(rows(r)), flush=True),
        )
        if json_path:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=2)
    return report

"""`raykv bench copy --duplex`: a store and a load of paged blocks at once.

Both directions at once, as an engine offloading one request while
loading another. A store (gather_blocks of n scattered blocks to pinned rows) on one CUDA stream
and a load (scatter_blocks of n other rows into n other, disjoint blocks) on another, each timed
alone and both together from one start, against the same pair of contiguous pinned copies of
the same bytes (GPU -> pinned and pinned -> GPU, each on its own stream). GB/s per direction
(its bytes over the time from the common start to its own end) and total (both directions' bytes
over the time until the later one ends); ratios raykv / contiguous and together / one after the
other. On CPU the two run in two threads on the reference (a smoke test).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import torch

from raykv import ops
from raykv.bench.copy import BenchConfig, CopyLayout, _machine, _random

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

    def raykv_store() -> None:
        ops.gather_blocks(pool.entries, store_ids, host_out)

    def raykv_load() -> None:
        ops.scatter_blocks(host_in, pool.entries, load_ids)

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
    ops._gather_reference(pool.entries, ids[picks], want)
    return torch.equal(rows[picks].cpu(), want)


def _verify_duplex(pool: _DuplexPool, lanes: _Lanes, store, load, store_ids, load_ids) -> bool:
    """One untimed store + load together over a poisoned store destination and a pool whose
    load targets are poisoned; both checked against the torch reference."""
    n = store_ids.numel()
    pool.host_out[:n].fill_(0xA5)
    for e in pool.entries:
        ops._as_int(e).index_fill_(0, load_ids.to(pool.device), 0x5A)
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

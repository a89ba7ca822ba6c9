"""``raykv bench service``: lookup rate and latency for 32k-token prompts, the object-store
transport's cross-node GB/s next to a raw Ray put/get of the same bytes, and an engine's
store/load through the node's shared-memory CPU tier next to a plain copy, measured in one
run on a 2-node local Ray cluster.

Lookups: a 32k-token prompt whose KV one pool holds (a full hit) and one nobody holds (a
miss), looked up by an engine on the other node (``raykv.engine.NodeKV``: block hashing plus
probes of the node's index replica in shared memory, no round trip), beside a Ray driver's
lookup (``Client.lookup``: hashing plus one coordinator call) and a bare actor ping.
Bandwidth: one pool loads N blocks that only the other node's pool holds (one actor call
whose numpy result crosses nodes through Ray's object store: the slow fallback), next to a
plain in-process copy of the same bytes for scale. The nodes declare no GPUs (both models
get CPU-device pools, as on a GPU-less host): the fallback's cost is the object store's.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from raykv.bench import percentile
from raykv.service.node.agent_protocol import AGENT_DIR_ENV

LOOKUP_MODEL, BW_MODEL = "bench-lookup", "bench-bandwidth"


class _Ping:
    """A bare Ray actor: the floor one actor round trip costs on this machine."""

    def ping(self) -> None:
        return None


def _once(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _interleaved(calls: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Latencies of each call, taking turns every repetition, so a load spike on a shared
    machine hits them alike and their ratios stay fair."""
    for fn in calls.values():
        fn()  # warm: resolves the model, the coordinator, the actor
    out: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(reps):
        for k, fn in calls.items():
            out[k].append(_once(fn))
    return out


def _reference_hash(tokens: list[int], bs: int) -> list[bytes]:
    """The issue's reference: a Python loop of chained sha256 over ``bs``-token blocks,
    packing each block's tokens (the hasher before issue 10)."""
    import hashlib
    import struct

    prev, out, pack = hashlib.sha256(b"reference").digest(), [], struct.Struct(f"<{bs}q").pack
    for i in range(len(tokens) // bs):
        prev = hashlib.sha256(prev + pack(*tokens[i * bs : (i + 1) * bs]) + b"\x00\x00").digest()
        out.append(prev)
    return out


def _hashing_bench(tokens: list[int], hash_block_size: int, reps: int) -> dict[str, Any]:
    """Hashing of one prompt (a list of ints, as engines pass them) in the form an engine's
    lookup hashes it (``NodeKV.lookup``: the digests joined in one bytes object), next to
    the list form the client's other calls use and the reference loop, interleaved so all
    see the same machine load: medians in ms, and which path hashed (``native_status()``)."""
    from raykv.blocks import BlockHasher
    from raykv.blocks.hashing import build_native

    # the native chain where it builds: a fresh machine's first build (~2 s) is not timed
    path = build_native()
    hasher = BlockHasher(hash_block_size)
    lat = _interleaved(
        {
            "joined": lambda: hasher.hash_blocks_joined(tokens),
            "list": lambda: hasher.hash_blocks(tokens),
            "ref": lambda: _reference_hash(tokens, hash_block_size),
        },
        reps,
    )
    return {
        "hashing_ms": statistics.median(lat["joined"]) * 1e3,
        "hashing_list_ms": statistics.median(lat["list"]) * 1e3,
        "hashing_reference_ms": statistics.median(lat["ref"]) * 1e3,
        "hashing_path": path,
    }


def _in_engine_process(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(*args)`` in a fresh process without Ray, as an engine's is (it talks to the node
    through the agent's socket): in this one the bench's Ray driver threads share the cores
    (2048 blocks hashed here: ~0.37 ms on the H200 host, ~0.24 ms in a process of its own)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def _lookup_bench(kv: Any, a_node: str, b_node: str, tokens: int, reps: int) -> dict[str, Any]:
    """Lookups of a prompt one pool holds (hit) and one nobody holds (miss), by an engine on
    the other node (its replica) and by a Ray driver there (the coordinator), beside a bare
    actor ping and the hashing alone, measured in this run."""
    import ray

    from raykv.engine import NodeKV
    from raykv.layout import FullAttention

    layers = {
        f"l{i}": FullAttention(dtype="float32", num_kv_heads=1, head_dim=16) for i in range(2)
    }
    row = 2 * 2 * 16 * 16 * 4
    blocks = tokens // 16 + 2
    plan = kv.add_model(
        LOOKUP_MODEL,
        layers,
        max_model_len=tokens + 16,
        pool_bytes=(blocks + 8) * row,
        cpu_bytes=64 * row,
        max_num_batched_tokens=tokens + 16,
    )
    a, b = kv.on(a_node), kv.on(b_node)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 100_000, (tokens + 1,), generator=g).tolist()
    miss = torch.randint(0, 100_000, (tokens + 1,), generator=g).tolist()
    assert a.admit("bench", len(prompt), prompt)
    table = a.allocate("bench", len(prompt), prompt)[0]
    full = tokens // plan.groups[0].block_size
    a.store("bench", table[:full], torch.zeros((full, plan.gpu_bytes_per_block), dtype=torch.uint8))
    out: dict[str, Any] = {"prompt_tokens": tokens, "blocks": full}
    engine = NodeKV.open(node_id=b_node)  # an engine of node b: no Ray calls
    engine.use(LOOKUP_MODEL)
    deadline = time.monotonic() + 30  # node b's replica hears of a's blocks from the feed
    while engine.lookup(prompt).hit_tokens < tokens and time.monotonic() < deadline:
        time.sleep(0.05)
    # a bare actor (no arguments, returns None) created like the coordinator: detached,
    # num_cpus=0, unpinned; killed after
    actor = ray.remote(_Ping).options(num_cpus=0, lifetime="detached").remote()
    lat = _interleaved(
        {
            "ping": lambda: ray.get(actor.ping.remote()),
            "hit": lambda: engine.lookup(prompt),
            "miss": lambda: engine.lookup(miss),
            "driver_hit": lambda: b.lookup(prompt),
        },
        reps,
    )
    ray.kill(actor)
    ping = lat["ping"]
    out["ping"] = {"p50_ms": percentile(ping, 0.5) * 1e3, "p99_ms": percentile(ping, 0.99) * 1e3}
    for label, ids, look in (
        ("hit", prompt, engine.lookup),
        ("miss", miss, engine.lookup),
        ("driver_hit", prompt, b.lookup),
    ):
        res = look(ids)
        assert (res.hit_tokens > 0) == (label != "miss"), res
        out[label] = {
            "lookups_per_s": len(lat[label]) / sum(lat[label]),
            "p50_ms": percentile(lat[label], 0.5) * 1e3,
            "p99_ms": percentile(lat[label], 0.99) * 1e3,
            "hit_tokens": res.hit_tokens,
        }
    engine.close()
    out.update(_in_engine_process(_hashing_bench, prompt[:tokens], plan.hash_block_size,
                                  max(reps // 4, 5)))  # fmt: skip
    ping = out["ping"]["p50_ms"]
    out["ratios"] = {
        "hit_p50_vs_ping": out["hit"]["p50_ms"] / ping,
        "hit_p99_vs_ping": out["hit"]["p99_ms"] / ping,
        "miss_p50_vs_ping": out["miss"]["p50_ms"] / ping,
        "miss_p99_vs_ping": out["miss"]["p99_ms"] / ping,
        "driver_hit_p50_vs_ping": out["driver_hit"]["p50_ms"] / ping,
        "hashing_vs_reference": out["hashing_ms"] / out["hashing_reference_ms"],
    }
    a.free("bench")
    return out


def _bandwidth_bench(kv: Any, a_node: str, b_node: str, nblocks: int, reps: int) -> dict:
    from raykv.layout import FullAttention

    # a Llama-3-8B-like block row cut to 8 layers: 8 x K,V x 16 tokens x 8 heads x 128 x bf16
    layers = {
        f"l{i}": FullAttention(dtype="bfloat16", num_kv_heads=8, head_dim=128) for i in range(8)
    }
    row = 8 * 2 * 16 * 8 * 128 * 2
    tokens = nblocks * 16
    plan = kv.add_model(
        BW_MODEL,
        layers,
        max_model_len=tokens + 16,
        pool_bytes=(2 * nblocks + 8) * row,
        cpu_bytes=8 * row,
        max_num_batched_tokens=tokens + 16,
    )
    a, b = kv.on(a_node), kv.on(b_node)
    times, nbytes = [], 0
    for r in range(reps):
        g = torch.Generator().manual_seed(100 + r)
        prompt = torch.randint(0, 100_000, (tokens + 1,), generator=g).tolist()
        assert a.admit(f"s{r}", len(prompt), prompt)
        ta = a.allocate(f"s{r}", len(prompt), prompt)[0]
        a.store(
            f"s{r}",
            ta[:nblocks],
            torch.ones((nblocks, plan.gpu_bytes_per_block), dtype=torch.uint8),
        )
        assert b.admit(f"l{r}", len(prompt), prompt)
        tb = b.allocate(f"l{r}", len(prompt), prompt)[0]
        t0 = time.perf_counter()  # the caller's wall clock, as for the raw put/get below
        res = b.load(f"l{r}", prompt, into=tb[:nblocks])
        times.append(time.perf_counter() - t0)
        assert res.loaded_blocks == nblocks, res
        nbytes = res.bytes
        a.free(f"s{r}")
        b.free(f"l{r}")
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages, not timed
    t0 = time.perf_counter()
    dst.copy_(src)
    local = time.perf_counter() - t0
    med = statistics.median(times)
    return {
        "blocks": nblocks,
        "bytes": nbytes,
        "median_s": med,
        "gb_per_s": nbytes / med / 1e9,
        "best_gb_per_s": nbytes / min(times) / 1e9,
        "local_copy_gb_per_s": nbytes / local / 1e9,
    }


# --- data moving (issue 10): the transport against raw Ray, shared memory against a copy ---

SHM_MODEL = "bench-shm"


def raw_ray_bench(a_node: str, b_node: str, nbytes: int, reps: int) -> dict[str, Any]:
    """One numpy array ``ray.put`` by an actor on node A, ``ray.get`` by one on node B: the
    object store's own speed for the bytes the transport moves."""
    import numpy as np
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    class Side:
        def make(self, n: int, seed: int) -> None:
            self.array = np.full(n, seed % 251, dtype=np.uint8)

        def put(self) -> list:
            self.keep = ray.put(self.array)  # one copy into this node's plasma
            return [self.keep]

        def get(self, refs: list) -> float:
            t0 = time.perf_counter()
            x = ray.get(refs[0])  # pulled to this node, read in place
            dt = time.perf_counter() - t0
            del x
            return dt

    def side(node: str, tag: str) -> Any:
        # detached: owned by the cluster, like raykv's own members (a driver-owned actor
        # or object is not reachable from other raylets' workers under token auth)
        return Side.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            lifetime="detached",
            name=f"raykv-bench-raw-{tag}",
        ).remote()

    put, get = side(a_node, "put"), side(b_node, "get")
    times = []
    try:
        for r in range(reps + 1):
            ray.get(put.make.remote(nbytes, r))
            t0 = time.perf_counter()  # put on node A + get on node B, the caller's clock
            refs = ray.get(put.put.remote())
            ray.get(get.get.remote(refs))
            times.append(time.perf_counter() - t0)
            del refs
    finally:
        ray.kill(put)
        ray.kill(get)
    med, best = statistics.median(times[1:]), min(times[1:])
    return {
        "bytes": nbytes,
        "median_s": med,
        "gb_per_s": nbytes / med / 1e9,
        "best_gb_per_s": nbytes / best / 1e9,
    }


def _shm_bench(kv: Any, nblocks: int, reps: int, device: str = "cpu") -> dict[str, Any]:
    """An engine attached to its node's CPU tier (``Client.attach``): engine->tier store
    and tier->engine load GB/s (one paged copy + checksums + one control round trip each),
    next to a plain copy of the same bytes in this process: on CPU one memory copy, on CUDA
    the contiguous GPU->pinned (store) and pinned->GPU (load) copy."""
    from raykv.layout import FullAttention

    model = f"{SHM_MODEL}-{device}"
    layers = {
        f"l{i}": FullAttention(dtype="bfloat16", num_kv_heads=8, head_dim=128) for i in range(8)
    }
    row = 8 * 2 * 16 * 8 * 128 * 2
    kv.add_model(
        model,
        layers,
        max_model_len=256,
        pool_bytes=24 * row,  # the bench's engine has its own blocks; the pool is unused
        cpu_bytes=(nblocks + 8) * row,
        max_num_batched_tokens=256,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as an engine worker / actor with one CPU; the baseline too
    try:
        return _shm_rounds(kv, nblocks, reps, row, device)
    finally:
        torch.set_num_threads(threads)


def _plain_copies(nbytes: int, device: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The baselines of a store and a load of ``nbytes``: one contiguous copy each way."""
    if device == "cpu":
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)  # first touch of the pages, not timed
        return (lambda: dst.copy_(src)), (lambda: dst.copy_(src))
    gpu = torch.ones(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    copy(pinned, gpu)
    return (lambda: copy(pinned, gpu)), (lambda: copy(gpu, pinned))


def _rows(eng: Any, blocks: list[int]) -> torch.Tensor:
    """The engine's blocks ``blocks`` as CPU rows (one group)."""
    from raykv import ops

    entries = eng.kv.entries(eng.plan.groups[0].group_id)
    out = torch.empty((len(blocks), ops.row_bytes(entries)), dtype=torch.uint8,
                      device=entries[0].device)  # fmt: skip
    ops.gather_blocks(entries, torch.tensor(blocks), out)
    return out.cpu()


def _shm_rounds(kv: Any, nblocks: int, reps: int, row: int, device: str) -> dict[str, Any]:
    from raykv import ops
    from raykv.service.node.agent_protocol import Arena

    eng = kv.attach(device=device, num_blocks=nblocks + 8)
    gid = eng.plan.groups[0].group_id
    blocks = list(range(1, nblocks + 1))
    g = torch.Generator().manual_seed(7)
    src = torch.randint(0, 256, (nblocks, row), generator=g, dtype=torch.uint8)
    ops.scatter_blocks(src.to(device), eng.kv.entries(gid), torch.tensor(blocks))
    nbytes = nblocks * row
    plain_store, plain_load = _plain_copies(nbytes, device)
    cols: dict[str, list[float]] = {k: [] for k in ("store", "load", "out", "in", "ping")}
    for r in range(reps + 1):  # each round: store, load, the plain copies, a bare round trip
        prompt = torch.randint(0, 100_000, (nblocks * 16,), generator=g).tolist()
        stored = _rows(eng, blocks) if r == reps else None
        t = [time.perf_counter()]
        assert eng.store_from(prompt, blocks) == nblocks
        t.append(time.perf_counter())
        assert eng.load_into(prompt, blocks[::-1]) == nblocks * 16
        t.append(time.perf_counter())
        plain_store()
        t.append(time.perf_counter())
        plain_load()
        t.append(time.perf_counter())
        eng.agent.call(Arena(eng.model))  # the node agent's cheapest call
        t.append(time.perf_counter())
        if r:  # the first round maps the arena and touches its pages
            for i, k in enumerate(cols):
                cols[k].append(t[i + 1] - t[i])
    if not torch.equal(_rows(eng, blocks[::-1]), stored):  # the last load wrote them reversed
        raise AssertionError("the blocks loaded back differ from the blocks stored")
    eng.close()
    # the median of the rounds for every column alike, and the best (this host is shared)
    out: dict[str, Any] = {"blocks": nblocks, "bytes": nbytes, "rounds": reps, "device": device}
    for tag, pick in (("", statistics.median), ("best_", min)):
        st, ld, co, ci = (nbytes / pick(cols[k]) / 1e9 for k in ("store", "load", "out", "in"))
        out |= {
            f"{tag}store_gb_per_s": st,
            f"{tag}load_gb_per_s": ld,
            f"{tag}plain_copy_gb_per_s": co,
            f"{tag}plain_load_gb_per_s": ci,
            f"{tag}store_ratio": st / co,
            f"{tag}load_ratio": ld / ci,
            f"{tag}store_ms": pick(cols["store"]) * 1e3,
            f"{tag}load_ms": pick(cols["load"]) * 1e3,
            f"{tag}tier_ping_ms": pick(cols["ping"]) * 1e3,
            f"{tag}copy_ms": pick(cols["out"]) * 1e3,  # a store's baseline
            f"{tag}load_copy_ms": pick(cols["in"]) * 1e3,  # a load's (the same copy on CPU)
        }
    return out


def format_dataplane(r: dict[str, Any]) -> list[str]:
    """The data-moving lines of the report (object store vs raw Ray, shared memory)."""
    lines = []
    bw, raw = r.get("object_store"), r.get("raw_ray")
    if bw and raw:
        lines.append("")
        head = f"{'cross-node load':<30}{'MiB':>11}{'GB/s':>9}{'raw Ray GB/s':>14}{'ratio':>8}"
        lines.append(head)
        for label, key in (("median", "gb_per_s"), ("best", "best_gb_per_s")):
            lines.append(
                f"{'  object store, ' + label:<30}{bw['bytes'] / 2**20:>11.1f}{bw[key]:>9.2f}"
                f"{raw[key]:>14.2f}{bw[key] / raw[key]:>8.3f}"
            )
    for part, title in (("shared_memory", "shared mem"), ("shared_memory_cuda", "CUDA engine")):
        if r.get(part):
            lines += _format_shm(r[part], title)
    return lines


def _format_shm(sm: dict[str, Any], title: str) -> list[str]:
    """A store against the copy out (GPU->pinned on CUDA), a load against the copy in."""
    base = {"store": "plain_copy", "load": "plain_load"}
    lines = ["", f"{'engine <-> tier, ' + title:<30}{'MiB':>11}{'GB/s':>9}{'copy GB/s':>14}"
             f"{'ratio':>8}"]  # fmt: skip
    for tag, which in (("", "median"), ("best_", "best")):
        for label, key in (("store (engine->tier)", "store"), ("load (tier->engine)", "load")):
            lines.append(
                f"{'  ' + label + ', ' + which:<30}{sm['bytes'] / 2**20:>11.1f}"
                f"{sm[tag + key + '_gb_per_s']:>9.2f}"
                f"{sm[tag + base[key] + '_gb_per_s']:>14.2f}{sm[tag + key + '_ratio']:>8.3f}"
            )
    lines.append(
        f"  (median of {sm['rounds']} rounds: store {sm['store_ms']:.1f} ms, load "
        f"{sm['load_ms']:.1f} ms; a plain copy alone {sm['copy_ms']:.1f} ms, one bare round "
        f"trip to the tier {sm['tier_ping_ms']:.1f} ms)"
    )
    return lines


PARTS = ("lookup", "object-store", "shared-memory")


def run(
    quick: bool = False,
    echo: Callable[[str], None] = print,
    parts: tuple[str, ...] = (),
    rounds: int | None = None,
) -> dict[str, Any]:
    """Every part of the bench (``parts``: a subset of ``PARTS``, default all); ``rounds``
    of each data-moving measurement (default 5, 2 with ``quick``)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray.cluster_utils import Cluster

    import raykv

    node = dict(
        num_cpus=1,
        num_gpus=0,  # GPU pools take a whole GPU each: two models could not share one
        node_ip_address="127.0.0.1",
        object_store_memory=(200 if quick else 600) << 20,
    )
    parts = parts or PARTS
    reps = rounds or (2 if quick else 5)
    # the bench cluster's node agents: a folder of its own (never a `raykv up` of this host's)
    os.environ[AGENT_DIR_ENV] = tempfile.mkdtemp(prefix="raykv-bench-agents-")
    echo("starting a 2-node local Ray cluster on 127.0.0.1 ...")
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        worker = cluster.add_node(**node)
        kv = raykv.connect(cluster.address)
        a_node, b_node = cluster.head_node.node_id, worker.node_id
        out: dict[str, Any] = {"quick": quick}
        if "lookup" in parts:
            echo("lookups of 32k-token prompts ...")
            out["lookup"] = _lookup_bench(kv, a_node, b_node, 32768, 20 if quick else 200)
        if "object-store" in parts:
            echo("cross-node loads through the object store ...")
            bw = _bandwidth_bench(kv, a_node, b_node, 32 if quick else 256, reps)
            echo("raw Ray put/get of the same bytes across nodes ...")
            out["object_store"] = bw
            out["raw_ray"] = raw_ray_bench(a_node, b_node, bw["bytes"], reps)
        if "shared-memory" in parts:
            echo("engine <-> CPU tier through shared memory ...")
            out["shared_memory"] = _shm_bench(kv, 32 if quick else 256, reps)
            if torch.cuda.is_available():  # an engine with its KV on this host's GPU
                echo("engine on CUDA <-> CPU tier (pinned shared memory) ...")
                n = 256 if quick else 2048  # 1 GiB: ~20 ms over PCIe, 10x a round trip
                out["shared_memory_cuda"] = _shm_bench(kv, n, reps, "cuda")
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def format_report(r: dict[str, Any]) -> str:
    lines = _format_lookup(r["lookup"]) if "lookup" in r else []
    lines += format_dataplane(r)
    return "\n".join(lines)


def _format_lookup(lk: dict[str, Any]) -> list[str]:
    head = f"{'lookup, 32k-token prompt':<30}{'lookups/s':>11}{'p50 ms':>9}{'p99 ms':>9}"
    lines = [head]
    names = {"hit": "engine hit", "miss": "engine miss", "driver_hit": "Ray driver hit"}
    for label in ("hit", "miss", "driver_hit"):
        x = lk[label]
        lines.append(
            f"{'  ' + names[label] + ' (' + str(x['hit_tokens']) + ' tok)':<30}"
            f"{x['lookups_per_s']:>11.1f}"
            f"{x['p50_ms']:>9.2f}{x['p99_ms']:>9.2f}"
        )
    ping, rt = lk["ping"], lk["ratios"]
    lines.append(f"{'  bare actor ping':<30}{'':>11}{ping['p50_ms']:>9.2f}{ping['p99_ms']:>9.2f}")
    lines.append(
        f"  engine vs ping p50: hit p50 {rt['hit_p50_vs_ping']:.2f}x, miss p50 "
        f"{rt['miss_p50_vs_ping']:.2f}x (target <= 0.5); hit p99 {rt['hit_p99_vs_ping']:.2f}x, "
        f"miss p99 {rt['miss_p99_vs_ping']:.2f}x (target <= 1); "
        f"a Ray driver's hit p50 {rt['driver_hit_p50_vs_ping']:.2f}x"
    )
    lines.append(
        f"  an engine lookup's hashing of {lk['blocks']} blocks: {lk['hashing_ms']:.2f} ms "
        f"(target <= 0.3 ms; as a list of digests {lk['hashing_list_ms']:.2f} ms); the "
        f"reference loop {lk['hashing_reference_ms']:.2f} ms: {rt['hashing_vs_reference']:.2f}x"
    )
    return lines


def main(
    quick: bool = False,
    as_json: bool = False,
    parts: tuple[str, ...] = (),
    rounds: int | None = None,
) -> None:
    import click

    r = run(quick=quick, echo=lambda s: click.echo(s, err=True), parts=parts, rounds=rounds)
    click.echo(json.dumps(r, indent=2) if as_json else format_report(r))

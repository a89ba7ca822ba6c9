"""The UCX section of ``raykv bench transport`` (``raykv.bench.transport``): blocks between
nodes over UCX, next to the raw baselines of the same bytes, in one run (``ucx_*``):

* ``ucx_pair`` (no Ray, runs anywhere ucxx does): a peer process serves a CPU-tier arena of
  scattered blocks (``raykv.bench.ucx_peer``); this process fetches 512 of them through
  raykv as a tier's pull does (``UcxTransport.stream`` read through ``receive``: request, then
  per chunk a header and rows striped over 1 or N endpoints into one staging buffer, each
  chunk scattered into a local arena by one paged copy on the reader's own loop, each span
  verified on the copying thread right before it is written, while the next one is on the
  wire); the same in place (``raykv_inplace_*``: blocks
  whose rows run on both ends, as a tier pull's usually do: sent from the peer's arena,
  received into the reader's rows, only verified there); and, on the same transport
  (``UCX_TLS``), the same bytes as one contiguous buffer over one raw ucxx endpoint.
* ``ucx_cluster`` (2-node local Ray cluster on 127.0.0.1): a CPU tier pulls the blocks
  another node's tier holds (``CpuTierActor.pull``: locate, fetch over UCX, verify, store
  with checksums, publish), next to a raw Ray put/get of the same bytes across the nodes.

Targets (docs/design.md, "Targets"): raykv >= 0.8 x raw ucxx on the same transport; over tcp,
striped, >= a raw Ray put/get.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

UCX_MODEL = "bench-ucx"
BLOCK_BYTES = 256 << 10  # 4 layers x K,V x 16 tokens x 8 heads x 128 x fp16


def _secret() -> str:
    s = os.environ.get("RAYKV_TRANSPORT_SECRET") or secrets.token_hex(32)
    os.environ["RAYKV_TRANSPORT_SECRET"] = s  # the peer process and Ray's nodes inherit it
    return s


def _rate(nbytes: int, times: list[float]) -> dict[str, float]:
    med = statistics.median(times)
    return {
        "median_s": med,
        "gb_per_s": nbytes / med / 1e9,
        "best_gb_per_s": nbytes / min(times) / 1e9,
    }


def ucx_pair(
    tls: str | None = "tcp",
    blocks: int = 512,
    block_bytes: int = BLOCK_BYTES,
    stripes: Sequence[int] = (1, 4),
    reps: int = 5,
    prefix: Sequence[str] = (),
    host: str = "127.0.0.1",
    chunk_bytes: int | None = None,
) -> dict[str, Any]:
    """raykv's UCX fetch (per stripe count) vs raw ucxx, two processes, same bytes and TLS.
    ``prefix``: run the peer under it (``ip netns exec NS``); ``host``: its address;
    ``chunk_bytes``: the reader's chunk size (``RAYKV_UCX_CHUNK_BYTES``, else its default)."""
    import asyncio

    from raykv import ops
    from raykv.bench.ucx_peer import RUNS, block_rows, threads
    from raykv.transport.base import receive
    from raykv.transport.ucx import UcxTransport
    from raykv.transport.ucx.config import UcxConfig
    from raykv.transport.ucx.runtime import UcxRuntime

    threads()
    secret = _secret()
    cmd = [*prefix, sys.executable, "-m", "raykv.bench.ucx_peer", "--host", host,
           "--blocks", str(blocks), "--block-bytes", str(block_bytes)]  # fmt: skip
    if tls:
        cmd += ["--tls", tls]
    # UCX's sockets on the peer's device only: loopback for a peer on 127.0.0.1
    devs = os.environ.get("RAYKV_UCX_NET_DEVICES") or ("lo" if host == "127.0.0.1" else None)
    if devs and not prefix:
        cmd += ["--net-devices", devs]
    peer = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = " "
        while line and not line.startswith("{"):  # UCX may print its warnings first
            line = peer.stdout.readline() if peer.stdout else ""
        if not line:
            raise RuntimeError(f"the UCX peer process exited ({peer.wait()}): {' '.join(cmd)}")
        where = json.loads(line)
        want = block_rows(blocks, block_bytes, 0)
        nbytes = want.numel()
        keys = [i.to_bytes(8, "little") for i in range(blocks)]
        local = torch.zeros((2 * blocks, block_bytes), dtype=torch.uint8)
        dest = torch.randperm(2 * blocks)[:blocks]  # scattered, as in a tier's arena
        runtime = UcxRuntime.get(tls, devs)
        chunk = chunk_bytes or UcxConfig.from_env().chunk_bytes
        ts = {k: UcxTransport(secret.encode(), UcxConfig(tls=tls, net_devices=devs, stripes=k,
                                                         stripe_min_bytes=1, chunk_bytes=chunk))
              for k in stripes}  # fmt: skip
        raw = _RawUcxx(runtime, where["raw"], nbytes)

        loop = asyncio.new_event_loop()  # the reader's loop (a tier actor's), not UCX's

        async def scatter(at: int, rows: Any, check: Any) -> None:  # as a tier's pull writes
            ops.scatter_blocks(rows.rows[0], [local], dest[at : at + rows.count],
                               check=check.span(0))  # fmt: skip

        async def verified(at: int, rows: Any) -> None:  # written (and checked) already
            pass

        runs = torch.zeros((blocks, block_bytes), dtype=torch.uint8)  # reserved rows, in order

        def land(at: int, count: int, copies: int, width: int, seconds: float) -> Any:
            return runs[at : at + count].view(-1) if copies == 1 else None

        async def in_place(at: int, rows: Any) -> None:  # landed: nothing to copy
            if rows.rows.data_ptr() != runs[at].data_ptr():
                runs[at : at + rows.count] = rows.rows[0]

        def through_raykv(t: UcxTransport, where_rows: bool = False) -> None:
            stream = (t.stream("peer", RUNS, keys, where["raykv"], land) if where_rows
                      else t.stream("peer", "m", keys, where["raykv"]))  # fmt: skip
            fetch = receive(stream, in_place) if where_rows else (
                receive(stream, verified, write=scatter))  # fmt: skip
            got = loop.run_until_complete(fetch)
            assert got.count == blocks, f"{blocks - got.count} blocks failed their checksums"

        calls: dict[str, Callable[[], Any]] = {}
        for k, t in ts.items():
            calls[f"raykv_{k}"] = lambda t=t: through_raykv(t)
            calls[f"raykv_inplace_{k}"] = lambda t=t: through_raykv(t, where_rows=True)
        calls["raw_ucxx"] = raw.one
        times = _interleaved(calls, reps)
        assert torch.equal(local[dest], want[0]), "raykv moved wrong bytes"
        assert torch.equal(runs, want[0]), "raykv moved wrong bytes in place"
        out: dict[str, Any] = {"tls": tls or "default", "blocks": blocks, "bytes": nbytes,
                               "chunk_bytes": chunk}  # fmt: skip
        out |= {k: _rate(nbytes, v) for k, v in times.items()}
        for t in ts.values():
            t.close()
        raw.close()
        loop.close()
        return out
    finally:
        if peer.stdin:
            peer.stdin.close()
        try:
            peer.wait(10)
        except subprocess.TimeoutExpired:
            peer.kill()


def _interleaved(calls: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds per call, the calls taking turns each rep (a load spike on a shared machine
    hits them alike, so their ratios stay fair); one untimed warm-up each."""
    for fn in calls.values():
        fn()
    out: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(reps):
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
    return out


class _RawUcxx:
    """The baseline: ask for ``nbytes``, get them as one message on one raw endpoint (by
    worker address: a hello with ours and our tag, as raykv's, then no auth, no header)."""

    def __init__(self, runtime: Any, where: list, nbytes: int) -> None:
        import numpy as np

        from raykv.transport.ucx.wire import new_tag

        self.runtime, self.nbytes, self.tag = runtime, nbytes, new_tag()
        self.buf = np.empty(nbytes, np.uint8)
        self.size = np.array([nbytes], np.uint64)
        self.ep = runtime.submit(self._connect(bytes.fromhex(where[1]), int(where[2]))).result(60)

    async def _connect(self, address: bytes, tag: int) -> Any:
        import numpy as np
        import ucxx

        from raykv.transport.ucx.wire import hello_frame

        ep = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(address)
        )
        mine = await self.runtime.worker_address()
        await ep.send(np.frombuffer(hello_frame(mine, self.tag), np.uint8), tag=tag, force_tag=True)
        return ep

    async def _one(self) -> None:
        await self.ep.send(self.size, tag=self.tag ^ 1, force_tag=True)
        await self.ep.recv(self.buf, tag=self.tag, force_tag=True)

    def one(self) -> None:
        self.runtime.submit(self._one()).result(300)

    def close(self) -> None:
        self.ep.abort()


def ucx_cluster(blocks: int = 512, reps: int = 5, tls: str = "tcp", stripes: int = 4) -> dict:
    """A CPU tier pulls ``blocks`` blocks another node's tier holds, over UCX, vs a raw Ray
    put/get of the same bytes across the two nodes (2-node local cluster on 127.0.0.1)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    _secret()
    os.environ.update(RAYKV_UCX_TLS=tls, RAYKV_UCX_STRIPES=str(stripes),
                      UCX_WARN_UNUSED_ENV_VARS="n")  # fmt: skip
    os.environ.setdefault("RAYKV_UCX_NET_DEVICES", "lo")  # the nodes are on 127.0.0.1
    import ray
    from ray.cluster_utils import Cluster

    import raykv
    from raykv.bench.service import raw_ray_bench

    nbytes = blocks * BLOCK_BYTES
    node = dict(num_cpus=1, num_gpus=0, node_ip_address="127.0.0.1",
                object_store_memory=max(200 << 20, 3 * nbytes))  # fmt: skip
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    try:
        worker = cluster.add_node(**node)
        kv = raykv.connect(cluster.address)
        a_node, b_node = cluster.head_node.node_id, worker.node_id
        pull = _tier_pull(kv, a_node, b_node, blocks, reps)
        raw = raw_ray_bench(a_node, b_node, pull["bytes"], reps)
        return {"tier_pull": pull, "raw_ray": raw, "stripes": stripes, "tls": tls}
    finally:
        ray.shutdown()
        cluster.shutdown()


def _tier_pull(kv: Any, a_node: str, b_node: str, blocks: int, reps: int) -> dict[str, Any]:
    import ray

    from raykv.blocks import BlockHasher
    from raykv.layout import FullAttention
    from raykv.service.groups import group_keys
    from raykv.service.served import NAMESPACE, tier_name

    layers = {
        f"l{i}": FullAttention(dtype="float16", num_kv_heads=8, head_dim=128) for i in range(4)
    }
    tokens = blocks * 16
    plan = kv.add_model(UCX_MODEL, layers, max_model_len=tokens + 16,
                        pool_bytes=(blocks + 16) * BLOCK_BYTES,
                        cpu_bytes=(blocks + 8) * BLOCK_BYTES,
                        max_num_batched_tokens=tokens + 16)  # fmt: skip
    a = kv.on(a_node)
    tier_b = ray.get_actor(tier_name(b_node), namespace=NAMESPACE)
    times, routes = [], set()
    for r in range(reps + 1):
        g = torch.Generator().manual_seed(200 + r)
        prompt = torch.randint(0, 100_000, (tokens + 1,), generator=g).tolist()
        rid = f"u{r}"
        assert a.admit(rid, len(prompt), prompt)
        table = a.allocate(rid, len(prompt), prompt)[0]
        rows = torch.randint(
            0, 256, (blocks, plan.gpu_bytes_per_block), generator=g, dtype=torch.uint8
        )
        assert a.store(rid, table[:blocks], rows, offload=True) == blocks
        a.free(rid)
        keys = group_keys(plan, BlockHasher(plan.hash_block_size).hash_blocks(prompt))[0][:blocks]
        t0 = time.perf_counter()
        got = ray.get(tier_b.pull.remote(UCX_MODEL, keys))
        if r:
            times.append(time.perf_counter() - t0)
        assert got == blocks, f"the pull got {got} of {blocks} blocks"
    routes = {x["transport"] for x in kv.stats()["routes"] if x["to"] == tier_name(b_node)}
    return {"bytes": blocks * plan.gpu_bytes_per_block, "routes": sorted(routes)} | _rate(
        blocks * plan.gpu_bytes_per_block, times
    )


def ucx_run(quick: bool = False, echo: Callable[[str], None] = print, tls: str = "tcp") -> dict:
    blocks, reps = (64, 2) if quick else (512, 5)
    echo(f"UCX ({tls}): raykv fetch vs raw ucxx, two processes, {blocks} blocks ...")
    pair = ucx_pair(tls, blocks, stripes=(1, 4), reps=reps)
    echo("UCX: CPU tier -> CPU tier pull on a 2-node Ray cluster vs Ray put/get ...")
    # as many pulls as raw ucxx's sends above: a ratio of two medians of one sample size
    cluster = ucx_cluster(blocks, reps, tls)
    return {"pair": pair, "cluster": cluster, "quick": quick}


def ucx_format(r: dict[str, Any], machine: str = "") -> str:
    p, c = r["pair"], r["cluster"]
    raw, ray_ = p["raw_ucxx"]["gb_per_s"], c["raw_ray"]["gb_per_s"]
    mib = p["bytes"] / (1 << 20)
    lines = [
        f"UCX, UCX_TLS={p['tls']}: {p['blocks']} scattered blocks, {mib:.0f} MiB{machine}",
        f"{'':<46}{'GB/s':>7}{'vs raw ucxx':>13}{'vs Ray put/get':>16}",
    ]

    def row(label: str, gbs: float) -> None:
        lines.append(f"{label:<46}{gbs:>7.3f}{gbs / raw:>12.2f}x{gbs / ray_:>15.2f}x")

    for k in sorted(int(x.split("_")[-1]) for x in p if x.startswith("raykv_inplace_")):
        row(f"raykv fetch+verify+scatter, {k} endpoint(s)", p[f"raykv_{k}"]["gb_per_s"])
        row(f"  the same in place (rows that run), {k}", p[f"raykv_inplace_{k}"]["gb_per_s"])
    row(f"raykv CPU tier -> CPU tier pull ({c['stripes']} endpoints)", c["tier_pull"]["gb_per_s"])
    row("raw ucxx, one contiguous buffer, 1 endpoint", raw)
    row("raw Ray put/get across nodes", ray_)
    lines.append(f"  tier pull routes: {', '.join(c['tier_pull']['routes'])}")
    return "\n".join(lines)


def ucx_pairs_main(argv: list[str] | None = None) -> None:
    """``python -m raykv.bench.transport_ucx --tls tcp --tls sm,self``: the Ray-less section
    (``ucx_pair``) for each transport, as JSON lines (hosts without Ray: the device)."""
    import argparse

    p = argparse.ArgumentParser(description=ucx_pairs_main.__doc__)
    p.add_argument("--tls", action="append", default=None)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--stripes", default="1,4")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--chunk-bytes", type=int, default=None)
    a = p.parse_args(argv)
    tlss = a.tls or ["tcp"]
    if len(tlss) > 1:  # UCX's transports are fixed per process: one process per UCX_TLS
        for tls in tlss:
            rest = ["--blocks", str(a.blocks), "--stripes", a.stripes, "--reps", str(a.reps)]
            rest += ["--chunk-bytes", str(a.chunk_bytes)] if a.chunk_bytes else []
            subprocess.run([sys.executable, "-m", __spec__.name, "--tls", tls, *rest], check=False)
        return
    for tls in tlss:
        stripes = tuple(int(x) for x in a.stripes.split(","))
        try:
            r = ucx_pair(tls, a.blocks, stripes=stripes, reps=a.reps, chunk_bytes=a.chunk_bytes)
        except Exception as e:  # one transport missing on this host: say so, go on
            r = {"tls": tls, "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    ucx_pairs_main()

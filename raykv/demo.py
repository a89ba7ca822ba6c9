"""``raykv demo``: two engines on two Ray nodes share one prompt's KV through raykv.

On one host: a 2-node local Ray cluster (both raylets on 127.0.0.1), the raykv service on
it, and a tiny random-weight decoder running as two engine actors pinned to different nodes.
Engine A prefills a long shared prompt and stores its KV in its node's pool. Engine B, on
the other node, looks the prompt up, loads the KV across nodes (``raykv.transport``: over
UCX when ucxx is installed, ``raykv[ucx]``, else Ray's object store; the output says which)
and computes only its own suffix. B's next-token logits must match a full recompute.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch

from raykv.errors import ServiceError
from raykv.layout.specs import cdiv

MODEL = "tiny-demo"


class DemoEngine:
    """One engine instance: the tiny decoder plus a paged KV cache laid out like the pools'
    (``GpuKV`` from the same plan), so block rows copy straight between them."""

    def __init__(self, client: Any, seed: int = 0) -> None:
        from raykv.models import TinyConfig, TinyDecoder
        from raykv.tiers.gpu_kv import GpuKV

        torch.set_num_threads(1)
        self.kv = client
        self.model = TinyDecoder(TinyConfig(seed=seed))
        self.plan = client.plan
        self.gpu_kv = GpuKV.allocate(self.plan, "cpu")
        group = self.plan.groups[0]
        self.gid, self.block_size = group.group_id, group.block_size
        self.cache = [self.gpu_kv.kernel_view(name) for name in group.layer_names]

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def _rows(self, block_ids: list[int]) -> torch.Tensor:
        from raykv import ops

        dst = torch.empty((len(block_ids), self.gpu_kv.row_bytes(self.gid)), dtype=torch.uint8)
        ops.gather_blocks(self.gpu_kv.entries(self.gid), torch.tensor(block_ids), dst)
        return dst

    def prefill_and_store(self, rid: str, tokens: list[int]) -> dict[str, float]:
        """Compute the whole prompt, then publish its full blocks to the cluster."""
        t0 = time.perf_counter()
        assert self.kv.admit(rid, len(tokens), tokens)
        table = self.kv.allocate(rid, len(tokens), tokens)[0]
        self.model(tokens, 0, self.cache, table)
        t1 = time.perf_counter()
        full = len(tokens) // self.block_size
        stored = self.kv.store(rid, table[:full], self._rows(table[:full]))
        self.kv.free(rid)  # its blocks stay cached and valid until evicted
        return {"prefill_s": t1 - t0, "store_s": time.perf_counter() - t1, "blocks": stored}

    def continue_from_cache(self, rid: str, tokens: list[int]) -> dict[str, Any]:
        """Look the prompt up, load the hit prefix into our blocks, compute the rest."""
        from raykv import ops

        t0 = time.perf_counter()
        hit = self.kv.lookup(tokens)
        assert self.kv.admit(rid, len(tokens), tokens)
        table = self.kv.allocate(rid, len(tokens), tokens)[0]
        res = self.kv.load(rid, tokens, into=table[: hit.hit_tokens // self.block_size])
        done = res.num_tokens  # trust load, not lookup: a copy may have vanished since
        nblocks = done // self.block_size
        if nblocks:
            rows = self.kv.read(table[:nblocks])
            ops.scatter_blocks(rows, self.gpu_kv.entries(self.gid), torch.tensor(table[:nblocks]))
        t1 = time.perf_counter()
        logits = self.model(tokens[done:], done, self.cache, table)[-1]
        self.kv.free(rid)
        return {
            "logits": logits,
            "hit_tokens": hit.hit_tokens,
            "loaded_tokens": done,
            "where": [(h.tier, h.local, h.num_tokens) for h in hit.where],
            "load_s": t1 - t0,
            "compute_s": time.perf_counter() - t1,
            "total_s": time.perf_counter() - t0,
            "bytes": res.bytes,
        }

    def full_recompute(self, tokens: list[int]) -> dict[str, Any]:
        """The reference: every token computed here, nothing from raykv."""
        n = cdiv(len(tokens), self.block_size)
        table = list(range(1, n + 1))  # a private cache, the pool is not involved
        cache = [torch.zeros_like(c) for c in self.cache]
        t0 = time.perf_counter()
        logits = self.model(tokens, 0, cache, table)[-1]
        return {"logits": logits, "total_s": time.perf_counter() - t0}


def _ucx_env() -> bool:
    """Before the nodes start: give them a transport secret (UCX endpoints authenticate
    with it) and tcp on loopback only (``lo``: every UCX socket on 127.0.0.1), when ucxx is
    installed. True if UCX will run."""
    import secrets

    from raykv.transport.ucx.runtime import available

    if not available() or os.environ.get("RAYKV_UCX", "1") == "0":
        return False
    os.environ.setdefault("RAYKV_TRANSPORT_SECRET", secrets.token_hex(32))
    os.environ.setdefault("RAYKV_UCX_TLS", "tcp")
    os.environ.setdefault("RAYKV_UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    return True


def _route(kv: Any, reader_node: str) -> str:
    """How the cross-node load travelled: the transports of the pairs read from."""
    stats = kv.stats()
    used = {r["transport"] for r in stats["routes"] if reader_node[:12] in r["to"]}
    fell = sum(m.get("failures_transport_ucx", 0) for m in stats["members"])
    if "ucx" in used and fell:
        return f"over Ray's object store: UCX failed {fell} time(s), see the pools' logs"
    if "ucx" in used:
        return f"over UCX (UCX_TLS={os.environ.get('RAYKV_UCX_TLS', 'default')})"
    return "over Ray's object store (pip install 'raykv[ucx]' to move blocks over UCX)"


def _local_cluster() -> Any:
    """Two Ray nodes on 127.0.0.1 (``node-a``, ``node-b``); a ServiceError naming the fix
    where Ray does not start them."""
    from ray.cluster_utils import Cluster

    node = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=100 << 20)
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={**node, "resources": {"node-a": 1}, "include_dashboard": False},
        )
        cluster.add_node(**node, resources={"node-b": 1})
        return cluster
    except Exception as e:  # Ray's own: a raylet that registered too late, a port taken
        if cluster is not None:
            cluster.shutdown()
        raise ServiceError(
            f"the demo's local Ray cluster did not start ({type(e).__name__}: {e}); on a busy "
            f"host (load average now {os.getloadavg()[0]:.1f}) Ray's nodes may register too "
            "late: run it again when the host is quieter, or give Ray longer with "
            "RAY_raylet_start_wait_time_s=120"
        ) from e


def run_demo(
    echo: Callable[[str], None] = print,
    prompt_tokens: int = 3072,
    suffix_tokens: int = 32,
    seed: int = 0,
) -> bool:
    """Run the demo; True when B's logits match the full recompute."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    import raykv
    from raykv.models import TinyDecoder

    t_start = time.perf_counter()
    ucx = _ucx_env()
    echo("[1/6] starting a 2-node local Ray cluster on 127.0.0.1 ...")
    cluster = _local_cluster()
    try:
        echo(
            "[2/6] starting raykv (coordinator, a pool and a CPU tier per node"
            + (", UCX servers)" if ucx else ")")
            + " ..."
        )
        kv = raykv.connect(cluster.address)
        layers = TinyDecoder().kv_layers()
        plan = kv.add_model(
            MODEL,
            layers,
            max_model_len=prompt_tokens + 1024,
            pool_bytes=32 << 20,
            cpu_bytes=16 << 20,
        )
        echo(
            f"      plan: {plan.num_gpu_blocks} blocks of {plan.gpu_bytes_per_block >> 10} KiB "
            f"per pool, {plan.cpu_num_blocks} CPU-tier blocks per node"
        )
        engine = ray.remote(num_cpus=1)(DemoEngine)
        a = engine.options(resources={"node-a": 1}).remote(kv, seed)
        b = engine.options(resources={"node-b": 1}).remote(kv, seed)
        node_a, node_b = ray.get([a.node_id.remote(), b.node_id.remote()])
        echo(f"      engine A on node {node_a[:12]}, engine B on node {node_b[:12]}")

        gen = torch.Generator().manual_seed(seed)
        shared = torch.randint(0, 2048, (prompt_tokens,), generator=gen).tolist()
        question = torch.randint(0, 2048, (suffix_tokens,), generator=gen).tolist()
        echo(f"[3/6] engine A prefills a {prompt_tokens}-token shared prompt and stores its KV ...")
        ra = ray.get(a.prefill_and_store.remote("a-1", shared))
        echo(
            f"      prefill {ra['prefill_s']:.2f}s, stored {ra['blocks']} blocks "
            f"in {ra['store_s']:.2f}s"
        )
        echo("[4/6] engine B looks the prefix up, loads it across nodes, computes its suffix ...")
        rb = ray.get(b.continue_from_cache.remote("b-1", shared + question))
        echo(
            f"      hit {rb['hit_tokens']} tokens {rb['where']}, loaded {rb['loaded_tokens']} "
            f"({rb['bytes'] / 2**20:.1f} MiB) in {rb['load_s']:.2f}s, "
            f"computed {len(shared) + suffix_tokens - rb['loaded_tokens']} in "
            f"{rb['compute_s']:.2f}s"
        )
        echo(f"      the KV crossed nodes {_route(kv, node_b)}")
        echo("[5/6] engine B recomputes the whole prompt for reference ...")
        rf = ray.get(b.full_recompute.remote(shared + question))
        echo("[6/6] checking B's next-token logits against the full recompute ...")
        ok = bool(torch.allclose(rb["logits"], rf["logits"], rtol=1e-4, atol=1e-4))
        diff = float((rb["logits"] - rf["logits"]).abs().max())
        saved = rf["total_s"] - rb["total_s"]
        echo(
            f"      full recompute {rf['total_s']:.2f}s vs raykv {rb['total_s']:.2f}s: "
            f"prefill time saved {saved:.2f}s ({saved / rf['total_s']:.0%})"
        )
        echo(
            f"      logits {'MATCH' if ok else 'MISMATCH'} (max |diff| {diff:.2e}); "
            f"cluster hit rate {kv.stats()['hit_rate']:.0%}; "
            f"demo took {time.perf_counter() - t_start:.0f}s"
        )
        return ok and rb["loaded_tokens"] > 0
    finally:
        ray.shutdown()
        cluster.shutdown()

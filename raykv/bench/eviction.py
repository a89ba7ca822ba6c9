"""``raykv bench eviction``: lower-tier policies replayed on the routing bench's workload.

The multi-tenant scenario of ``raykv bench routing`` (``workload(spec)``: Zipf-popular shared
system prompts, multi-turn conversations, bursts) becomes a block-key trace: each request's
prompt hashed into block keys (``BlockHasher``, 32 tokens a block), every block of every
request in arrival order. The trace runs through a model of two tiers: a CPU tier of C blocks,
LRU as today (``LRUPolicy``), whose every eviction is offered to a lower tier of D blocks. Per
request the blocks are read as an engine reads them, the longest cached prefix: a block counts
as a hit of the tier that holds it until the first block no tier holds; from there on the
prompt is recomputed and stored. Every block read or stored lands in the CPU tier (a lower-tier
hit is loaded up; the lower tier keeps its copy, so evicting that block again writes nothing).

Policies of the lower tier, side by side on the same trace: ``lru`` (LRU, admits everything),
``lru+tinylfu`` (LRU, ``TinyLFU`` admission), ``arc`` (``ARCPolicy``, admits everything); and
``none``, no lower tier (the CPU tier alone). Per policy: the hit rate of the CPU tier, of the
lower tier and in total (cached blocks / prompt blocks), and the blocks written to the lower
tier. One seed's workload is one draw of tenant popularity and arrival order, and rankings moved
with it (a rule tried on the way won by 14 points on seed 0 and lost by 8 on seed 1), so the
report is the mean over ``seeds`` workloads, each seed's rows in the JSON. Pure Python, no Ray.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from raykv.bench.routing import BLOCK, WorkloadSpec, _machine, multi_tenant
from raykv.blocks.hashing import BlockHasher
from raykv.errors import ConfigError
from raykv.tiers.admission import make_admission
from raykv.tiers.policies import LRUPolicy, make_policy

POLICIES = ("none", "lru", "lru+tinylfu", "arc")
SEEDS = 3
CPU_FRACTIONS = (0.05, 0.10)  # C: of the trace's unique blocks
LOWER_FRACTIONS = (0.20, 0.50)  # D: of the trace's unique blocks
QUICK_SPEC = WorkloadSpec(tenants=6, system_tokens=(1024, 4096), conversations=24)

Trace = list[list[bytes]]  # per request, its prompt's block keys


@dataclass(frozen=True)
class Row:
    policy: str
    cpu_blocks: int
    lower_blocks: int
    cpu_hit: float
    lower_hit: float
    total_hit: float
    writes: int  # blocks written to the lower tier
    rejected: int  # evictions the admission filter kept out of the lower tier


def trace_of(spec: WorkloadSpec) -> Trace:
    """The multi-tenant scenario's requests as block keys, in arrival order."""
    hasher = BlockHasher(BLOCK)
    return [hasher.hash_blocks(r.token_ids) for r in multi_tenant(spec).requests]


def _always(key: bytes) -> bool:
    return True


def simulate(trace: Trace, policy: str, cpu_blocks: int, lower_blocks: int) -> Row:
    """One replay of ``trace`` through a CPU tier of ``cpu_blocks`` and, under ``policy``, a
    lower tier of ``lower_blocks`` (module docstring)."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown lower-tier policy {policy!r}; use one of {list(POLICIES)}")
    if cpu_blocks < 1 or lower_blocks < 1:
        raise ConfigError(
            f"tiers of {cpu_blocks} and {lower_blocks} blocks: both need >= 1 block; raise "
            "the fractions or the workload's size"
        )
    has_lower = policy != "none"
    eviction, _, admission_name = policy.partition("+")
    lower = make_policy(eviction if has_lower else "lru", lower_blocks)
    admission = make_admission(lower_blocks, admission_name) if admission_name else None
    cpu, in_cpu, in_lower = LRUPolicy(), set(), set()
    cpu_hits = lower_hits = blocks = writes = rejected = 0

    def offer(key: bytes) -> None:  # the CPU tier evicted ``key``
        nonlocal writes, rejected
        if not has_lower or key in in_lower:  # already written: nothing to do
            return
        victim = None
        if len(in_lower) >= lower_blocks:
            (victim,) = lower.victims(1, _always)
        if admission is not None and not admission.admit(key, victim):
            rejected += 1
            return
        if victim is not None:
            lower.evict(victim)
            in_lower.discard(victim)
        lower.insert(key)
        in_lower.add(key)
        writes += 1

    for keys in trace:
        blocks += len(keys)
        cached = True  # still inside the prompt's cached prefix
        for key in keys:
            if admission is not None:
                admission.record(key)
            if key in in_cpu:
                cpu_hits += cached
                cpu.touch(key)
                continue
            if cached and key in in_lower:
                lower_hits += 1
                lower.touch(key)
            else:
                cached = False
            if len(in_cpu) >= cpu_blocks:
                (evicted,) = cpu.victims(1, _always)
                cpu.evict(evicted)
                in_cpu.discard(evicted)
                offer(evicted)
            cpu.insert(key)
            in_cpu.add(key)
    return Row(
        policy=policy,
        cpu_blocks=cpu_blocks,
        lower_blocks=lower_blocks,
        cpu_hit=cpu_hits / max(1, blocks),
        lower_hit=lower_hits / max(1, blocks),
        total_hit=(cpu_hits + lower_hits) / max(1, blocks),
        writes=writes,
        rejected=rejected,
    )


def run(
    spec: WorkloadSpec,
    seeds: int = SEEDS,
    cpu_fractions: Sequence[float] = CPU_FRACTIONS,
    lower_fractions: Sequence[float] = LOWER_FRACTIONS,
    policies: Sequence[str] = POLICIES,
) -> dict[str, Any]:
    """Every policy at every (C, D), sized as fractions of each trace's unique blocks, on the
    workloads of seeds ``spec.seed .. spec.seed + seeds - 1``; ``rows``: their means."""
    if seeds < 1:
        raise ConfigError(f"seeds must be >= 1, got {seeds}")
    started = time.perf_counter()
    per_seed: list[dict[str, Any]] = []
    for seed in range(spec.seed, spec.seed + seeds):
        trace = trace_of(replace(spec, seed=seed))
        unique = len({k for keys in trace for k in keys})
        rows = []
        for cf in cpu_fractions:
            for lf in lower_fractions:
                c, d = max(1, round(cf * unique)), max(1, round(lf * unique))
                rows += [asdict(simulate(trace, p, c, d)) for p in policies]
        per_seed.append(
            {"seed": seed, "requests": len(trace), "accesses": sum(map(len, trace)),
             "unique_blocks": unique, "rows": rows}
        )  # fmt: skip
    sizes = [(cf, lf) for cf in cpu_fractions for lf in lower_fractions]
    means = []
    for i, row in enumerate(per_seed[0]["rows"]):
        cf, lf = sizes[i // len(policies)]
        mean = {"policy": row["policy"], "cpu_fraction": cf, "lower_fraction": lf}
        for k in ("cpu_blocks", "lower_blocks", "cpu_hit", "lower_hit", "total_hit", "writes",
                  "rejected"):  # fmt: skip
            mean[k] = sum(s["rows"][i][k] for s in per_seed) / len(per_seed)
        means.append(mean)
    return {
        "workload": asdict(spec),
        "seeds": [s["seed"] for s in per_seed],
        "machine": _machine(),
        "requests": sum(s["requests"] for s in per_seed) / len(per_seed),
        "accesses": sum(s["accesses"] for s in per_seed) / len(per_seed),
        "unique_blocks": sum(s["unique_blocks"] for s in per_seed) / len(per_seed),
        "rows": means,
        "per_seed": per_seed,
        "seconds": round(time.perf_counter() - started, 2),
    }


def format_report(r: dict[str, Any]) -> str:
    seeds = r["seeds"]
    lines = [
        f"raykv bench eviction: the multi-tenant trace, means over seeds {seeds[0]}..{seeds[-1]}: "
        f"{r['requests']:.0f} requests, {r['accesses']:.0f} block accesses, "
        f"{r['unique_blocks']:.0f} unique blocks of {BLOCK} tokens ({r['machine']}, "
        f"{r['seconds']} s)",
        "C, D: CPU / lower tier blocks (% of unique); hit: cached prefix blocks / prompt "
        "blocks; writes: blocks written to the lower tier",
        "",
        f"{'C':>6} {'D':>6}  {'policy':<12} {'cpu hit':>8} {'lower hit':>9} {'total':>7} "
        f"{'writes':>7} {'vs lru':>7} {'rejected':>8}",
    ]
    by_size: dict[tuple[float, float], list[dict[str, Any]]] = {}
    for row in r["rows"]:
        by_size.setdefault((row["cpu_fraction"], row["lower_fraction"]), []).append(row)
    for (cf, lf), rows in by_size.items():
        lru = next((x["writes"] for x in rows if x["policy"] == "lru"), 0)
        for i, x in enumerate(rows):
            ratio = f"{x['writes'] / lru:.2f}x" if lru and x["policy"] != "none" else "-"
            lines.append(
                f"{x['cpu_blocks']:>6.0f} {x['lower_blocks']:>6.0f}  {x['policy']:<12} "
                f"{x['cpu_hit']:>8.1%} {x['lower_hit']:>9.1%} {x['total_hit']:>7.1%} "
                f"{x['writes']:>7.0f} {ratio:>7} {x['rejected']:>8.0f}"
                + ("" if i else f"   (C {cf:.0%}, D {lf:.0%})")
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def main(
    quick: bool = False,
    json_path: str | None = None,
    seed: int | None = None,
    seeds: int | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The CLI's entry: the report printed, and written as JSON to ``json_path`` ('-': only
    the JSON printed). ``--quick``: a smaller workload, one seed."""
    spec = QUICK_SPEC if quick else WorkloadSpec()
    if seed is not None:
        spec = replace(spec, seed=seed)
    report = run(spec, seeds=seeds if seeds is not None else 1 if quick else SEEDS)
    if json_path == "-":
        echo(json.dumps(report, indent=2))
        return report
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    echo(format_report(report))
    return report

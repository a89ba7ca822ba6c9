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
``lru+tinylfu`` (LRU, ``TinyLFU`` admission), ``arc`` (``ARCPolicy``, admits everything),
``arc+tinylfu``; and ``none``, no lower tier (the CPU tier alone). Per policy: the hit rate of
the CPU tier, of the lower tier and in total (cached blocks / prompt blocks), and the blocks
written to the lower tier. Pure Python, no Ray.
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
from raykv.tiers.admission import TinyLFU
from raykv.tiers.policies import LRUPolicy, make_policy

POLICIES = ("none", "lru", "lru+tinylfu", "arc", "arc+tinylfu")
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
    admission = TinyLFU(lower_blocks) if admission_name == "tinylfu" else None
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
    cpu_fractions: Sequence[float] = CPU_FRACTIONS,
    lower_fractions: Sequence[float] = LOWER_FRACTIONS,
    policies: Sequence[str] = POLICIES,
) -> dict[str, Any]:
    """Every policy at every (C, D), sized as fractions of the trace's unique blocks."""
    started = time.perf_counter()
    trace = trace_of(spec)
    unique = len({k for keys in trace for k in keys})
    rows = []
    for cf in cpu_fractions:
        for lf in lower_fractions:
            c, d = max(1, round(cf * unique)), max(1, round(lf * unique))
            rows += [asdict(simulate(trace, p, c, d)) for p in policies]
    return {
        "workload": asdict(spec),
        "machine": _machine(),
        "requests": len(trace),
        "accesses": sum(map(len, trace)),
        "unique_blocks": unique,
        "rows": rows,
        "seconds": round(time.perf_counter() - started, 2),
    }


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"raykv bench eviction: multi-tenant trace, {r['requests']} requests, {r['accesses']} "
        f"block accesses, {r['unique_blocks']} unique blocks of {BLOCK} tokens "
        f"({r['machine']}, {r['seconds']} s)",
        "C, D: CPU / lower tier blocks (% of unique); hit: cached prefix blocks / prompt blocks",
        "",
        f"{'C':>6} {'D':>6}  {'policy':<12} {'cpu hit':>8} {'lower hit':>9} {'total':>7} "
        f"{'writes':>7} {'vs lru':>7} {'rejected':>8}",
    ]
    u = r["unique_blocks"]
    by_size: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for row in r["rows"]:
        by_size.setdefault((row["cpu_blocks"], row["lower_blocks"]), []).append(row)
    for rows in by_size.values():
        lru = next((x["writes"] for x in rows if x["policy"] == "lru"), 0)
        for x in rows:
            c, d = x["cpu_blocks"], x["lower_blocks"]
            ratio = f"{x['writes'] / lru:.2f}x" if lru and x["policy"] != "none" else "-"
            lines.append(
                f"{c:>6} {d:>6}  {x['policy']:<12} {x['cpu_hit']:>8.1%} {x['lower_hit']:>9.1%} "
                f"{x['total_hit']:>7.1%} {x['writes']:>7} {ratio:>7} {x['rejected']:>8}"
                + (f"   (C {c / u:.0%}, D {d / u:.0%})" if x["policy"] == rows[0]["policy"] else "")
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def main(
    quick: bool = False,
    json_path: str | None = None,
    seed: int | None = None,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The CLI's entry: the report printed, and written as JSON to ``json_path`` ('-': only
    the JSON printed)."""
    spec = QUICK_SPEC if quick else WorkloadSpec()
    if seed is not None:
        spec = replace(spec, seed=seed)
    report = run(spec)
    if json_path == "-":
        echo(json.dumps(report, indent=2))
        return report
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    echo(format_report(report))
    return report

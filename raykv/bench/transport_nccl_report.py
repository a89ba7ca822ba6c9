"""The NCCL section's report (``raykv.bench.transport_nccl``): GB/s of payload per rank pair
from the receivers' medians, the like-for-like ratios against the contiguous sends, and the
table ``raykv bench transport`` prints."""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING

from raykv.transport.wire import SHARE_MIN_BYTES

if TYPE_CHECKING:
    from raykv.bench.transport_nccl import NcclConfig

NCCL_TARGET = 0.8  # raykv >= 0.8 x one contiguous NCCL send of the same bytes


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

"""Plan reports for people (a table) and programs (a JSON-ready dict); size parsing."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from raykv.errors import ConfigError
from raykv.layout.plan import Plan
from raykv.layout.specs import KVSpec

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes of '60GiB', '512 MiB', '1.5GB', '4096' (binary units for *iB, decimal else)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise ConfigError(f"cannot read size {text!r}; write e.g. 60GiB, 512MiB, 80GB or 4096")
    return int(float(m.group(1)) * unit)


def format_bytes(n: int | float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def plan_dict(plan: Plan) -> dict[str, Any]:
    """Every plan field plus the derived numbers the table shows; JSON-serialisable."""
    need = plan.admission_blocks(plan.max_model_len)
    return {
        "num_gpu_blocks": plan.num_gpu_blocks,
        "usable_gpu_blocks": plan.usable_gpu_blocks,
        "tokens_per_gpu": plan.tokens_per_gpu,
        "block_size": plan.block_size,
        "hash_block_size": plan.hash_block_size,
        "gpu_bytes_per_block": plan.gpu_bytes_per_block,
        "tp_group_bytes_per_block": plan.tp_group_bytes_per_block,
        "gpu_tensor_bytes": plan.gpu_tensor_bytes,
        "tp_size": plan.tp_size,
        "distinct_copies": plan.distinct_copies,
        "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": plan.max_num_batched_tokens,
        "max_model_len_requests": plan.max_concurrent_requests(),
        "offload_block_size": plan.offload_block_size,
        "block_size_factor": plan.block_size_factor,
        "cpu_num_blocks": plan.cpu_num_blocks,
        "cpu_tokens": plan.cpu_tokens,
        "cpu_bytes_per_block": plan.cpu_bytes_per_block,
        "num_tensors": plan.num_tensors,
        "tensor_page_bytes": list(plan.tensor_page_bytes),
        "padding_waste": plan.padding_waste,
        "groups": [
            {
                "group_id": g.group_id,
                "kind": g.spec.kind,
                "spec": {"kind": g.spec.kind, **dataclasses.asdict(g.spec)},
                "layer_names": list(g.layer_names),
                "block_size": g.block_size,
                "kernel_block_size": g.kernel_block_size,
                "kernel_blocks_per_block": g.kernel_blocks_per_block,
                "layer_page_bytes": list(g.layer_page_bytes),
                "admission_blocks": n,
            }
            for g, n in zip(plan.groups, need, strict=True)
        ],
    }


def _spec_label(spec: KVSpec) -> str:
    extra = {"sliding_window": "window", "chunked_local": "chunk", "cross": "max_encoder_len"}
    field = extra.get(spec.kind)
    return f"{spec.kind} {field}={getattr(spec, field)}" if field else spec.kind


def plan_table(plan: Plan, title: str = "") -> str:
    """The plan as an aligned text table: pool, CPU tier, then one row per group."""
    tp = plan.tp_size
    rows = [
        ("blocks per GPU", f"{plan.num_gpu_blocks} ({plan.usable_gpu_blocks} usable + null)"),
        ("tokens per GPU", f"{plan.tokens_per_gpu}"),
        ("block size / hash block", f"{plan.block_size} / {plan.hash_block_size} tokens"),
        ("bytes per block, 1 rank", format_bytes(plan.gpu_bytes_per_block)),
        (f"bytes per block, TP {tp}", format_bytes(plan.tp_group_bytes_per_block)),
        ("KV tensors per GPU", f"{plan.num_tensors} ({format_bytes(plan.gpu_tensor_bytes)})"),
        ("max_model_len requests", f"{plan.max_concurrent_requests()} x {plan.max_model_len}"),
        ("offload block size", f"{plan.offload_block_size} tokens (x{plan.block_size_factor})"),
        ("CPU-tier blocks", f"{plan.cpu_num_blocks}"),
        ("CPU-tier tokens", f"{plan.cpu_tokens}"),
        ("CPU bytes per block", format_bytes(plan.cpu_bytes_per_block)),
        ("padding waste", f"{plan.padding_waste:.1%}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [title] if title else []
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    header = ("group", "kind", "layers", "block", "kernel", "admission cap", "page/layer")
    body = [
        (
            str(g.group_id),
            _spec_label(g.spec),
            str(len(g.layer_names)),
            str(g.block_size),
            str(g.kernel_block_size),
            f"{n} blocks",
            format_bytes(max(g.layer_page_bytes)),
        )
        for g, n in zip(plan.groups, plan.admission_blocks(plan.max_model_len), strict=True)
    ]
    widths = [max(len(r[c]) for r in [header, *body]) for c in range(len(header))]
    lines.append("")
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *body]
    ]
    return "\n".join(lines)

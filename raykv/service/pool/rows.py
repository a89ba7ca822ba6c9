"""KV rows from callers: uint8 ``[blocks, row_bytes]`` per rank and group, checked up front.

Forms ``store`` accepts (``tp`` = the plan's tp_size, ``G`` = its number of groups):

* one rank, one group: a tensor (or numpy array) ``[n, row_bytes]``;
* one rank, ``G`` groups: a list of ``G`` of those, one per group;
* ``tp`` ranks: a list of ``tp`` of the above, rank order (one group: also a tensor
  ``[tp, n, row_bytes]``).

A group's rows line up either with every id passed for it (rows of null ids are dropped) or
with its non-null ids only. Anything else raises InvalidInput before a byte moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from raykv.errors import InvalidInput
from raykv.layout import tp
from raykv.layout.plan import Plan
from raykv.tiers.jobs import NULL_BLOCK
from raykv.transport.object_store import as_tensor

__all__ = ["RankRows", "as_rank_rows", "as_tensor", "rows_tensor", "to_wire"]

RankRows = list[list[torch.Tensor]]  # [rank][group] -> uint8 [n, row_bytes]


def _array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def rows_tensor(rows: Any, num_blocks: int, row_bytes: int, what: str = "") -> torch.Tensor:
    """Caller rows as uint8 [num_blocks, row_bytes]; InvalidInput (nothing changed) else."""
    if isinstance(rows, np.ndarray):
        rows = as_tensor(rows)
    if not isinstance(rows, torch.Tensor):
        raise InvalidInput(
            f"KV rows{what} must be a torch.Tensor or numpy array, got {type(rows).__name__}"
        )
    if rows.dtype != torch.uint8:
        raise InvalidInput(
            f"KV rows{what} must be uint8 bytes (one row per block), got dtype {rows.dtype}; "
            "gather the blocks with raykv.ops.gather_blocks into a uint8 buffer"
        )
    if tuple(rows.shape) != (num_blocks, row_bytes):
        raise InvalidInput(
            f"KV rows{what} must have shape [{num_blocks}, {row_bytes}] ({num_blocks} blocks x "
            f"{row_bytes} bytes per block of this plan), got {list(rows.shape)}"
        )
    return rows.contiguous()


def _per_rank(plan: Plan, rows: Any) -> list[Any]:
    tp = plan.tp_size
    if tp == 1:
        return [rows]
    if _array(rows) and rows.ndim == 3 and len(plan.groups) == 1 and rows.shape[0] == tp:
        return list(rows)
    if isinstance(rows, (list, tuple)) and len(rows) == tp:
        return list(rows)
    raise InvalidInput(
        f"the model is served with tp_size={tp}: pass KV rows per rank, a list of {tp} "
        "(rank order), each holding that rank's rows"
    )


def _per_group(plan: Plan, rows: Any, rank: str) -> list[Any]:
    n = len(plan.groups)
    if n == 1 and _array(rows):
        return [rows]
    if isinstance(rows, (list, tuple)) and len(rows) == n:
        return list(rows)
    raise InvalidInput(
        f"KV rows{rank} must be {'one tensor or ' if n == 1 else ''}a list of {n} tensors, "
        f"one per KV group, got {type(rows).__name__}"
        + (f" of {len(rows)}" if isinstance(rows, (list, tuple)) else "")
    )


def as_rank_rows(
    plan: Plan, rows: Any, tables: list[list[int]], widths: tuple[int, ...]
) -> RankRows:
    """``rows[rank][group]`` for the non-null ids of ``tables``, each checked."""
    out: RankRows = []
    for r, per_rank in enumerate(_per_rank(plan, rows)):
        rank = f" of rank {r}" if plan.tp_size > 1 else ""
        groups = []
        for gi, (x, table, width) in enumerate(
            zip(_per_group(plan, per_rank, rank), tables, widths, strict=True)
        ):
            what = rank + (f", group {gi}," if len(plan.groups) > 1 else "")
            real = [i for i, b in enumerate(table) if b != NULL_BLOCK]
            given = x.shape[0] if _array(x) and x.ndim >= 1 else -1
            if given == len(table) and len(real) < len(table):
                t = rows_tensor(x, len(table), width, what)
                groups.append(t[torch.tensor(real, dtype=torch.long)])
            else:
                groups.append(rows_tensor(x, len(real), width, what))
        out.append(groups)
    _check_replicas(plan, out)
    return out


def _check_replicas(plan: Plan, rows: RankRows) -> None:
    """Ranks that replicate one copy (an MLA latent, a KV head on several ranks) must be
    given the same bytes: a load reads each share of the copy from a different replica
    (``Collective.recv_shares``), so replicas that differ would hand out mixed KV."""
    copy_of, writers = tp.copy_ranks(plan), tp.writer_ranks(plan)
    for r, c in enumerate(copy_of):
        w = writers[c]  # the copy's first rank
        if r == w:
            continue
        for gi, (mine, first) in enumerate(zip(rows[r], rows[w], strict=True)):
            if not torch.equal(mine, first):
                where = f" (group {gi})" if len(plan.groups) > 1 else ""
                raise InvalidInput(
                    f"ranks {w} and {r} hold the same copy of the KV{where} (tp_size="
                    f"{plan.tp_size}, {len(writers)} distinct copies), but their rows "
                    f"differ; pass rank {r} the same rows as rank {w}"
                )


def to_wire(rows: Any) -> Any:
    """Tensors (nested in lists) as numpy arrays: zero-copy through Ray's object store."""
    if isinstance(rows, torch.Tensor) and rows.dtype == torch.uint8:
        return rows.detach().cpu().contiguous().numpy()
    if isinstance(rows, (list, tuple)):
        return [to_wire(x) for x in rows]
    return rows

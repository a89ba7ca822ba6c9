"""Issue 10, "one implementation of checksum verification and arena addressing": their
only home is ``raykv.tiers``. Read with ``ast``: the checksum hash is imported by
``raykv.tiers.checksum`` alone and an arena row (``block * factor + sub``) is computed by
``ArenaRows.row`` alone; and the leading-rows check that pool-to-pool copies and the
transport's receivers share behaves as one."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import raykv
from raykv.tiers.checksum import row_checksums, verified_prefix

ROOT = Path(raykv.__file__).parent


def _trees() -> dict[str, ast.AST]:
    return {str(p.relative_to(ROOT.parent)): ast.parse(p.read_text()) for p in ROOT.rglob("*.py")}


def _named_factor(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "factor") or (
        isinstance(node, ast.Attribute) and node.attr == "factor"
    )


def _row_arithmetic(tree: ast.AST) -> list[int]:
    """Lines of ``x * factor + y`` (either order of the product)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            for side in (node.left, node.right):
                if (
                    isinstance(side, ast.BinOp)
                    and isinstance(side.op, ast.Mult)
                    and (_named_factor(side.left) or _named_factor(side.right))
                ):
                    out.append(node.lineno)
    return out


def test_the_host_checksum_is_taken_in_tiers_checksum_only() -> None:
    """The row sum is raykv's one checksum: the host takes it (the native extension) only in
    raykv.tiers.checksum (rows at rest) and in the host path of raykv.ops' paged copies
    (raykv.ops.reference: rows as they are copied, the same kernel of block_hash.cpp), and no
    module hashes rows another way (xxhash). (The extension's other entry points, the hash
    chain and the index replica's probe, take no row sums.)"""
    users, other = set(), set()
    for path, tree in _trees().items():
        # names bound to the extension (``native = native_module()``), then their row-sum calls
        ext = {
            t.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) == "native_module"
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in ("row_sums", "copy_rows")
                and getattr(node.value, "id", None) in ext
            ):
                users.add(path)
            if any(n.split(".")[0] == "xxhash" for n in names):
                other.add(path)
    assert users == {"raykv/tiers/checksum.py", "raykv/ops/reference.py"} and not other


def test_arena_rows_are_computed_by_arena_rows_only() -> None:
    found = {path: lines for path, tree in _trees().items() if (lines := _row_arithmetic(tree))}
    assert list(found) == ["raykv/tiers/cpu_tier.py"], found
    tree = _trees()["raykv/tiers/cpu_tier.py"]
    rows = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ArenaRows")
    row = next(n for n in rows.body if isinstance(n, ast.FunctionDef) and n.name == "row")
    assert all(row.lineno <= line <= row.end_lineno for line in found["raykv/tiers/cpu_tier.py"])


def test_the_walk_sees_row_arithmetic() -> None:
    src = "def f(tier, b, s, factor):\n    return tier.factor * b + s, s + b * factor, b * 2 + s\n"
    assert _row_arithmetic(ast.parse(src)) == [2, 2]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 10), flips=st.sets(st.tuples(st.integers(0, 9), st.integers(0, 31))))
def test_verified_prefix_stops_at_the_first_row_that_changed(n, flips) -> None:
    g = torch.Generator().manual_seed(n)
    rows = torch.randint(0, 256, (n, 32), generator=g, dtype=torch.uint8)
    stored = row_checksums(rows)
    bad = {i for i, _ in flips if i < n}
    for i, j in flips:
        if i < n:
            rows[i, j] ^= 0x01
    assert verified_prefix(rows, stored) == min(bad, default=n)

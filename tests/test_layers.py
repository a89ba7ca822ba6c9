"""Layers import downward only (docs/design.md, "Packages and layers"): every ``import`` in
``raykv/`` (module level or inside a function) is read with ``ast`` and checked against the
layer table below."""

from __future__ import annotations

import ast
import sys
from itertools import pairwise
from pathlib import Path

import raykv

ROOT = Path(raykv.__file__).parent

# layer -> the raykv layers it may import (itself always). ``errors`` is everyone's base.
BASE = {"errors"}
BELOW_SERVICE = {
    "errors",
    "layout",
    "blocks",
    "ops",
    "tiers",
    "transport",
    "models",
    "api",
}
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "layout": BASE,
    "blocks": BASE | {"layout"},
    # the paged copy (raykv/ops/): its host copies with row sums run in the native
    # extension that raykv.blocks.hashing builds (kernels/block_hash.cpp)
    "ops": BASE | {"layout", "blocks"},
    "tiers": BASE | {"layout", "blocks", "ops"},
    "transport": BASE | {"layout", "tiers", "ops"},
    "models": BASE | {"layout", "ops"},
    # the client API's values: its input checks (the client runs them, the pools trust
    # them) and the result types of its calls
    "api": BASE | {"layout", "blocks"},
    "service": BELOW_SERVICE,
    "client": BELOW_SERVICE | {"service", "engine"},
    # the engine's side: on the service's Ray-free modules (agent protocol, replica,
    # groups, served), never on Ray itself (``tests/test_engine_without_ray.py``)
    "engine": BELOW_SERVICE | {"service"},
    "integrations": BELOW_SERVICE | {"service", "client", "engine"},
    # tools on top: the demo and the benches drive the service through the client
    "demo": BELOW_SERVICE | {"service", "client"},
    "bench": BELOW_SERVICE | {"service", "client", "engine", "integrations"},
    "cli": BELOW_SERVICE | {"service", "client", "engine", "demo", "bench", "integrations"},
    # raykv.connect & co. (Ray auth set up first), raykv.StoreResult & co., on use
    "__init__": {"client", "service", "api"},
}
# third-party packages a layer may import (None: any)
THIRD_PARTY: dict[str, set[str] | None] = {
    "layout": {"numpy", "torch"},
    "engine": {"numpy", "torch"},
}
# the top package's attributes (``import raykv`` then ``raykv.connect``): the layer of each
TOP_ATTRS = {
    "connect": "client",
    "Client": "client",
    "AsyncClient": "client",
    "LookupResult": "api",
    "LoadResult": "api",
    "StoreResult": "api",
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else [*parts[:-1], "__init__"]
    return ".".join(parts)


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` names (relative ones resolved in ``package``)."""
    base = node.module or ""
    if node.level:
        up = package.split(".")
        up = up[: len(up) - node.level + 1]
        base = ".".join([*up, base] if base else up)
    return base


def imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported raykv module or third-party top name) of every import in ``path``;
    ``raykv.<attr>`` uses after a bare ``import raykv`` count as imports of ``<attr>``."""
    tree = ast.parse(path.read_text())
    module = _module_of(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    bare = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                found.append((node.lineno, a.name))
                bare |= a.name == "raykv" and a.asname is None
        elif isinstance(node, ast.ImportFrom):
            base = _from_module(node, package)
            for a in node.names:
                found.append((node.lineno, f"{base}.{a.name}" if base == "raykv" else base))
    if bare:
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "raykv"
            ):
                attr = TOP_ATTRS.get(node.attr, node.attr)
                found.append((node.lineno, f"raykv.{attr}"))
    return found


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        src = _layer(_module_of(path, root))
        allowed = MAY_IMPORT.get(src)
        assert allowed is not None, f"{path} is in no layer of MAY_IMPORT: add it (docs/design.md)"
        for line, name in imports(path, root):
            where = f"{path.relative_to(root.parent)}:{line}"
            if name == "raykv" or name.startswith("raykv."):
                if name == "raykv":
                    continue  # the bare import itself; its attribute uses are checked
                dst = _layer(name)
                if dst == "_kernels":
                    dst = "ops"
                if dst != src and dst not in allowed:
                    bad.append(f"{where}: {src} imports {name} (a layer above it)")
            else:
                top = name.split(".")[0]
                ok = THIRD_PARTY.get(src)
                if ok is not None and top not in sys.stdlib_module_names and top not in ok:
                    bad.append(f"{where}: {src} imports {top} (only stdlib, {sorted(ok)})")
    return bad


def test_raykv_imports_downward_only() -> None:
    assert violations() == []


def test_the_walk_sees_an_upward_import(tmp_path: Path) -> None:
    pkg = tmp_path / "raykv"
    (pkg / "service").mkdir(parents=True)
    (pkg / "layout").mkdir()
    (pkg / "service" / "x.py").write_text(
        "def f():\n    from raykv.client import connect\n    import raykv\n    raykv.connect()\n"
    )
    (pkg / "layout" / "y.py").write_text("from ..blocks import pool\nimport ray\n")
    got = violations(pkg)
    assert got == [
        "raykv/layout/y.py:1: layout imports raykv.blocks (a layer above it)",
        "raykv/layout/y.py:2: layout imports ray (only stdlib, ['numpy', 'torch'])",
        "raykv/service/x.py:2: service imports raykv.client (a layer above it)",
        "raykv/service/x.py:4: service imports raykv.client (a layer above it)",
    ]


# -- no import circles ----------------------------------------------------------------------


def _modules(root: Path) -> dict[str, Path]:
    return {_module_of(p, root): p for p in sorted(root.rglob("*.py"))}


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The raykv module ``name`` loads: itself, or the nearest package above it."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """module -> {raykv module it imports: first line}, from every ``import`` and
    ``from ... import`` in ``root`` (module level, inside functions, under ``TYPE_CHECKING``),
    relative ones resolved; ``from pkg import name`` is an import of ``pkg.name`` when that is
    a module, else of ``pkg``; ``raykv.<module>`` after a bare ``import raykv`` is one of it."""
    known = _modules(root)
    top = root.name
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text())
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        if module == f"{top}.__init__":
            package = top

        def add(name: str, line: int, module: str = module, edges: dict = edges) -> None:
            dst = _target(name, known)
            if dst is not None and dst != module:
                edges.setdefault(dst, line)

        bare = False
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == top or a.name.startswith(f"{top}."):
                        add(a.name if a.name != top else f"{top}.__init__", node.lineno)
                        bare |= a.name == top and a.asname is None
            elif isinstance(node, ast.ImportFrom):
                base = _from_module(node, package)
                if base != top and not base.startswith(f"{top}."):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in known:
                        add(sub, node.lineno)
                    else:
                        add(base if base != top else f"{top}.__init__", node.lineno)
        if bare:
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and ast.unparse(node).startswith(f"{top}."):
                    add(ast.unparse(node), node.lineno)  # the module it names, if any
        graph[module] = edges
    return graph


def cycles(root: Path = ROOT) -> list[str]:
    """Every strongly connected set of modules that import each other (Tarjan), each as one
    circle through it, ``a (line of its import of b) -> b (...) -> a``, and the set's other
    modules, if any, after ``; also``."""
    graph = import_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    circles = []
    for comp in found:
        start = min(comp)
        # the shortest way back to ``start`` within the component (breadth first)
        prev: dict[str, str] = {}
        todo = [start]
        while todo and start not in prev:
            nxt = []
            for v in todo:
                for w in sorted(graph[v]):
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            todo = nxt
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(prev[path[-1]])
        path.reverse()
        circle = " -> ".join([f"{a} ({graph[a][b]})" for a, b in pairwise(path)] + [start])
        rest = sorted(comp - set(path))
        circles.append(circle + (f"; also {', '.join(rest)}" if rest else ""))
    return sorted(circles)


def test_no_import_circles() -> None:
    assert cycles() == [], "\n".join(cycles())


def test_the_walk_sees_a_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "raykv"
    (pkg / "bench").mkdir(parents=True)
    (pkg / "layout").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "layout" / "__init__.py").write_text("from raykv.layout.plan import Plan\n")
    (pkg / "layout" / "plan.py").write_text("from raykv.layout import specs\n")
    (pkg / "layout" / "specs.py").write_text("from . import plan\n")
    (pkg / "bench" / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "bench" / "b.py").write_text("import raykv\n\nraykv.bench.a.f()\n")
    (pkg / "bench" / "c.py").write_text("from raykv.layout import Plan\nfrom . import d\n")
    (pkg / "bench" / "d.py").write_text("from raykv.bench.c import x\n")
    (pkg / "bench" / "e.py").write_text("from raykv.bench import c\n")  # into, not a circle
    (pkg / "bench" / "f.py").write_text("from . import g\n")
    (pkg / "bench" / "g.py").write_text("from . import f, h\n")
    (pkg / "bench" / "h.py").write_text("from .f import x\n")
    assert cycles(pkg) == [
        "raykv.bench.a (2) -> raykv.bench.b (3) -> raykv.bench.a",
        "raykv.bench.c (2) -> raykv.bench.d (1) -> raykv.bench.c",
        "raykv.bench.f (1) -> raykv.bench.g (1) -> raykv.bench.f; also raykv.bench.h",
        "raykv.layout.plan (1) -> raykv.layout.specs (1) -> raykv.layout.plan",
    ]

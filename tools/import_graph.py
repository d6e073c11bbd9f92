#!/usr/bin/env python3
"""Print the intra-project import edges of ``gguf_s3d8/``, ``convert/`` and ``qat/``, the edges that go up a
layer, and every import cycle among them.

The packages are layered, lowest first: ``gguf_s3d8`` < ``convert`` < ``qat`` (:data:`LAYERS`). A module may
import its own package and the packages below it, never one above (``convert`` imports nothing of ``qat``,
``gguf_s3d8`` nothing of either), and nothing of ``tests``.

Every ``import`` statement counts, also the ones inside functions (a lazy import still couples two modules;
it only hides the cycle from the interpreter). An edge ``a -> b`` means module ``a`` imports module ``b``
(``from b import x`` names ``b``, or ``b.x`` where ``x`` is a submodule). Only targets in the three packages and
``tests`` are listed (numpy/torch/gguf are outside).

    python tools/import_graph.py            # edges, edge counts between packages, upward edges ("upward: none"),
                                            # then "cycles: none" or each strongly connected component of modules
    python tools/import_graph.py --check    # exit 1 when an edge goes up a layer or there is a cycle (each printed)
    python tools/import_graph.py --reach convert.qat_checkpoint   # every module that one imports, transitively
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the packages, lowest layer first: each may import only itself and those before it
LAYERS = ("gguf_s3d8", "convert", "qat")
SCANNED = LAYERS
LISTED = (*LAYERS, "tests")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module that ``from ... import`` names (relative imports resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges() -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            module = module_name(path)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = resolve(node, module, path.name == "__init__.py")
                    # ``from pkg import submodule`` names the submodule
                    targets = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
                else:
                    continue
                for target in targets:
                    if target.split(".")[0] in LISTED and target != module:
                        found.add((module, target))
    return found


def upward(graph: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """The edges that break the layering: into a package of a higher layer than the importer's, or into ``tests``."""
    rank = {p: i for i, p in enumerate(LAYERS)}
    bad = []
    for a, b in sorted(graph):
        pa, pb = a.split(".")[0], b.split(".")[0]
        if pb not in rank or rank[pb] > rank[pa]:
            bad.append((a, b))
    return bad


def reachable(graph: set[tuple[str, str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    succ: dict[str, set[str]] = {}
    for a, b in graph:
        succ.setdefault(a, set()).add(b)
    seen: set[str] = set()
    todo = [start]
    while todo:
        for b in succ.get(todo.pop(), ()):
            if b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def cycles(graph: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    succ: dict[str, list[str]] = {}
    for a, b in sorted(graph):
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(succ):
        if v not in index:
            visit(v)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only exit 1 if an edge goes up a layer or there is a cycle")
    ap.add_argument("--reach", metavar="MODULE", help="list the modules MODULE imports, transitively")
    args = ap.parse_args(argv)
    graph = edges()
    if args.reach:
        reached = sorted(reachable(graph, args.reach))
        print(f"{args.reach} imports {len(reached)} modules of {'/'.join(LISTED)}: {' '.join(reached)}")
        return 0
    found = cycles(graph)
    up = upward(graph)
    if args.check:
        for a, b in up:
            print(f"upward import: {a} -> {b} (layers, lowest first: {' < '.join(LAYERS)})", file=sys.stderr)
        for component in found:
            print("import cycle: " + " <-> ".join(component), file=sys.stderr)
        return 1 if found or up else 0
    for a, b in sorted(graph):
        print(f"{a} -> {b}")
    between: dict[tuple[str, str], int] = {}
    for a, b in graph:
        pa, pb = a.split(".")[0], b.split(".")[0]
        if pa != pb:
            between[pa, pb] = between.get((pa, pb), 0) + 1
    for (pa, pb), n in sorted(between.items()):
        print(f"package {pa} -> {pb}: {n} edges")
    print("upward: " + ("none" if not up else ""))
    for a, b in up:
        print(f"  {a} -> {b}")
    print("cycles: " + ("none" if not found else ""))
    for component in found:
        print("  " + " <-> ".join(component))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Print the intra-project import edges of ``qat/`` and ``convert/`` and every import cycle among them.

Every ``import`` statement counts, also the ones inside functions (a lazy import still couples two modules;
it only hides the cycle from the interpreter). An edge ``a -> b`` means module ``a`` imports module ``b``
(``from b import x`` names ``b``, or ``b.x`` where ``x`` is a submodule). Only targets in ``qat``, ``convert``
and ``tests`` are listed (``gguf_s3d8`` sits below both, numpy/torch/gguf outside).

    python tools/import_graph.py            # edges, edge counts between packages, then "cycles: none" or
                                            # each strongly connected component of modules
    python tools/import_graph.py --check    # exit 1 when there is a cycle (no output otherwise)
    python tools/import_graph.py --reach convert.qat_checkpoint   # every module that one imports, transitively
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("qat", "convert")
LISTED = ("qat", "convert", "tests")


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
    ap.add_argument("--check", action="store_true", help="only exit 1 if the graph has a cycle")
    ap.add_argument("--reach", metavar="MODULE", help="list the modules MODULE imports, transitively")
    args = ap.parse_args(argv)
    graph = edges()
    if args.reach:
        reached = sorted(reachable(graph, args.reach))
        print(f"{args.reach} imports {len(reached)} modules of qat/convert/tests: {' '.join(reached)}")
        return 0
    found = cycles(graph)
    if args.check:
        for component in found:
            print("import cycle: " + " <-> ".join(component), file=sys.stderr)
        return 1 if found else 0
    for a, b in sorted(graph):
        print(f"{a} -> {b}")
    between: dict[tuple[str, str], int] = {}
    for a, b in graph:
        pa, pb = a.split(".")[0], b.split(".")[0]
        if pa != pb:
            between[pa, pb] = between.get((pa, pb), 0) + 1
    for (pa, pb), n in sorted(between.items()):
        print(f"package {pa} -> {pb}: {n} edges")
    print("cycles: " + ("none" if not found else ""))
    for component in found:
        print("  " + " <-> ".join(component))
    return 0


if __name__ == "__main__":
    sys.exit(main())

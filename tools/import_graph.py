#!/usr/bin/env python3
"""Print the intra-project import edges of every Python folder, the edges that go up a layer, and every import
cycle among them.

The folders are layered, lowest first (:data:`ORDER`): the product packages ``gguf_s3d8`` < ``convert`` < ``qat``
(:data:`LAYERS`), then ``fixtures`` (test data builders that benchmarks and tests share), ``ci``, ``tools``,
``benchmarks``, ``research`` (one-off probes) and ``tests`` (:data:`ABOVE`). A module may import its own folder and
the folders below it, never one above: the product imports nothing of research, tests or the scripts' folders,
``convert`` nothing of ``qat``, ``gguf_s3d8`` nothing of either, and nothing imports ``tests`` but ``tests``.

Every ``import`` statement counts, also the ones inside functions (a lazy import still couples two modules;
it only hides the cycle from the interpreter). An edge ``a -> b`` means module ``a`` imports module ``b``
(``from b import x`` names ``b``, or ``b.x`` where ``x`` is a submodule). Scripts' folders (``ci``, ``tools``,
``benchmarks``, ``research``, ``tests/python``) are not packages: a bare ``import bench_common`` there names the
module of that file's folder, of its top folder, or of the folders scripts put on ``sys.path`` (:data:`SCRIPT_DIRS`),
e.g. ``benchmarks.bench_common``. Only targets in the project's folders are listed (numpy/torch/gguf are outside).

    python tools/import_graph.py            # edges, edge counts between folders, upward edges ("upward: none"),
                                            # then "cycles: none" or each strongly connected component of modules
    python tools/import_graph.py --check    # exit 1 when an edge goes up a layer or there is a cycle (each printed)
    python tools/import_graph.py --reach convert.qat_checkpoint   # every module that one imports, transitively
    python tools/import_graph.py --root DIR --check               # another tree with the same folders (the tests)
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the product packages, lowest layer first: each may import only itself and those before it
LAYERS = ("gguf_s3d8", "convert", "qat")
#: the other Python folders, above the product, lowest first
ABOVE = ("fixtures", "ci", "tools", "benchmarks", "research", "tests")
ORDER = (*LAYERS, *ABOVE)
SCANNED = ORDER
LISTED = ORDER
#: folders whose modules are imported by bare name (scripts put them on sys.path), searched after the importer's
#: own folder and its top folder
SCRIPT_DIRS = ("ci", "benchmarks", "tools", "tests/python")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str, root: Path = ROOT) -> bool:
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def script_target(name: str, path: Path, root: Path) -> str | None:
    """The project module a bare import ``name`` in the script ``path`` names (see the module's docstring), or
    None (a third-party or standard module)."""
    folders = [path.parent, root / path.relative_to(root).parts[0], *(root / d for d in SCRIPT_DIRS)]
    first = name.split(".")[0]
    for folder in folders:
        if (folder / f"{first}.py").is_file() or (folder / first / "__init__.py").is_file():
            return ".".join([*folder.relative_to(root).parts, name])
    return None


def resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module that ``from ... import`` names (relative imports resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


#: not scanned: data and build trees inside the folders
SKIPPED = ("tests/data",)


def edges(root: Path = ROOT) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if any(rel.startswith(s + "/") for s in SKIPPED):
                continue
            module = module_name(path, root)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = resolve(node, module, path.name == "__init__.py")
                    # ``from pkg import submodule`` names the submodule
                    targets = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}", root) else base
                               for a in node.names]
                else:
                    continue
                for target in targets:
                    if target.split(".")[0] not in LISTED and (isinstance(node, ast.Import) or node.level == 0):
                        target = script_target(target, path, root) or target
                    if target.split(".")[0] in LISTED and target != module:
                        found.add((module, target))
    return found


def upward(graph: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """The edges that break the layering: into a folder of a higher layer than the importer's (:data:`ORDER`:
    the product packages, then the folders above them, ``tests`` last)."""
    rank = {p: i for i, p in enumerate(ORDER)}
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
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to read (default: this repository)")
    args = ap.parse_args(argv)
    graph = edges(args.root.resolve())
    if args.reach:
        reached = sorted(reachable(graph, args.reach))
        print(f"{args.reach} imports {len(reached)} project modules: {' '.join(reached)}")
        return 0
    found = cycles(graph)
    up = upward(graph)
    if args.check:
        for a, b in up:
            print(f"upward import: {a} -> {b} (layers, lowest first: {' < '.join(ORDER)})", file=sys.stderr)
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

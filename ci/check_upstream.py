#!/usr/bin/env python3
"""Check the patch series against upstream llama.cpp: type-id collisions, drift, build and tests.

    python3 ci/check_upstream.py                          # the pin and every newer tree of ci/upstream.py: ids + clean apply
    python3 ci/check_upstream.py --against ~/src/llama.cpp  # also an existing checkout (its HEAD)
    python3 ci/check_upstream.py --against-ref master     # also a ref fetched from upstream (needs network)
    python3 ci/check_upstream.py --against ... --build    # and build + CTest the patched other tree

For each tree it reports, patch by patch, whether the series applies cleanly, applies only with reduced
context ("drift": upstream moved the surrounding code; `git am` refuses it, but the fix is a rebase), or
fails; and which files the series touches that changed between the pinned commit and the other tree.

It fails (exit 1) when any ggml type id added by the series equals a value of that upstream tree's
``ggml_type`` enum — including ids of removed types that upstream left commented out, since old files may
still carry them — or when a patch does not apply cleanly (drift included), or when --build's build or tests fail.
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import patches  # noqa: E402
import upstream  # noqa: E402

GGML_H = "ggml/include/ggml.h"
# `GGML_TYPE_NAME = 12,` possibly commented out (`// GGML_TYPE_Q4_2 = 4, support has been removed`)
_ENUM_ENTRY = re.compile(r"^\s*(?://\s*)?(GGML_TYPE_[A-Z0-9_]+)\s*=\s*(\d+)\s*,")


def enum_values(ggml_h: str) -> dict[int, str]:
    """Values of ``enum ggml_type`` in a ggml.h text (commented-out removed types included), COUNT excluded."""
    start = ggml_h.index("enum ggml_type {")
    body = ggml_h[start:ggml_h.index("};", start)]
    out: dict[int, str] = {}
    for line in body.splitlines():
        m = _ENUM_ENTRY.match(line)
        if m and m.group(1) != "GGML_TYPE_COUNT":
            out[int(m.group(2))] = m.group(1)
    return out


def series_type_ids(patch_dir: Path = patches.PATCH_DIR) -> dict[str, int]:
    """ggml type ids the series adds to ggml.h: lines ``+ GGML_TYPE_X = N,`` of patches touching it."""
    ids: dict[str, int] = {}
    for p in patches.series(patch_dir):
        current = None
        for line in p.read_text(errors="replace").splitlines():
            if line.startswith("+++ "):
                current = line[6:] if line.startswith("+++ b/") else None
            elif current == GGML_H and line.startswith("+") and not line.startswith("+++"):
                m = _ENUM_ENTRY.match(line[1:])
                if m and m.group(1) != "GGML_TYPE_COUNT" and not line[1:].lstrip().startswith("//"):
                    ids[m.group(1)] = int(m.group(2))
    return ids


#: type ids the series shares with a neighbour tree on purpose, each with the reason (docs/upstreaming.md); any other
#: shared id fails the check
DELIBERATE_COLLISIONS: dict[tuple[str, int], str] = {
    (n, v): "ik_llama.cpp's GGML_TYPE_Q8_*_X4 are the row-interleaved activations of its matrix multiplications, "
            "made in memory and never written to a file; ours are KV-cache types (Q4_HQQ, Q4_HQQ_128, TQ3_0)"
    for n, v in (("ik_llama.cpp", 97), ("ik_llama.cpp", 98), ("ik_llama.cpp", 99))
}


def neighbour_collisions(patch_dir: Path = patches.PATCH_DIR) -> tuple[list[str], list[str]]:
    """(undocumented, deliberate) collisions of the series' type ids with every neighbour tree's enum."""
    bad: list[str] = []
    known: list[str] = []
    for name in upstream.NEIGHBOURS:
        values = enum_values(upstream.neighbour_file(name, GGML_H))
        for ours, value in sorted(series_type_ids(patch_dir).items()):
            if value in values:
                line = f"{ours} = {value} is {name}'s {values[value]}"
                reason = DELIBERATE_COLLISIONS.get((name, value))
                (known if reason else bad).append(line + (f" (deliberate: {reason})" if reason else ""))
    return bad, known


def touched_files(patch_dir: Path = patches.PATCH_DIR) -> list[str]:
    files: set[str] = set()
    for p in patches.series(patch_dir):
        for line in p.read_text(errors="replace").splitlines():
            if line.startswith("diff --git a/"):
                files.add(line.split(" b/", 1)[1])
    return sorted(files)


@dataclass
class Report:
    commit: str
    collisions: list[str] = field(default_factory=list)
    patch_status: list[tuple[str, str, str]] = field(default_factory=list)  # (patch, status, detail)
    drifted_files: list[str] = field(default_factory=list)
    build_ok: bool | None = None

    @property
    def ok(self) -> bool:
        # drift fails too: `ci/patches.py apply` (git am) accepts only clean patches
        return (not self.collisions and all(s == "clean" for _, s, _ in self.patch_status)
                and self.build_ok is not False)


def check_ids(tree: Path, patch_dir: Path) -> list[str]:
    values = enum_values((tree / GGML_H).read_text())
    return [f"{name} = {value} collides with upstream's {values[value]}"
            for name, value in sorted(series_type_ids(patch_dir).items()) if value in values]


def _git(tree: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return patches.git(tree, *args, check=check)


def apply_each(tree: Path, patch_dir: Path) -> list[tuple[str, str, str]]:
    """Apply the series patch by patch, continuing past failures, and classify each one."""
    out = []
    for p in patches.series(patch_dir):
        name = patches.name(p, patch_dir)
        clean = _git(tree, "apply", "--check", str(p), check=False)
        if clean.returncode == 0:
            _git(tree, "am", "--keep-cr", str(p))
            out.append((name, "clean", ""))
            continue
        fuzzy = _git(tree, "apply", "--check", "-C1", str(p), check=False)
        if fuzzy.returncode == 0:
            _git(tree, "apply", "-C1", "--index", str(p))
            _git(tree, "commit", "-q", "--no-verify", "-m", f"(fuzzy) {name}")
            out.append((name, "drift", "applies only with reduced context"))
        else:
            out.append((name, "FAILS", clean.stderr.strip().splitlines()[0] if clean.stderr.strip() else ""))
    return out


def changed_between(a: Path, b: Path, files: list[str]) -> list[str]:
    def read(root: Path, f: str) -> bytes | None:
        return (root / f).read_bytes() if (root / f).exists() else None
    return [f for f in files if read(a, f) != read(b, f)]


def build_and_test(tree: Path, build_dir: Path) -> bool:
    cmake_args = ["cmake", "--preset", "host", "-B", str(build_dir), f"-DLLAMA_CPP_DIR={tree}"]
    steps = [cmake_args, ["cmake", "--build", str(build_dir), "--target", "s3d8-tools", "s3d8-tests"],
             ["ctest", "--test-dir", str(build_dir), "-L", "s3d8", "--output-on-failure"]]
    for cmd in steps:
        if subprocess.run(cmd, cwd=upstream.REPO_ROOT).returncode != 0:
            print(f"check-upstream: `{' '.join(cmd)}` failed", file=sys.stderr)
            return False
    return True


def run_checks(refs: list[str], patch_dir: Path, pinned_tree: Path, build: bool,
               keep: Path | None) -> list[Report]:
    """Check the series against each upstream tree (a ``ci/upstream.py`` tree name or a cached commit)."""
    return [check_tree(r, patch_dir, pinned_tree, build and r != upstream.PIN, keep) for r in refs]


def check_tree(commit: str, patch_dir: Path, pinned_tree: Path, build: bool, keep: Path | None) -> Report:
    report = Report(commit)
    with tempfile.TemporaryDirectory(dir=upstream.cache_root()) as tmp:
        tree = (keep or Path(tmp)) / f"llama.cpp-{commit[:12]}"
        if tree.exists():
            shutil.rmtree(tree)
        # the base tree, then each patch on its own so that one failure does not hide the rest
        patches.make_base(tree, commit)
        report.collisions = check_ids(tree, patch_dir)
        report.drifted_files = changed_between(pinned_tree, tree, touched_files(patch_dir))
        report.patch_status = apply_each(tree, patch_dir)
        if build and report.ok:
            report.build_ok = build_and_test(tree, upstream.REPO_ROOT / "build" / f"check-{commit[:12]}")
    return report


def print_report(r: Report) -> None:
    print(f"== llama.cpp {r.commit}")
    print(f"   type ids: {'no collision' if not r.collisions else 'COLLISION'}")
    for c in r.collisions:
        print(f"     {c}")
    for name, status, detail in r.patch_status:
        print(f"   {status:>5}  {name}{'  (' + detail + ')' if detail else ''}")
    if r.drifted_files:
        print("   files the series touches that differ from the pinned commit:")
        for f in r.drifted_files:
            print(f"     {f}")
    if r.build_ok is not None:
        print(f"   build + tests: {'ok' if r.build_ok else 'FAILED'}")
    print(f"   => {'OK' if r.ok else 'FAILED'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--patches", type=Path, default=patches.PATCH_DIR)
    ap.add_argument("--against", type=Path, help="another llama.cpp git checkout (its HEAD is checked)")
    ap.add_argument("--against-ref", help="a commit, branch or tag fetched from --url (needs network)")
    ap.add_argument("--url", default=upstream.UPSTREAM_GIT_URL)
    ap.add_argument("--build", action="store_true", help="also build and run the C tests on the other tree")
    ap.add_argument("--keep", type=Path, help="keep the patched trees in this folder")
    ap.add_argument("--junitxml", type=Path, help="also write one JUnit test case per tree checked")
    args = ap.parse_args(argv)
    try:
        pinned_tree = upstream.fetch()
        commits = [upstream.PIN] + [t for t in upstream.CHECKED if t != upstream.PIN]
        for name in commits[1:]:
            upstream.fetch(name)
        if args.against:
            commits.append(upstream.resolve_checkout(args.against.resolve()))
        if args.against_ref:
            commits.append(upstream.resolve_git(args.against_ref, args.url))
        reports = run_checks(commits, args.patches, pinned_tree, args.build, args.keep)
    except (patches.PatchError, upstream.UpstreamError, subprocess.CalledProcessError) as e:
        print(f"check-upstream: error: {e}", file=sys.stderr)
        return 1
    ids = series_type_ids(args.patches)
    print("type ids added by the series: " + (", ".join(f"{k}={v}" for k, v in ids.items()) or "none"))
    for r in reports:
        print_report(r)
    try:
        bad, known = neighbour_collisions(args.patches)
    except (upstream.UpstreamError, subprocess.CalledProcessError) as e:
        print(f"check-upstream: error: {e}", file=sys.stderr)
        return 1
    for line in known:
        print(f"== neighbour: {line}")
    for line in bad:
        print(f"== neighbour: COLLISION {line}")
    # one more case: the neighbours' type ids (passes with only documented collisions)
    reports.append(Report("neighbours (" + ", ".join(upstream.NEIGHBOURS) + ")", collisions=bad))
    if args.junitxml is not None:
        write_junit(reports, args.junitxml)
    return 0 if all(r.ok for r in reports) else 1


def write_junit(reports: list[Report], path: Path) -> None:
    """One test case per upstream tree: passed when the series applies cleanly and no type id collides."""
    suite = ET.Element("testsuite", name="check-upstream", tests=str(len(reports)),
                       failures=str(sum(not r.ok for r in reports)))
    for r in reports:
        name = r.commit if r.commit.startswith("neighbours") else f"llama.cpp {r.commit}"
        case = ET.SubElement(suite, "testcase", classname="check-upstream", name=name)
        if not r.ok:
            lines = r.collisions + [f"{status} {name} {detail}".strip() for name, status, detail in r.patch_status
                                    if status != "clean"] + (["build + tests failed"] if r.build_ok is False else [])
            ET.SubElement(case, "failure", message="; ".join(lines)[:2000])
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The lint and type-check step of ``ci/test.sh``: ``ruff check`` and ``mypy`` over the whole Python tree, and the
import-layer check (``tools/import_graph.py --check``: no upward edge, no cycle; ``docs/python-layers.md``) and the
markdown links (``tools/check_links.py``: every relative link in README.md and docs/*.md resolves).

Both are configured in ``pyproject.toml`` (``[tool.ruff]``, ``[tool.mypy]``: which rules, which files) and
installed by ``ci/setup.sh`` (the ``dev`` extra). Each is one test case of a JUnit file (``--junitxml``), so that
``ci/summarize.py`` counts them like the other suites; a tool that finds anything, or cannot run, fails its case
with the tool's output as the message.

    python ci/lint.py                                  # all four, output on the terminal; exit 1 on any finding
    python ci/lint.py --junitxml build/test-results/lint.xml
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CHECKS = {
    "ruff": [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise"],
    "mypy": [sys.executable, "-m", "mypy"],
    "imports": [sys.executable, str(REPO_ROOT / "tools" / "import_graph.py"), "--check"],
    "links": [sys.executable, str(REPO_ROOT / "tools" / "check_links.py")],
}


def run(name: str, cmd: list[str]) -> tuple[bool, str, float]:
    """(passed, output, seconds) of one check, run in the repository root."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        return False, f"{name} could not be started: {e}", time.monotonic() - t0
    return p.returncode == 0, p.stdout, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--junitxml", type=Path, help="write the results as a JUnit XML file")
    args = ap.parse_args(argv)
    suite = ET.Element("testsuite", name="lint")
    failed = 0
    for name, cmd in CHECKS.items():
        ok, out, seconds = run(name, cmd)
        print(f"[lint] {name}: {'clean' if ok else 'FAILED'} ({seconds:.1f} s)", file=sys.stderr)
        if not ok:
            failed += 1
            sys.stderr.write(out)
        case = ET.SubElement(suite, "testcase", classname="lint", name=name, time=f"{seconds:.3f}")
        if not ok:
            ET.SubElement(case, "failure", message=f"{name} reported problems").text = out
    suite.set("tests", str(len(CHECKS)))
    suite.set("failures", str(failed))
    if args.junitxml is not None:
        args.junitxml.parent.mkdir(parents=True, exist_ok=True)
        ET.ElementTree(suite).write(args.junitxml, encoding="utf-8", xml_declaration=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Sum the JUnit XML files of one test run and print the closing line ``N passed, M failed``.

Skipped tests are listed and counted as failures: in this project a check that did not run is a check
that did not pass. A build that failed (``build-*.failed``) or a suite that wrote no results counts as
one failure each, so a broken build can never look like a green run.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def count(xml: Path) -> tuple[int, int, list[str]]:
    """(passed, failed, names of failed/skipped cases) of one JUnit file."""
    passed, failed, bad = 0, 0, []
    root = ET.parse(xml).getroot()
    for case in root.iter("testcase"):
        name = f"{xml.stem}: {case.get('classname', '')}::{case.get('name', '')}"
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            failed += 1
            bad.append(f"FAILED  {name}")
        elif "skipped" in outcome:
            failed += 1
            bad.append(f"SKIPPED {name} (counted as failed)")
        else:
            passed += 1
    return passed, failed, bad


def main(results: Path) -> int:
    passed = failed = 0
    problems: list[str] = []
    for marker in sorted(results.glob("*.failed")):
        failed += 1
        problems.append(f"FAILED  {marker.read_text().strip()}")
    for note in sorted(results.glob("skipped-*.txt")):
        failed += 1
        problems.append(f"SKIPPED {note.read_text().strip()} (counted as failed)")
    xmls = sorted(results.glob("*.xml"))
    if not xmls:
        failed += 1
        problems.append("no test results were written")
    for xml in xmls:
        try:
            p, f, bad = count(xml)
        except ET.ParseError as e:
            p, f, bad = 0, 1, [f"FAILED  {xml.name}: unreadable results ({e})"]
        print(f"{xml.stem:>24}: {p} passed, {f} failed")
        passed, failed = passed + p, failed + f
        problems += bad
    for line in problems:
        print(line)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "build/test-results")))

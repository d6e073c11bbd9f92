#!/usr/bin/env python3
"""Sum the JUnit XML files of one test run and print the closing line ``N passed, M failed``.

Skipped tests are listed and counted as failures: in this project a check that did not run is a check
that did not pass - a pytest skip, an xfail, a CTest "Not Run" or "Disabled" test alike. A build that failed (``build-*.failed``) or a suite that wrote no results counts as
one failure each, so a broken build can never look like a green run.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def count(xml: Path, times: list[tuple[float, str]] | None = None) -> tuple[int, int, list[str]]:
    """(passed, failed, names of failed/skipped cases) of one JUnit file; appends each case's (seconds, name) to
    ``times`` when given."""
    passed, failed, bad = 0, 0, []
    root = ET.parse(xml).getroot()
    for case in root.iter("testcase"):
        name = f"{xml.stem}: {case.get('classname', '')}::{case.get('name', '')}"
        if times is not None:
            times.append((float(case.get("time") or 0.0), name))
        outcome = {child.tag for child in case}
        # CTest marks a case that did not run with status="notrun" or "disabled" (and usually a <skipped> child)
        status = (case.get("status") or "").lower()
        if outcome & {"failure", "error"} or status in ("fail", "failed"):
            failed += 1
            bad.append(f"FAILED  {name}")
        elif "skipped" in outcome or status in ("notrun", "disabled"):
            failed += 1
            bad.append(f"SKIPPED {name} (counted as failed)")
        else:
            passed += 1
    return passed, failed, bad


def print_timings(results: Path, times: list[tuple[float, str]], n: int = 15) -> None:
    """Wall time of each step of ci/test.sh (timings.tsv) and the ``n`` slowest test cases."""
    steps = results / "timings.tsv"
    if steps.exists():
        rows = [line.split("\t") for line in steps.read_text().splitlines() if "\t" in line]
        total = sum(int(sec) for _, sec in rows)
        print(f"time per step (total {total} s):")
        for name, sec in rows:
            print(f"{name:>24}: {int(sec):6d} s")
    cases = sorted(times, reverse=True)[:n]
    if cases:
        print("slowest test cases:")
        for seconds, case_name in cases:
            print(f"{seconds:8.1f} s  {case_name}")


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
    times: list[tuple[float, str]] = []
    for xml in xmls:
        try:
            p, f, bad = count(xml, times)
        except ET.ParseError as e:
            p, f, bad = 0, 1, [f"FAILED  {xml.name}: unreadable results ({e})"]
        print(f"{xml.stem:>24}: {p} passed, {f} failed")
        passed, failed = passed + p, failed + f
        problems += bad
    print_timings(results, times)
    for line in problems:
        print(line)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "build/test-results")))

#!/usr/bin/env python3
"""Merge the rejection messages of fuzz runs (their ``messages.txt``) into distinct kinds, as listed in
docs/reliability.md ("Fuzzing the loaders"): numbers are already '#' (tests/fuzz/fuzz-common.h); here quoted
names ('blk.0.attn_q.weight', a mutated key) become '…', a sign before '#' and runs of blanks go, byte lists become '(bytes)', and the
memfd path becomes FILE.

    python -m tests.fuzz.messages build/fuzz-long/mllama-text/messages.txt build/fuzz/fuzz-work/mllama-text/messages.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def kind(line: str) -> str:
    line = line.replace("/proc/self/fd/#", "FILE")
    line = re.sub(r"'[^']*'", "'…'", line)
    line = re.sub(r"-#", "#", line)
    # byte lists such as "reserved flags are not zero (c3 de ff)"
    line = re.sub(r"\((?:[0-9a-f]{2}|#)(?: (?:[0-9a-f]{2}|#))*\)", "(bytes)", line)
    line = re.sub(r"\s+", " ", line).strip()
    return line


def main(paths: list[str]) -> int:
    kinds: set[str] = set()
    for p in paths:
        path = Path(p)
        if path.is_file():
            kinds.update(kind(line) for line in path.read_text(errors="replace").splitlines() if line.strip())
    for k in sorted(kinds):
        print(k)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

#!/usr/bin/env python3
"""Merge the rejection messages of fuzz runs (their ``messages.txt``) into distinct kinds, as listed in
docs/reliability.md ("Fuzzing the loaders"): numbers are already '#' (tests/fuzz/fuzz-common.h); here quoted
names ('blk.0.attn_q.weight', a mutated key) become '…', other bytes than printable ASCII '?', a sign before '#' and runs of blanks go, byte lists become '(bytes)', and the
memfd path becomes FILE.

    python -m tests.fuzz.messages build/fuzz-long/mllama-text/messages.txt build/fuzz/fuzz-work/mllama-text/messages.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path


def kind(line: str) -> str:
    line = line.replace("/proc/self/fd/#", "FILE")
    line = re.sub(r"[^\x20-\x7e]", "?", line)  # mutated names hold any byte
    if "invalid magic characters" in line:
        return re.sub(r"invalid magic characters: .*", "invalid magic characters: …, expected 'GGUF'", line)
    # a mutated name may itself contain quotes: from its opening quote to the words after it
    line = re.sub(r"'.*' (has |of type|data is|dimension|with shape|may cause|for KV|for tensor|is not|not found|is missing)",
                  r"'…' \1", line)
    line = re.sub(r"'[^']*'", "'…'", line)
    # a name cut by a control byte in it (the rest of the message is lost in the log line)
    line = re.sub(r"(key|tensor|name) '[^']*$", r"\1 '…' (name with control bytes)", line)
    line = re.sub(r"-#", "#", line)
    # byte lists such as "reserved flags are not zero (c3 de ff)"
    line = re.sub(r"\((?:[0-9a-f]{2}|#)(?: (?:[0-9a-f]{2}|#))+\)", "(bytes)", line)
    line = re.sub(r"\s+", " ", line).strip()
    # a name with a quote in it: what follows its folded part is the rest of the name, not of the message
    line = re.sub(r"'…'[^ ,.:;)].*$", "'…' (name with control bytes)", line)
    return line


# a message starts with the reporting function ("gguf_init_from_reader: ...") or is one of the S3D8 validator's;
# anything else is the tail of a message whose name held a line break
MESSAGE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*: |S3D8 |slice #: |bad S3D8|invalid S3D8|unsupported S3D8)")


def main(paths: list[str]) -> int:
    kinds: set[str] = set()
    for p in paths:
        path = Path(p)
        if path.is_file():
            kinds.update(k for k in (kind(line) for line in path.read_text(errors="replace").split("\n")) if MESSAGE.match(k))
    for k in sorted(kinds):
        print(k)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

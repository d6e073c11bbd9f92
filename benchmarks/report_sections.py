"""Named sections of a Markdown report that several benchmark scripts write into one file.

A section is the text between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``; writing it replaces only that
text (or appends the section when the file does not have it yet), so `bench_kernels.py` and `bench_e2e.py` each
regenerate their own part of ``docs/benchmarks.md`` and leave the other's alone. The file is replaced atomically.
"""

from __future__ import annotations

import re
from pathlib import Path

from gguf_s3d8.fsio import atomic_write


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- begin {name} -->", f"<!-- end {name} -->"


def write_section(doc: Path, name: str, text: str, *, title: str | None = None) -> None:
    """Replace (or append) section ``name`` of ``doc`` with ``text``; ``title`` heads a new file."""
    begin, end = _markers(name)
    block = f"{begin}\n{text.rstrip()}\n{end}"
    old = doc.read_text() if doc.exists() else (f"# {title}\n" if title else "")
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    new = pattern.sub(lambda _: block, old, count=1) if pattern.search(old) else old.rstrip() + "\n\n" + block
    atomic_write(doc, new.strip("\n") + "\n")

#!/usr/bin/env python3
"""Check that every relative link in the project's markdown resolves: ``[text](target)`` and ``![alt](target)`` in
``README.md``, ``docs/*.md`` and the other top-level folders' ``README.md`` files (:data:`DOCUMENTS`), resolved
against the document's folder; a ``#fragment`` is dropped, and ``http(s):``/``mailto:`` links and pure ``#anchors``
are not checked. Links inside fenced code blocks and inline code do not count.

    python tools/check_links.py             # exit 1 and one line per broken link (document:line: target)
    python tools/check_links.py --root DIR  # another tree
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/*.md", "*/README.md")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def documents(root: Path) -> list[Path]:
    return sorted({p for pattern in DOCUMENTS for p in root.glob(pattern) if p.is_file()})


def broken_links(doc: Path) -> list[tuple[int, str]]:
    """(line, target) of each relative link in ``doc`` whose file or folder does not exist."""
    bad = []
    fenced = False
    for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if path and not (doc.parent / path).exists():
                bad.append((n, target))
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to check (default: this repository)")
    args = ap.parse_args(argv)
    root = args.root.resolve()
    docs = documents(root)
    failed = 0
    for doc in docs:
        for n, target in broken_links(doc):
            print(f"{doc.relative_to(root)}:{n}: broken link {target}", file=sys.stderr)
            failed += 1
    print(f"{len(docs)} documents, {failed} broken links", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

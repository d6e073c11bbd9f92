"""tools/check_links.py: every relative link in README.md, docs/*.md and the folders' README.md files resolves; a
made-up tree with a broken image link fails and names it, links in code and to the web are not checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import check_links  # type: ignore[import-not-found]  # noqa: E402  # tools/ is put on sys.path above


def test_the_repository_has_no_broken_link() -> None:
    assert check_links.main([]) == 0
    assert REPO / "docs" / "benchmarks.md" in check_links.documents(REPO)
    assert REPO / "research" / "README.md" in check_links.documents(REPO)


def test_a_broken_link_fails_and_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "docs" / "img").mkdir(parents=True)
    (tmp_path / "docs" / "img" / "a.png").write_bytes(b"")
    (tmp_path / "README.md").write_text("[ok](docs/r.md#part) [web](https://example.org/x) `[code](gone.md)`\n")
    (tmp_path / "docs" / "r.md").write_text("![a](img/a.png)\n```\n[fenced](gone.md)\n```\n![b](b.png)\n")
    assert check_links.main(["--root", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "docs/r.md:5: broken link b.png" in err and "gone.md" not in err and "2 documents, 1 broken links" in err
    (tmp_path / "docs" / "b.png").write_bytes(b"")
    assert check_links.main(["--root", str(tmp_path)]) == 0

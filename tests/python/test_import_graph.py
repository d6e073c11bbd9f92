"""tools/import_graph.py bites: on a made-up tree with the project's folders, an upward edge (product -> research,
product -> tests, gguf_s3d8 -> convert, a benchmark script -> tests through a bare sibling import) or a cycle makes
``--check`` exit 1 and names it; the same tree without them passes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import import_graph  # type: ignore[import-not-found]  # noqa: E402  # tools/ is put on sys.path above


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


CLEAN = {
    "gguf_s3d8/__init__.py": "import numpy\n",
    "gguf_s3d8/fsio.py": "import os\n",
    "convert/__init__.py": "from gguf_s3d8 import fsio\n",
    "qat/__init__.py": "def f():\n    from convert import common\n",
    "convert/common.py": "from . import errors\n",
    "convert/errors.py": "",
    "fixtures/__init__.py": "from convert import common\n",
    "benchmarks/bench_common.py": "import fixtures\n",
    "benchmarks/bench_x.py": "import bench_common\nfrom qat import train\n",
    "research/__init__.py": "",
    "research/probe.py": "from qat import x\nimport fixtures\n",
    "tests/python/test_a.py": "import bench_x\nfrom research import probe\n",
}


def test_a_clean_tree_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _tree(tmp_path, CLEAN)
    graph = import_graph.edges(root)
    assert ("benchmarks.bench_x", "benchmarks.bench_common") in graph  # a bare sibling import, resolved
    assert ("tests.python.test_a", "benchmarks.bench_x") in graph  # a folder scripts put on sys.path
    assert ("convert.common", "convert.errors") in graph  # a relative import
    assert ("qat", "convert.common") in graph  # an import inside a function
    assert import_graph.main(["--root", str(root), "--check"]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("rel, text, edge", [
    ("gguf_s3d8/bad.py", "from convert import common\n", "gguf_s3d8.bad -> convert.common"),
    ("qat/bad.py", "from research import probe\n", "qat.bad -> research.probe"),
    ("convert/bad.py", "def f():\n    import tests.python.test_a\n", "convert.bad -> tests.python.test_a"),
    ("fixtures/bad.py", "import benchmarks.bench_x\n", "fixtures.bad -> benchmarks.bench_x"),
    ("benchmarks/bench_common.py", "import fixtures\nfrom tests.python import test_a\n",
     "benchmarks.bench_common -> tests.python.test_a"),
])
def test_an_upward_edge_fails_and_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], rel: str, text: str,
                                           edge: str) -> None:
    root = _tree(tmp_path, {**CLEAN, rel: text})
    assert import_graph.main(["--root", str(root), "--check"]) == 1
    assert f"upward import: {edge} " in capsys.readouterr().err


def test_a_cycle_fails_and_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _tree(tmp_path, {**CLEAN, "research/a.py": "from research import b\n", "research/b.py": "import research.a\n"})
    assert import_graph.main(["--root", str(root), "--check"]) == 1
    assert "import cycle: research.a <-> research.b" in capsys.readouterr().err


def test_the_repository_has_no_upward_edge_and_no_cycle() -> None:
    graph = import_graph.edges()
    assert import_graph.upward(graph) == [] and import_graph.cycles(graph) == []
    scanned = {a.split(".")[0] for a, _ in graph}
    assert {"gguf_s3d8", "convert", "qat", "benchmarks", "research", "tools", "tests"} <= scanned
    assert not any(a.split(".")[0] in import_graph.LAYERS and b.split(".")[0] in ("research", "tests", "benchmarks")
                   for a, b in graph)

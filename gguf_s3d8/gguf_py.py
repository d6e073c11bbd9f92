"""The gguf-py that knows S3D8: the patch series' own, in the patched llama.cpp tree.

S3D8 is defined once for Python, in the series' gguf-py (``work/llama.cpp/gguf-py``, patch "gguf-py : add
S3D8"): ``GGMLQuantizationType.S3D8``, ``LlamaFileType.MOSTLY_S3D8``, ``GGML_QUANT_SIZES`` and a whole-slice
``gguf.quants.S3D8`` class with its own decoder of the container (bit for bit this codec's, tested;
quantizing is ggml's, as for the i-quants). The PyPI ``gguf`` (a dependency, for its own dependencies)
has none of it. :func:`use_series_gguf` makes the tree's gguf-py the process's ``gguf``; importing
``gguf_s3d8`` (or ``convert``) calls it, so everything that imports ``gguf`` afterwards - the converter,
upstream's code, the inspect CLI, the tools and tests - gets that one definition. A ``gguf`` a process
imported before is replaced in ``sys.modules`` (modules that bound it keep it).

The tree is ``<repo>/work/llama.cpp`` (``python ci/patches.py apply``), or ``$S3D8_LLAMA_CPP_DIR`` when set
(as CMake's ``LLAMA_CPP_DIR``). Only the ``gguf`` package is loaded from ``gguf-py/``: that folder is not put
on ``sys.path``, where its ``tests`` package would shadow this repository's ``tests``.

``tests/python/test_type_ids.py`` checks that ggml.h, llama.h, this gguf-py and :mod:`gguf_s3d8.constants`
agree on the ids and sizes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parent.parent


class S3D8GgufError(RuntimeError):
    """The process's gguf-py is not one that defines S3D8 (not the patch series' gguf-py)."""


def tree_dir() -> Path:
    """The patched llama.cpp tree: ``$S3D8_LLAMA_CPP_DIR`` or ``<repo>/work/llama.cpp``."""
    env = os.environ.get("S3D8_LLAMA_CPP_DIR")
    return Path(env).expanduser().resolve() if env else _REPO_ROOT / "work" / "llama.cpp"


def gguf_py_dir() -> Path:
    return tree_dir() / "gguf-py"


def is_series_gguf(mod: ModuleType) -> bool:
    """Whether ``mod`` is the tree's gguf-py package."""
    f = getattr(mod, "__file__", None)
    return f is not None and Path(f).resolve().is_relative_to((gguf_py_dir() / "gguf").resolve())


def use_series_gguf() -> None:
    """Make the tree's gguf-py the process's ``gguf`` (a no-op without a tree, or when it is ``gguf`` already)."""
    init = gguf_py_dir() / "gguf" / "__init__.py"
    if not init.is_file() or ("gguf" in sys.modules and is_series_gguf(sys.modules["gguf"])):
        return
    previous = {k: m for k, m in sys.modules.items() if k == "gguf" or k.startswith("gguf.")}
    for k in previous:
        del sys.modules[k]
    spec = importlib.util.spec_from_file_location("gguf", init, submodule_search_locations=[str(init.parent)])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gguf"] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        for k in [k for k in sys.modules if k == "gguf" or k.startswith("gguf.")]:
            del sys.modules[k]
        sys.modules.update(previous)
        raise


def series_gguf() -> ModuleType:
    """The process's ``gguf`` after :func:`use_series_gguf`; raises S3D8GgufError if it does not define S3D8."""
    use_series_gguf()
    import gguf

    if not hasattr(gguf.GGMLQuantizationType, "S3D8"):
        raise S3D8GgufError(
            f"the gguf-py in use ({Path(gguf.__file__).parent}) does not define S3D8; it is defined by the patch "
            f"series' gguf-py in {gguf_py_dir()}: run `python ci/patches.py apply` (or set S3D8_LLAMA_CPP_DIR)")
    return gguf


def s3d8_gguf_type() -> Any:
    """``gguf.GGMLQuantizationType.S3D8`` of the series' gguf-py."""
    return series_gguf().GGMLQuantizationType.S3D8

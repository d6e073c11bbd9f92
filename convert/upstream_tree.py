"""The pinned, patched llama.cpp tree whose converter (``convert_hf_to_gguf.py``, ``conversion/``) and gguf-py
this converter drives.

The tree is the one the project builds from: ``<repo>/work/llama.cpp`` (``python ci/patches.py apply``), or
``$S3D8_LLAMA_CPP_DIR`` when set (as CMake's ``LLAMA_CPP_DIR``). Its ``gguf-py`` is *the* ``gguf`` of a converter
process: ``convert/__init__.py`` puts it first on ``sys.path`` before anything imports ``gguf``, so upstream's
model classes, our writer and the S3D8 codec's registration all see one module (the series' patch 0005 already
defines ``GGMLQuantizationType.S3D8`` and ``LlamaFileType.MOSTLY_S3D8`` there). A process that imported another
``gguf`` first (the PyPI one) gets a :class:`convert.errors.ConvertError` saying so instead of a mixed conversion.

The tree's root is appended (not prepended) to ``sys.path``, so its ``conversion`` package is importable without
shadowing this repository's own top-level folders.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

from .errors import ConvertError

_REPO_ROOT = Path(__file__).resolve().parent.parent


def tree_dir() -> Path:
    """The patched llama.cpp tree: ``$S3D8_LLAMA_CPP_DIR`` or ``<repo>/work/llama.cpp``."""
    env = os.environ.get("S3D8_LLAMA_CPP_DIR")
    return Path(env).expanduser().resolve() if env else _REPO_ROOT / "work" / "llama.cpp"


def gguf_py_dir() -> Path:
    return tree_dir() / "gguf-py"


def put_tree_gguf_first() -> None:
    """Make ``import gguf`` find the tree's gguf-py (a no-op once some ``gguf`` is imported, or without a tree)."""
    d = gguf_py_dir()
    if "gguf" not in sys.modules and (d / "gguf" / "__init__.py").is_file() and str(d) not in sys.path:
        sys.path.insert(0, str(d))


def _is_tree_gguf(mod: ModuleType) -> bool:
    f = getattr(mod, "__file__", None)
    return f is not None and Path(f).resolve().is_relative_to((gguf_py_dir() / "gguf").resolve())


def upstream_converter() -> ModuleType:
    """``convert_hf_to_gguf`` of the tree (imported once; it brings ``conversion`` and ``ModelBase``).

    Raises ConvertError when the tree is missing or this process already uses another gguf-py.
    """
    tree = tree_dir()
    script = tree / "convert_hf_to_gguf.py"
    if not script.is_file() or not (tree / "conversion" / "__init__.py").is_file():
        raise ConvertError(f"the patched llama.cpp tree is missing at {tree} (its convert_hf_to_gguf.py and "
                           "conversion/ are the converter's base): run `python ci/patches.py apply` or set "
                           "S3D8_LLAMA_CPP_DIR")
    put_tree_gguf_first()
    import gguf

    if not _is_tree_gguf(gguf):
        raise ConvertError(f"this process imported gguf from {Path(gguf.__file__).parent} before the converter; the "
                           f"converter needs the tree's {gguf_py_dir()} (import convert first, or put that folder "
                           "first on PYTHONPATH)")
    if str(tree) not in sys.path:
        sys.path.append(str(tree))
    try:
        import convert_hf_to_gguf
    except ImportError as e:
        raise ConvertError(f"upstream's converter in {tree} cannot be imported (it needs torch, transformers and "
                           f"sentencepiece): {e}") from e
    return convert_hf_to_gguf

"""The gguf that knows S3D8: the patch series' gguf-py, installed as the environment's ``gguf``.

S3D8 is defined once for Python, in the series' gguf-py (``work/llama.cpp/gguf-py``, patch "gguf-py : add
S3D8"): ``GGMLQuantizationType.S3D8``, ``LlamaFileType.MOSTLY_S3D8``, ``GGML_QUANT_SIZES``, a whole-slice
``gguf.quants.S3D8`` class with its own decoder of the container (bit for bit this codec's, tested; quantizing is
ggml's, as for the i-quants), and the KV types. ``ci/setup.sh`` installs that gguf-py from the applied tree into the
virtual environment, so a plain ``import gguf`` - this package's, upstream's converter code, ``gguf-dump``,
``gguf-set-metadata``, a user's script - gets it; importing this package changes nothing about which ``gguf`` a
process uses. PyPI's ``gguf`` has none of it (it rejects the ids): :func:`series_gguf` says how to install the
right one instead of failing later on an unknown type.

The tree is ``<repo>/work/llama.cpp`` (``python ci/patches.py apply``), or ``$S3D8_LLAMA_CPP_DIR`` when set
(as CMake's ``LLAMA_CPP_DIR``); :func:`is_series_gguf` tells whether a ``gguf`` module is that tree's gguf-py
(the folder itself or an installed copy of it, file for file).

``tests/python/test_type_ids.py`` checks that ggml.h, llama.h, this gguf-py and :mod:`gguf_s3d8.ggml_types` agree on
the ids and sizes.
"""

from __future__ import annotations

import hashlib
import os
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


def install_hint() -> str:
    """How to make the tree's gguf-py the environment's ``gguf``."""
    return (f"install the patch series' gguf-py from the applied tree: `bash ci/setup.sh` (or `pip install --no-deps "
            f"{gguf_py_dir()}` after `python ci/patches.py apply`)")


def package_digest(pkg: Path) -> str:
    """sha256 over a package folder's files (relative names and contents; no bytecode)."""
    h = hashlib.sha256()
    for f in sorted(p for p in pkg.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def is_series_gguf(mod: ModuleType) -> bool:
    """Whether ``mod`` is the tree's gguf-py package: its folder, or a copy of it with the same files (installed)."""
    f = getattr(mod, "__file__", None)
    src = gguf_py_dir() / "gguf"
    if f is None or not (src / "__init__.py").is_file():
        return False
    pkg = Path(f).resolve().parent
    return pkg == src.resolve() or package_digest(pkg) == package_digest(src)


def series_gguf() -> ModuleType:
    """The process's ``gguf``; raises S3D8GgufError (naming the fix) if it does not define S3D8."""
    import gguf

    if not hasattr(gguf.GGMLQuantizationType, "S3D8"):
        raise S3D8GgufError(
            f"the gguf-py in use ({Path(gguf.__file__).parent}) does not define S3D8 (PyPI's gguf?): {install_hint()}")
    return gguf


def s3d8_gguf_type() -> Any:
    """``gguf.GGMLQuantizationType.S3D8`` of the series' gguf-py."""
    return series_gguf().GGMLQuantizationType.S3D8

"""The pinned, patched llama.cpp tree whose converter (``convert_hf_to_gguf.py``, ``conversion/``) and gguf-py
this converter drives.

The tree is the one the project builds from: ``<repo>/work/llama.cpp`` (``python ci/patches.py apply``), or
``$S3D8_LLAMA_CPP_DIR`` when set (as CMake's ``LLAMA_CPP_DIR``). Its ``gguf-py`` is *the* ``gguf`` of a converter
process: importing the ``convert`` package loads it as ``gguf`` before anything else imports one, so upstream's
model classes, our writer and the S3D8 codec's registration all see one module (the series' patch gguf-py-add-S3D8 already
defines ``GGMLQuantizationType.S3D8`` and ``LlamaFileType.MOSTLY_S3D8`` there). A ``gguf`` a process imported
before (the PyPI one) is replaced in ``sys.modules`` (:func:`put_tree_gguf_first`).

Once imported, upstream's ``conversion`` package and ``convert_hf_to_gguf`` stay in ``sys.modules``; neither the
tree's root nor its gguf-py folder stays on ``sys.path`` (their ``tests``/``tools`` would shadow ours).
"""

from __future__ import annotations

import importlib.util
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
    """Make the tree's gguf-py the process's ``gguf`` (a no-op without a tree, or when it is ``gguf`` already).

    Only the ``gguf`` package itself is loaded from ``gguf-py/`` - that folder is not put on ``sys.path``, where
    its ``tests`` package would shadow this repository's ``tests``. A ``gguf`` imported earlier (PyPI's, e.g. by a
    tool that reads GGUFs before it converts) is replaced in ``sys.modules``: modules that bound it keep using it
    (reading files, enums that compare by value), everything imported from now on - the converter, upstream's code -
    gets the tree's.
    """
    init = gguf_py_dir() / "gguf" / "__init__.py"
    if not init.is_file() or ("gguf" in sys.modules and _is_tree_gguf(sys.modules["gguf"])):
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
    # upstream's scripts put gguf-py on sys.path unless NO_LOCAL_GGUF is set: ours is loaded already (above), and
    # that folder's ``tests`` package must not shadow ours; the tree's root is on sys.path only while importing
    saved_env, saved_path = os.environ.get("NO_LOCAL_GGUF"), list(sys.path)
    os.environ["NO_LOCAL_GGUF"] = "1"
    sys.path.insert(0, str(tree))
    try:
        import convert_hf_to_gguf
    except ImportError as e:
        raise ConvertError(f"upstream's converter in {tree} cannot be imported (it needs torch, transformers and "
                           f"sentencepiece): {e}") from e
    finally:
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop("NO_LOCAL_GGUF", None)
        else:
            os.environ["NO_LOCAL_GGUF"] = saved_env
    return convert_hf_to_gguf

"""The pinned, patched llama.cpp tree whose converter (``convert_hf_to_gguf.py``, ``conversion/``) and gguf-py
this converter drives.

The tree is the one the project builds from: ``<repo>/work/llama.cpp`` (``python ci/patches.py apply``), or
``$S3D8_LLAMA_CPP_DIR`` when set (as CMake's ``LLAMA_CPP_DIR``). Its ``gguf-py`` is *the* ``gguf`` of a converter
process: ``ci/setup.sh`` installs it as the environment's ``gguf``, so upstream's model classes, our writer and the
S3D8 codec all import one module, the one that defines S3D8 (the series' patch "gguf-py : add S3D8").
:func:`upstream_converter` checks that the ``gguf`` in use is that tree's (the same files) before it loads upstream's
code; nothing here swaps modules.

Once imported, upstream's ``conversion`` package and ``convert_hf_to_gguf`` stay in ``sys.modules``; neither the
tree's root nor its gguf-py folder stays on ``sys.path`` (their ``tests``/``tools`` would shadow ours).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

from gguf_s3d8.gguf_py import gguf_py_dir, install_hint, is_series_gguf, tree_dir

from .errors import ConvertError

__all__ = ["gguf_py_dir", "tree_dir", "upstream_converter"]


def upstream_converter() -> ModuleType:
    """``convert_hf_to_gguf`` of the tree (imported once; it brings ``conversion`` and ``ModelBase``).

    Raises ConvertError when the tree is missing or the ``gguf`` in use is not the tree's gguf-py.
    """
    tree = tree_dir()
    script = tree / "convert_hf_to_gguf.py"
    if not script.is_file() or not (tree / "conversion" / "__init__.py").is_file():
        raise ConvertError(f"the patched llama.cpp tree is missing at {tree} (its convert_hf_to_gguf.py and "
                           "conversion/ are the converter's base): run `python ci/patches.py apply` or set "
                           "S3D8_LLAMA_CPP_DIR")
    import gguf

    if not is_series_gguf(gguf):
        raise ConvertError(f"the gguf in use ({Path(gguf.__file__).parent}) is not the tree's gguf-py "
                           f"({gguf_py_dir()}), which the converter needs: {install_hint()}")
    # upstream's scripts put gguf-py on sys.path unless NO_LOCAL_GGUF is set: the installed one is that gguf-py, and
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

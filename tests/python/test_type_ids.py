"""One definition of the project's ggml types across C and Python, checked.

The ids and sizes live in the C headers of the patch series (ggml.h, llama.h, ggml-s3d8.h), in the series'
gguf-py (constants.py, which every Python user loads through ``gguf_s3d8.gguf_py``) and, for the codec that works
without gguf-py, in ``gguf_s3d8.constants`` / ``gguf_s3d8.kv_types``. This test reads the headers of the patched
tree and fails on any disagreement.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import pytest

from gguf_s3d8 import constants, kv_types
from gguf_s3d8.gguf_py import is_series_gguf, tree_dir

TREE = tree_dir()


def c_enum(header: Path, name: str) -> int:
    """The value of ``name = <int>`` in a C header's enum."""
    m = re.search(rf"^\s*{re.escape(name)}\s*=\s*(\d+)\s*,", header.read_text(), re.MULTILINE)
    assert m is not None, f"{name} not found in {header}"
    return int(m.group(1))


def c_define(header: Path, name: str) -> int:
    m = re.search(rf"^#define\s+{re.escape(name)}\s+(\d+)\b", header.read_text(), re.MULTILINE)
    assert m is not None, f"{name} not found in {header}"
    return int(m.group(1))


GGML_H = TREE / "ggml" / "include" / "ggml.h"
LLAMA_H = TREE / "include" / "llama.h"
S3D8_H = TREE / "ggml" / "src" / "ggml-s3d8.h"


def test_the_process_uses_the_series_gguf_py() -> None:
    assert is_series_gguf(gguf), gguf.__file__


def test_s3d8_ids_and_sizes_agree() -> None:
    qt, ft = gguf.GGMLQuantizationType, gguf.LlamaFileType
    assert c_enum(GGML_H, "GGML_TYPE_S3D8") == int(qt.S3D8) == constants.S3D8_TYPE_ID == 96
    assert c_enum(GGML_H, "GGML_FTYPE_MOSTLY_S3D8") == c_enum(LLAMA_H, "LLAMA_FTYPE_MOSTLY_S3D8") \
        == int(ft.MOSTLY_S3D8) == constants.LLAMA_FTYPE_MOSTLY_S3D8
    assert qt.S3D8.name == constants.S3D8_TYPE_NAME
    sizes = (c_define(S3D8_H, "GGML_S3D8_QK"), c_define(S3D8_H, "GGML_S3D8_TYPE_SIZE"))
    assert sizes == gguf.GGML_QUANT_SIZES[qt.S3D8] == (constants.BLOCK_SIZE, constants.TYPE_SIZE)
    assert c_define(S3D8_H, "GGML_S3D8_HEADER_SIZE") == constants.HEADER_SIZE
    assert c_define(S3D8_H, "GGML_S3D8_N_CODES") == constants.N_CENTROIDS


@pytest.mark.parametrize("name", sorted(kv_types.TYPE_IDS))
def test_kv_type_ids_agree(name: str) -> None:
    c_name = "GGML_TYPE_" + name.upper()
    assert c_enum(GGML_H, c_name) == int(gguf.GGMLQuantizationType[name.upper()]) == kv_types.TYPE_IDS[name]


def test_no_id_is_used_twice() -> None:
    ids = [int(m) for m in gguf.GGMLQuantizationType]
    assert len(ids) == len(set(ids))
    c_ids = [int(v) for v in re.findall(r"^\s*GGML_TYPE_\w+\s*=\s*(\d+)\s*,", GGML_H.read_text(), re.MULTILINE)]
    assert len(c_ids) == len(set(c_ids))

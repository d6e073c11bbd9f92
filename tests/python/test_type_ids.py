"""One definition of the project's ggml types across C and Python, checked.

The ids and sizes live in the C headers of the patch series (ggml.h, llama.h, ggml-s3d8.h), in the series'
gguf-py (constants.py, which every Python user loads through ``gguf_s3d8.gguf_py``) and, for the codec that works
without gguf-py, in ``gguf_s3d8.constants`` and the table of types ``gguf_s3d8.ggml_types``. This test reads the headers of the patched
tree and fails on any disagreement.
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_s3d8 import constants, ggml_types
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


@pytest.mark.parametrize("name", sorted(t.name for t in ggml_types.KV_TYPES))
def test_kv_type_ids_agree(name: str) -> None:
    c_name = "GGML_TYPE_" + name.upper()
    assert c_enum(GGML_H, c_name) == int(gguf.GGMLQuantizationType[name.upper()]) == ggml_types.TYPES[name].type_id


def test_no_id_is_used_twice() -> None:
    ids = [int(m) for m in gguf.GGMLQuantizationType]
    assert len(ids) == len(set(ids))
    c_ids = [int(v) for v in re.findall(r"^\s*GGML_TYPE_\w+\s*=\s*(\d+)\s*,", GGML_H.read_text(), re.MULTILINE)]
    assert len(c_ids) == len(set(c_ids))


def test_the_table_of_types_agrees_with_gguf_py() -> None:
    """gguf_s3d8.ggml_types, the one table of the weight and KV types, has gguf-py's ids, names, block sizes, row
    sizes and file types; a type is found by name, by id and by gguf-py member alike."""
    qt, ft = gguf.GGMLQuantizationType, gguf.LlamaFileType
    assert [t.name for t in ggml_types.WEIGHT_TYPES] == ["f32", "f16", "bf16", "q8_0", "s3d8"]
    assert [t.name for t in ggml_types.KV_TYPES] == ["q4_hqq", "q4_hqq_128", "tq3_0"]
    for t in ggml_types.TYPES.values():
        member = qt(t.type_id)
        assert member.name == t.gguf_name and gguf.GGML_QUANT_SIZES[member] == (t.block_size, t.type_size)
        assert ggml_types.ggml_type(member) is ggml_types.ggml_type(t.gguf_name) is ggml_types.ggml_type(t.type_id) is t
        if t.file_type is not None:
            assert ft(t.file_type).name in (f"ALL_{t.gguf_name}", f"MOSTLY_{t.gguf_name}")
        if t.dtype == np.uint8:
            for shape in ((6, 256), (2, 3, 512)):
                assert t.byte_shape(shape) == tuple(gguf.quant_shape_to_byte_shape(shape, member))
    assert ggml_types.S3D8.file_type == c_enum(LLAMA_H, "LLAMA_FTYPE_MOSTLY_S3D8")
    from gguf_s3d8 import native

    assert native.TYPE_IDS == {"bf16": 30, "q8_0": 8, "s3d8": 96}
    with pytest.raises(ValueError, match="unknown ggml type"):
        ggml_types.ggml_type("q4_k")


@pytest.mark.parametrize("name", [t.name for t in ggml_types.TYPES.values() if t.torch_twin])
def test_each_torch_twin_is_the_numpy_round_trip(name: str) -> None:
    """The torch twin a type names (resolved by qat.formats.torch_twin) gives decode(encode(w)) bit for bit."""
    import torch

    from qat.formats import torch_twin

    t = ggml_types.TYPES[name]
    w = np.random.default_rng(21).standard_normal((192, 1024)).astype(np.float32)
    if t.slice_quantized:
        want = t.decode(t.encode(w, encoder="reference"))
        got = torch_twin(name)().quantise(torch.from_numpy(w)).numpy()
    else:
        want = t.decode(t.encode(w)).reshape(w.shape)
        got = torch_twin(name)(torch.from_numpy(w)).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("name", [t.name for t in ggml_types.WEIGHT_TYPES])
def test_the_students_values_are_the_numpy_round_trip(name: str) -> None:
    """qat.formats.twin_values, with which the QAT student computes a GGUF weight of each type, gives
    decode(encode(w)) bit for bit (S3D8: with the container's codebook frozen; F32: w itself)."""
    import torch

    from gguf_s3d8.container import read_container
    from qat.formats import twin_values

    t = ggml_types.TYPES[name]
    w = np.random.default_rng(22).standard_normal((192, 1024)).astype(np.float32)
    data = t.encode(w, encoder="reference") if t.slice_quantized else t.encode(w)
    frozen = {"codebook": torch.from_numpy(np.array(read_container(data).codebook, dtype=np.uint8))} \
        if t.slice_quantized else {}
    got = twin_values(name)(torch.from_numpy(w), frozen).numpy()
    want = t.decode(data).reshape(w.shape).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_upstream_flag_is_the_pinned_upstream_enum() -> None:
    """A type marked ``upstream`` is in the pinned, unpatched upstream ggml.h with its id; the series' own are not
    (the converter plans those with upstream's F16 and recodes)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ci"))
    import check_upstream
    import upstream

    header = upstream.tree_path() / check_upstream.GGML_H
    if not header.is_file():
        pytest.fail(f"pinned upstream tree missing ({header}): run `python3 ci/upstream.py fetch`")
    text = header.read_text()
    for t in ggml_types.TYPES.values():
        assert (re.search(rf"^\s*GGML_TYPE_{t.gguf_name}\s*=\s*{t.type_id}\s*,", text, re.MULTILINE) is not None) \
            == t.upstream, t.name


#: the modules that dispatch on types through gguf_s3d8.ggml_types (issue 48, item 3) and must not grow a per-type
#: branch again; QAT's student, GPTQ and training models ask the table too (the torch twins of the types)
DISPATCHING = ["convert/tensor_types.py", "convert/common.py", "convert/upstream_source.py", "gguf_s3d8/native.py",
               "gguf_s3d8/kv_types.py", "qat/formats.py", "qat/student.py", "qat/gptq_s3d8.py",
               "qat/training/models.py"]
_NAMES = "f32|f16|bf16|q8_0|s3d8|q4_hqq|q4_hqq_128|tq3_0"
#: a comparison with a gguf-py member, a type-named variable compared with a type's name, or a type's name as the
#: key of a dict literal (a per-type table)
TYPE_BRANCH = re.compile(rf"""(==|!=|\bin)\s*\(?\s*QT\.\w+|\b(qtype|out_type|type_name|requested|name|dtype)\s*[!=]=\s*["']({_NAMES})["']|(^|[{{,])\s*["']({_NAMES})["']\s*:\s*\S""")


@pytest.mark.parametrize("path", DISPATCHING)
def test_no_per_type_branches_outside_the_table(path: str) -> None:
    """No ``if qtype == ...`` chain outside the table of types: these modules ask the type (its fields), not its name."""
    text = (Path(__file__).resolve().parents[2] / path).read_text()
    hits = [f"{path}:{i}: {line.strip()}" for i, line in enumerate(text.splitlines(), 1) if TYPE_BRANCH.search(line)]
    assert hits == []

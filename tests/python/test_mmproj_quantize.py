"""llama-quantize reads mmproj files (GGUF architecture ``clip``, the vision tower the converter writes with
``--mmproj``), so a vision tower quantises in C: upstream's dummy architecture ``LLM_ARCH_CLIP`` ("only used by
llama-quantize") loads it, and the S3D8 type rules pick the same matrices as the converter.

Compared on the tiny mllama (fixtures/tiny_model.py: every vision matrix S3D8-eligible): ``llama-quantize
mmproj-f32.gguf out.gguf S3D8`` against the converter's ``--mmproj-type s3d8`` (iw1 without an imatrix on both
sides; the checkpoint is float32, so the f32 mmproj holds exactly the weights the converter encodes). Every S3D8
tensor and every other tensor is byte-identical, except the one difference of the type rules, explained:
``v.patch_embd.weight`` (a 7x7 convolution kernel, 4-D) is F16 in the converter's S3D8 file (upstream's mmproj class
forces conv kernels to F16 whenever the file type is not F32, and S3D8 plans at F16) and stays as it is (F32) in
llama-quantize, whose upstream rules never quantise a multimodal ``.patch_embd`` (``tensor_allows_quantization``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT

import gguf_s3d8  # noqa: F401  (the series' gguf-py, which defines S3D8)
from convert.common import ConversionOptions
from convert.mllama import convert as convert_mllama
from tests.mllama import tiny_model as T

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    exe = Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin")) / name
    if not exe.is_file():
        pytest.fail(f"{exe} not found: build llama.cpp first (`bash ci/build.sh host`) or set S3D8_BIN_DIR")
    return str(exe)


def _tensors(path: Path) -> dict[str, tuple[QT, bytes]]:
    return {t.name: (t.tensor_type, bytes(np.asarray(t.data).tobytes())) for t in gguf.GGUFReader(path).tensors}


def test_llama_quantize_s3d8_of_an_mmproj_equals_the_converter(tmp_path: Path) -> None:
    model = T.get()
    f32, conv = tmp_path / "mmproj-f32.gguf", tmp_path / "mmproj-s3d8.gguf"
    convert_mllama(model, None, ConversionOptions(), mmproj=f32, mmproj_options=ConversionOptions(out_type="f32"),
                   progress=False)
    convert_mllama(model, None, ConversionOptions(), mmproj=conv, mmproj_options=ConversionOptions(out_type="s3d8"),
                   progress=False)
    lq = tmp_path / "mmproj-lq.gguf"
    r = subprocess.run([_tool("llama-quantize"), str(f32), str(lq), "S3D8", "2"], capture_output=True, text=True,
                       timeout=900, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert gguf.GGUFReader(lq).fields["general.architecture"].contents() == "clip"
    a, b = _tensors(conv), _tensors(lq)
    assert set(a) == set(b)
    s3d8 = sorted(n for n, (t, _) in a.items() if t == QT.S3D8)
    assert len(s3d8) == 19 and "mm.0.weight" in s3d8 and "v.global.blk.0.attn_q.weight" in s3d8, s3d8
    differ = sorted(n for n in a if a[n] != b[n])
    assert differ == ["v.patch_embd.weight"], differ
    assert (a["v.patch_embd.weight"][0], b["v.patch_embd.weight"][0]) == (QT.F16, QT.F32)
    # the explained difference is only the storage type of the same kernel: F16 of the F32 values
    f16 = np.frombuffer(a["v.patch_embd.weight"][1], np.float16)
    assert np.array_equal(f16, np.frombuffer(b["v.patch_embd.weight"][1], np.float32).astype(np.float16))

"""S3D8 through the real gguf-py package (writer, reader, gguf-dump) and the inspect CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import gguf_s3d8
from gguf_s3d8 import S3D8_TYPE_ID, dequantize_s3d8, quantize_s3d8, s3d8_gguf_type
from gguf_s3d8.gguf_py import is_series_gguf
from gguf_s3d8.importance import quantize_s3d8_importance
from gguf_s3d8.__main__ import main as cli_main
from gguf_s3d8.eligibility import body_offset

REPO = Path(__file__).resolve().parents[2]
T = gguf.GGMLQuantizationType


def test_s3d8_is_the_series_gguf_py_s_own_member() -> None:
    assert is_series_gguf(gguf)
    assert s3d8_gguf_type() is T.S3D8 is T(S3D8_TYPE_ID) is gguf.GGMLQuantizationType["S3D8"]
    assert int(T.S3D8) == 96 and T.S3D8.name == "S3D8" and isinstance(T.S3D8, int)
    assert gguf.GGML_QUANT_SIZES[T.S3D8] == (128, 43)
    assert sum(1 for m in T if int(m) == 96) == 1


def test_gguf_quants_s3d8_decodes_whole_slices_as_the_codec() -> None:
    """gguf-py carries its own S3D8 decoder (the series' patch): bit for bit the codec's, per slice of a stack,
    for n % 3 = 0, 1, 2; a broken header is a QuantError; quantizing is left to ggml (llama-quantize)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((2, 192, 1024)).astype(np.float32)     # a stack of two slices
    q = np.stack([quantize_s3d8_importance(x) for x in w])
    assert q.dtype == np.uint8 and q.shape == (2, 192, 1024 * 43 // 128)
    for got, want in ((gguf.quants.dequantize(q, T.S3D8), dequantize_s3d8(q)),
                      *((gguf.quants.dequantize(c, T.S3D8), dequantize_s3d8(c)) for c in
                        (quantize_s3d8_importance(rng.standard_normal((n, 2048)).astype(np.float32))
                         for n in (448, 248)))):
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert gguf.quants.quant_shape_from_byte_shape(q.shape, T.S3D8) == w.shape
    bad = q[0].copy()
    bad[0, 4] = 2                                                   # version 2
    with pytest.raises(gguf.quants.QuantError, match="header"):
        gguf.quants.dequantize(bad, T.S3D8)
    with pytest.raises(gguf.quants.QuantError, match="does not match"):
        gguf.quants.dequantize(q[0][:-3], T.S3D8)                   # 189 rows of a 192-row container
    with pytest.raises(gguf.quants.QuantError):
        gguf.quants.S3D8.dequantize_blocks(np.zeros((1, 43), np.uint8))
    assert not gguf.quants.S3D8.can_quantize(w[0])
    with pytest.raises(NotImplementedError, match="llama-quantize"):
        gguf.quants.quantize(w, T.S3D8)


def write_model(path: Path, tensors: dict[str, tuple[np.ndarray, Any]]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(8)
    w = rng.laplace(size=(248, 2048)).astype(np.float32)
    e = rng.normal(size=(2, 48, 2048)).astype(np.float32)
    c = {"blk.0.ffn_up.weight": quantize_s3d8(w, name="blk.0.ffn_up.weight"),
         "blk.0.ffn_up_exps.weight": quantize_s3d8(e, name="blk.0.ffn_up_exps.weight")}
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_model(path, {"blk.0.ffn_up.weight": (c["blk.0.ffn_up.weight"], T.S3D8),
                       "output_norm.weight": (np.ones(2048, np.float32), None),
                       "blk.0.ffn_up_exps.weight": (c["blk.0.ffn_up_exps.weight"], T.S3D8)})
    return path, c


def test_gguf_round_trip(model) -> None:
    path, containers = model
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    t = by_name["blk.0.ffn_up.weight"]
    assert t.tensor_type is T.S3D8
    assert t.shape.tolist() == [2048, 248]                     # ggml order: ne0 = k, ne1 = n
    assert t.data.dtype == np.uint8 and t.data.shape == (248, 688)
    assert t.n_bytes == 248 * 688
    assert np.array_equal(t.data, containers["blk.0.ffn_up.weight"])
    assert np.array_equal(dequantize_s3d8(t.data), dequantize_s3d8(containers["blk.0.ffn_up.weight"]))
    x = by_name["blk.0.ffn_up_exps.weight"]
    assert x.shape.tolist() == [2048, 48, 2] and x.data.shape == (2, 48, 688)
    assert np.array_equal(x.data, containers["blk.0.ffn_up_exps.weight"])
    assert by_name["output_norm.weight"].tensor_type is T.F32


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gguf_s3d8", *args], capture_output=True, text=True,
                          cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_inspect_good_file(model, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = model
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "blk.0.ffn_up.weight" in out and "S3D8" in out and "248 x 2048" in out
    assert "2.6875" in out and "distinct" in out and "over 2 slices" in out
    assert "summary:" in out and "OK: 2 S3D8 tensor(s) verified" in out
    total = 248 * 688 + 2048 * 4 + 2 * 48 * 688
    assert f"{total} bytes" in out
    assert cli_main([str(path), "--quiet"]) == 0                # bare FILE means inspect


def test_inspect_corrupt_file_names_the_tensor(model, tmp_path: Path) -> None:
    path, containers = model
    bad = {k: v.copy() for k, v in containers.items()}
    bad["blk.0.ffn_up.weight"].reshape(-1)[4] = 9              # version
    bad["blk.0.ffn_up_exps.weight"][1].reshape(-1)[body_offset(48) - 1] = 1
    corrupt = tmp_path / "bad.gguf"
    write_model(corrupt, {k: (v, T.S3D8) for k, v in bad.items()})
    r = run_cli("inspect", str(corrupt))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "'blk.0.ffn_up.weight'" in r.stderr and "version 9" in r.stderr
    assert "'blk.0.ffn_up_exps.weight[1]'" in r.stderr and "between scales and body" in r.stderr
    assert "CORRUPT" in r.stdout


def test_inspect_unreadable_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    r = run_cli("inspect", str(junk))
    assert r.returncode == 2 and "cannot read" in r.stderr


def test_dump_lists_s3d8_tensors(model) -> None:
    path, _ = model
    r = run_cli("dump", "--json", str(path))
    assert r.returncode == 0, r.stderr
    tensors = json.loads(r.stdout)["tensors"]
    assert tensors["blk.0.ffn_up.weight"]["type"] == "S3D8"
    assert tensors["blk.0.ffn_up.weight"]["shape"][:2] == [2048, 248]


def test_imports_have_no_process_wide_effect() -> None:
    """Importing the codec or the converter neither loads nor replaces ``gguf`` nor touches sys.path: the ``gguf`` of
    a process is the environment's, the series' gguf-py that ci/setup.sh installs (and the codec needs none)."""
    code = ("import sys; path = list(sys.path); import gguf_s3d8; print('gguf' in sys.modules); "
            "import gguf as before; import convert, convert.to_gguf; import gguf as after; "
            "print(after is before, sys.modules['gguf'] is before, sys.path == path, "
            "int(after.GGMLQuantizationType.S3D8), after.GGML_QUANT_SIZES[after.GGMLQuantizationType(96)])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={"PYTHONPATH": str(REPO)}, timeout=120)
    assert r.stdout.split() == ["False", "True", "True", "True", "96", "(128,", "43)"], r.stderr
    assert gguf_s3d8.S3D8_TYPE_ID == 96


def test_the_venv_gguf_tools_read_s3d8_and_kv_types(model, tmp_path: Path) -> None:
    """The environment's own gguf-dump and gguf-set-metadata (console scripts of the installed gguf, no project code
    involved) read a file with S3D8 and KV-type tensors: the installed gguf is the series' gguf-py."""
    from gguf_s3d8.ggml_types import KV_TYPES

    bindir = Path(sys.executable).parent
    rng = np.random.default_rng(5)
    path = tmp_path / "s3d8-kv.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_S3D8))
    w.add_tensor("blk.0.ffn_up.weight", model[1]["blk.0.ffn_up.weight"], raw_dtype=T.S3D8)
    for kv in KV_TYPES:
        raw = kv.encode(rng.standard_normal(4 * 256).astype(np.float32))
        w.add_tensor(f"cache_{kv.name}", raw.reshape(kv.byte_shape((4, 256))), raw_dtype=T(kv.type_id))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    env = {"PATH": f"{bindir}:/usr/bin:/bin"}
    r = subprocess.run([str(bindir / "gguf-dump"), "--json", str(path)], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    tensors = json.loads(r.stdout)["tensors"]
    assert tensors["blk.0.ffn_up.weight"]["type"] == "S3D8"
    assert tensors["blk.0.ffn_up.weight"]["shape"][:2] == [2048, 248]
    assert {tensors[f"cache_{kv.name}"]["type"] for kv in KV_TYPES} == {"Q4_HQQ", "Q4_HQQ_128", "TQ3_0"}
    assert all(tensors[f"cache_{kv.name}"]["shape"][:2] == [256, 4] for kv in KV_TYPES)
    r = subprocess.run([str(bindir / "gguf-dump"), str(path)], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    assert r.returncode == 0 and "S3D8" in r.stdout and "blk.0.ffn_up.weight" in r.stdout, r.stderr
    r = subprocess.run([str(bindir / "gguf-set-metadata"), "--force", str(path), "general.file_type", "7"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    reader = gguf.GGUFReader(str(path))
    assert int(reader.fields["general.file_type"].parts[-1][0]) == 7
    assert {t.name: t.tensor_type.name for t in reader.tensors}["blk.0.ffn_up.weight"] == "S3D8"


@pytest.mark.parametrize("corruption,message", [
    ("magic", "bad S3D8 magic 00 00 00 00"),
    ("padding", "S3D8 padding between the scales and the body is not zero"),
])
def test_llama_loader_rejects_corrupt_s3d8_naming_the_tensor(tmp_path: Path, corruption: str, message: str) -> None:
    """libllama validates every slice-quantized tensor at load (whatever --check-tensors says): a corrupt
    container is a load error naming the tensor and the fault, not a crash in the kernels. The fuzz seeds'
    tiny S3D8 Llama, one container damaged in place."""
    import os

    from tests.fuzz import make_seeds

    path = tmp_path / "tiny.gguf"
    make_seeds.llama_s3d8(make_seeds._tokenizer_kv()).write(path)
    reader = gguf_s3d8.series_gguf().GGUFReader(path, "r+")
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    raw = t.data.reshape(-1).view(np.uint8)
    assert t.tensor_type.name == "S3D8" and bytes(raw[:4]) == b"S3D8"
    if corruption == "magic":
        raw[:4] = 0
    else:
        raw[body_offset(int(t.shape[1])) - 1] = 1
    reader.data.flush()
    del reader
    exe = Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin")) / "llama-perplexity"
    if not exe.is_file():
        pytest.fail(f"{exe} not found: build llama.cpp first (`bash ci/build.sh host`) or set S3D8_BIN_DIR")
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 200)
    r = subprocess.run([str(exe), "-m", str(path), "-f", str(text), "-c", "64", "--chunks", "1"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    log = r.stdout + r.stderr
    assert r.returncode != 0 and "GGML_ASSERT" not in log, log[-3000:]
    assert f"tensor 'blk.0.ffn_down.weight' has invalid data: {message}" in log, log[-3000:]

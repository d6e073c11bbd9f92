"""The converter's C encoder: ``libs3d8-native`` (``gguf_s3d8.native``, ggml's own quantisers) against the numpy
codec, the tested reference, and the converter's ``--backend`` / ``--threads``.

The format promises nothing about an encoder's output, but iw1 promises that its C and numpy implementations give
the same bytes for any thread count (integer weights, fixed summation orders, no contraction), and Q8_0 / BF16 are
ggml's reference rounding in both: every comparison here is byte equality. (C against llama-quantize itself, on
real SmolLM2 tensors with a real llama-imatrix file: test_codec_importance.py, whose converter runs in C.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT

import gguf_s3d8  # noqa: F401  (the series' gguf-py, which defines S3D8)
from fixtures import assets
from convert.encoders import Pending, encoders_for
from fixtures.synthetic import write_tiny_llama
from convert.tensor_types import S3D8Options, encode
from convert.to_gguf import main as convert_main
from gguf_s3d8.imatrix import write_legacy_imatrix
from gguf_s3d8.importance import quantize_s3d8_importance
from gguf_s3d8.native import ABI_VERSION, NativeCodec, NativeLibraryError, library_path, load_native

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def native() -> NativeCodec:
    try:
        return load_native()
    except NativeLibraryError as e:
        pytest.fail(f"the C encoder library is needed here: {e}")


def _weights(n: int, k: int, seed: int) -> np.ndarray:
    """Heavy-tailed weights with the awkward cases: an all-zero row, a zero column, one outlier column."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(4, size=(n, k)) * 0.02).astype(np.float32)
    w[1] = 0.0
    w[:, 5] = 0.0
    w[:, 7] *= 40
    return w


def _importance(k: int, seed: int) -> np.ndarray:
    """Importance with a few dominant columns (as a real imatrix's super activations) and some zeros."""
    rng = np.random.default_rng(seed)
    u = rng.random(k).astype(np.float32) ** 4
    u[[3, 11]] = 1e5
    u[20:30] = 0.0
    return u


@pytest.mark.parametrize("shape", [(576, 1536), (302, 2048), (900, 1024)])
@pytest.mark.parametrize("with_importance", [False, True])
def test_s3d8_same_bytes_as_numpy(native: NativeCodec, shape: tuple[int, int], with_importance: bool) -> None:
    n, k = shape
    w = _weights(n, k, seed=n)
    u = _importance(k, seed=k) if with_importance else None
    c = native.quantize(w, "s3d8", importance=u, name="w")
    py = quantize_s3d8_importance(w, u, name="w")
    assert c.shape == py.shape and c.dtype == np.uint8
    diff = np.flatnonzero(c.reshape(-1) != py.reshape(-1))
    assert diff.size == 0, f"{diff.size} bytes differ, first at {diff[:4]}"


@pytest.mark.parametrize(("rule", "seed"), [("round", 0), ("trunc", 7), (None, 3)])
def test_s3d8_seed_and_centroid_rule(native: NativeCodec, rule: str | None, seed: int) -> None:
    """--centroid-rule and --seed reach the C fit (ggml_s3d8_quantize_iw) as they reach the numpy one."""
    w, u = _weights(300, 1024, seed=1), _importance(1024, seed=2)
    kw: dict[str, Any] = {} if rule is None else {"centroid_rule": rule}
    c = native.quantize(w, "s3d8", importance=u, seed=seed, **kw)
    assert np.array_equal(c, quantize_s3d8_importance(w, u, seed=seed, **kw))
    if seed:
        assert not np.array_equal(c, native.quantize(w, "s3d8", importance=u, **kw))  # the seed does something


@pytest.mark.parametrize("type_name", ["q8_0", "bf16"])
def test_row_types_same_bytes_as_gguf_py(native: NativeCodec, type_name: str) -> None:
    w = _weights(67, 4096, seed=5)
    w[2, :64] = np.float32(1e-30)   # subnormal-scale blocks
    w[3, :32] = -w[3, :32]
    c = native.quantize(w, type_name)
    py = gguf.quants.quantize(w, QT[type_name.upper()])
    assert np.array_equal(c.reshape(-1), py.view(np.uint8).reshape(-1))


def test_thread_count_does_not_change_the_bytes(native: NativeCodec) -> None:
    w, u = _weights(900, 2048, seed=9), _importance(2048, seed=9)
    ref = native.quantize(w, "s3d8", importance=u, threads=1)
    for threads in (2, 3):
        assert np.array_equal(native.quantize(w, "s3d8", importance=u, threads=threads), ref), threads
    ref0 = native.quantize(w, "s3d8", threads=1)
    assert np.array_equal(native.quantize(w, "s3d8", threads=2), ref0)


def test_real_smollm2_tensors(native: NativeCodec, smollm2_f16_and_text: tuple[Path, Path]) -> None:
    """Real weights (SmolLM2's ffn_down of the first and last layer, the matrices S3D8 holds), with and without an
    importance."""
    f16, _ = smollm2_f16_and_text
    tensors = {t.name: t for t in gguf.GGUFReader(f16).tensors}
    for name in ("blk.0.ffn_down.weight", "blk.29.ffn_down.weight"):
        t = tensors[name]
        w = np.asarray(t.data).astype(np.float32).reshape(int(t.shape[1]), int(t.shape[0]))
        for u in (None, _importance(w.shape[1], seed=3)):
            assert np.array_equal(native.quantize(w, "s3d8", importance=u, name=name),
                                  quantize_s3d8_importance(w, u, name=name)), (name, u is None)


def test_encode_expert_stack_per_slice(native: NativeCodec) -> None:
    """A 3-D stack: one C job and one importance row per slice, stacked as the numpy encoder stacks them."""

    class Im:  # the one method of gguf_s3d8.imatrix.Imatrix that the encoder calls
        def for_tensor(self, name: str, k: int, n_expert: int = 1) -> np.ndarray:
            return np.stack([_importance(k, seed=e) for e in range(n_expert)])

    w = np.stack([_weights(384, 1024, seed=e) for e in range(3)])
    opts = S3D8Options(imatrix=Im())
    with encoders_for("c", 2) as enc:
        assert enc.native is not None
        got = encode(w, QT.S3D8, name="blk.0.ffn_down_exps.weight", s3d8=opts)
        assert isinstance(got, Pending)
        c = got.result()
    py = encode(w, QT.S3D8, name="blk.0.ffn_down_exps.weight", s3d8=opts)   # outside a writer: numpy
    assert isinstance(py, np.ndarray) and c.shape == py.shape == (3, 384, 344)
    assert np.array_equal(c, py)


def test_bad_input_is_an_error_not_an_abort(native: NativeCodec) -> None:
    """What ggml would abort on is checked first and raised naming the tensor (the converter checks most of it
    earlier itself; this is the library's own guard)."""
    w = _weights(384, 1024, seed=0)
    bad = w.copy()
    bad[4, 4] = np.nan
    with pytest.raises(gguf_s3d8.S3D8InputError, match="blk.0.x.*non-finite|blk.0.x.*finite"):
        native.quantize(bad, "s3d8", name="blk.0.x")
    with pytest.raises(gguf_s3d8.S3D8InputError, match="cannot be stored as s3d8"):
        native.quantize(w[:, :1000], "s3d8", name="blk.0.x")
    u = np.ones(1024, np.float32)
    u[9] = -1.0
    with pytest.raises(gguf_s3d8.S3D8InputError, match="blk.0.x"):
        native.quantize(w, "s3d8", importance=u, name="blk.0.x")
    with pytest.raises(gguf_s3d8.S3D8InputError, match="1000 values"):
        native.quantize(w, "s3d8", importance=u[:1000], name="blk.0.x")


# ---------------------------------------------------------------------------------------------------
# the converter: --threads, --backend, the fallback and a mismatched library


@pytest.fixture(scope="module")
def tiny_s3d8(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer Llama whose ffn_down (192 x 1024) holds S3D8 (the rest Q8_0), and an imatrix for layer 0 only."""
    d = tmp_path_factory.mktemp("native")
    model = write_tiny_llama(d / "m", assets.smollm2_hf_dir(), hidden=192, heads=3, kv_heads=3, ffn=1024, layers=2)
    im = d / "im.dat"
    write_legacy_imatrix(im, {"blk.0.ffn_down.weight": _importance(1024, seed=4)}, ncall=4, chunk_count=1)
    return {"dir": d, "model": model, "imatrix": im}


def _convert(tiny: dict[str, Path], out: Path, *extra: str) -> bytes:
    assert convert_main([str(tiny["model"]), "--type", "s3d8", "-o", str(out), "--no-progress", *extra]) == 0
    return out.read_bytes()


@pytest.mark.parametrize("imatrix", [False, True])
def test_converter_threads_and_backends_give_the_same_file(tiny_s3d8: dict[str, Path], tmp_path: Path,
                                                           imatrix: bool) -> None:
    extra = ["--imatrix", str(tiny_s3d8["imatrix"])] if imatrix else []
    c1 = _convert(tiny_s3d8, tmp_path / "c1.gguf", "--backend", "c", "--threads", "1", *extra)
    c2 = _convert(tiny_s3d8, tmp_path / "c2.gguf", "--backend", "c", "--threads", "2", *extra)
    py = _convert(tiny_s3d8, tmp_path / "py.gguf", "--backend", "numpy", *extra)
    assert c1 == c2 == py
    ts = {t.name: t for t in gguf.GGUFReader(tmp_path / "c1.gguf").tensors}
    assert ts["blk.0.ffn_down.weight"].tensor_type == QT.S3D8 and ts["blk.0.ffn_up.weight"].tensor_type == QT.Q8_0


def test_missing_library_falls_back_to_numpy_with_a_notice(tiny_s3d8: dict[str, Path], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    want = _convert(tiny_s3d8, tmp_path / "c.gguf", "--backend", "c")
    capsys.readouterr()
    monkeypatch.setenv("S3D8_NATIVE_LIB", str(tmp_path / "absent" / "libs3d8-native.so"))
    assert _convert(tiny_s3d8, tmp_path / "auto.gguf") == want
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "numpy" in notes[0] and "absent" in notes[0] and "not built" in notes[0], err
    out = tmp_path / "c-missing.gguf"
    assert convert_main([str(tiny_s3d8["model"]), "--type", "s3d8", "-o", str(out), "--no-progress",
                         "--backend", "c"]) == 2
    err = capsys.readouterr().err
    assert "--backend c" in err and "not built" in err and not out.exists()


_FAKE = r"""
#include <stddef.h>
#include <stdint.h>
int s3d8_native_abi(void) { return ABI; }
int s3d8_native_type_s3d8(void) { return TYPE; }
int s3d8_native_openmp(void) { return 0; }
const char * s3d8_native_type_name(int t) { return t == TYPE ? "s3d8" : t == 8 ? "q8_0" : t == 30 ? "bf16" : NULL; }
size_t s3d8_native_row_size(int t, int64_t k) { return t == 8 ? k / 32 * 34 : t == 30 ? 2 * k : k / 128 * 43; }
int s3d8_native_quantize(void) { return 1; }
"""


def _fake_library(tmp_path: Path, abi: int, type_id: int) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (ci/setup.sh installs one)"
    src, lib = tmp_path / f"fake{abi}-{type_id}.c", tmp_path / f"libfake{abi}-{type_id}.so"
    src.write_text(_FAKE)
    subprocess.run([cc, "-shared", "-fPIC", f"-DABI={abi}", f"-DTYPE={type_id}", "-o", str(lib), str(src)], check=True)
    return lib


def test_a_library_from_another_build_is_refused(tiny_s3d8: dict[str, Path], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Another ABI or another S3D8 type id: a clear error naming the library and what differs, never silently other
    code or a silent fallback."""
    with pytest.raises(NativeLibraryError, match=rf"ABI version {ABI_VERSION + 1}, this checkout needs {ABI_VERSION}"):
        load_native(_fake_library(tmp_path, ABI_VERSION + 1, 96))
    with pytest.raises(NativeLibraryError, match="GGML_TYPE_S3D8 is 95 in the library, 96 in this checkout"):
        load_native(_fake_library(tmp_path, ABI_VERSION, 95))
    with pytest.raises(NativeLibraryError, match="not a libs3d8-native library"):
        NativeCodec(_libc())
    monkeypatch.setenv("S3D8_NATIVE_LIB", str(_fake_library(tmp_path, ABI_VERSION + 1, 96)))
    out = tmp_path / "o.gguf"
    assert convert_main([str(tiny_s3d8["model"]), "--type", "s3d8", "-o", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "ABI version" in err and "--backend numpy" in err and not out.exists()
    # --backend numpy never loads it
    assert convert_main([str(tiny_s3d8["model"]), "--type", "s3d8", "-o", str(out), "--no-progress",
                         "--backend", "numpy"]) == 0


def _libc() -> Path:
    import ctypes.util

    name = ctypes.util.find_library("c")
    assert name
    return Path(name)


def test_library_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("S3D8_NATIVE_LIB", str(tmp_path / "x.so"))
    assert library_path() == tmp_path / "x.so"
    monkeypatch.delenv("S3D8_NATIVE_LIB")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libs3d8-native.so").write_bytes(b"")
    monkeypatch.setenv("S3D8_BIN_DIR", str(tmp_path / "bin"))
    assert library_path() == tmp_path / "lib" / "libs3d8-native.so"
    monkeypatch.setenv("S3D8_BIN_DIR", str(tmp_path / "elsewhere" / "bin"))
    assert library_path() == REPO / "build" / "host" / "lib" / "libs3d8-native.so"
    assert os.environ.get("S3D8_NATIVE_LIB") is None

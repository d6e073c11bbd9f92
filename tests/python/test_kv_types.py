"""KV-cache types Q4_HQQ, Q4_HQQ_128, TQ3_0 (issue 13): the numpy reference (gguf_s3d8.kv_types, through the types' table gguf_s3d8.ggml_types) gives the
C quantiser's bytes and dequantised floats bit for bit (via `test-kv-types --dump`), on K/V-like rows with
outlier channels, constant and zero blocks, and Gaussian rows; the type ids are the series' and no pinned
upstream id; gguf-py knows the types."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gguf_s3d8 import kv_types
from gguf_s3d8.ggml_types import KV_TYPES, TYPES

REPO = Path(__file__).resolve().parents[2]
#: the KV types of the one table of types (gguf_s3d8.ggml_types): ids and (values, bytes) per block, by name
TYPE_IDS = {t.name: t.type_id for t in KV_TYPES}
BLOCK = {t.name: (t.block_size, t.type_size) for t in KV_TYPES}


def quantize(name: str, x: np.ndarray) -> bytes:
    return TYPES[name].encode(x).tobytes()


def dequantize(name: str, data: bytes) -> np.ndarray:
    return TYPES[name].decode(np.frombuffer(data, np.uint8))


def bin_dir() -> Path:
    return Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin"))


def c_quantize(tmp_path: Path, name: str, x: np.ndarray, n_per_row: int,
               variant: str | None = None) -> tuple[bytes, np.ndarray]:
    """Bytes and dequantised floats of the C quantiser: the host build, or an aarch64 build under QEMU."""
    exe = bin_dir() / "test-kv-types" if variant is None else REPO / "build" / variant / "bin" / "test-kv-types"
    if not exe.is_file():
        pytest.fail(f"{exe} not found: build it first (`bash ci/build.sh {variant or 'host'}`; ci/test.sh does)")
    cmd = [str(exe)] if variant is None else ["qemu-aarch64", "-cpu", "max", str(exe)]
    tag = f"{name}-{variant or 'host'}"
    src, q, f = tmp_path / f"{tag}.f32", tmp_path / f"{tag}.bin", tmp_path / f"{tag}.out.f32"
    np.ascontiguousarray(x, dtype=np.float32).tofile(src)
    r = subprocess.run(cmd + ["--dump", name, str(n_per_row), str(src), str(q), str(f)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return q.read_bytes(), np.fromfile(f, dtype=np.float32)


def kv_like(rng: np.random.Generator, rows: int, d: int) -> np.ndarray:
    """K-like rows: log-normal channel scales, three outlier channels (x20..x60), per-channel offsets,
    a Hadamard-rotated copy (what the pinned tree's rotation stores), constant and zero blocks."""
    scale = np.exp(0.5 * rng.standard_normal(d))
    scale[rng.choice(d, 3, replace=False)] *= np.array([20.0, 40.0, 60.0])
    x = rng.standard_normal((rows, d)) * scale + 0.3 * scale * rng.standard_normal(d)
    h = np.array([[1.0]])
    while h.shape[0] < 64:
        h = np.block([[h, h], [h, -h]])
    rot = (x.reshape(rows, -1, 64) @ (h / 8.0).T).reshape(rows, d)
    x = np.concatenate([x, rot]).astype(np.float32)
    x[0, :128] = 0.0
    x[1, :128] = 0.75
    x[2, :128] = -1e-3
    x[3, :64] = rng.standard_normal(64).astype(np.float32) * np.float32(1e-6)  # tiny values: subnormal fp16
    return x


@pytest.mark.parametrize("name", ["q4_hqq", "q4_hqq_128", "tq3_0"])
def test_numpy_reference_gives_the_c_bytes(tmp_path: Path, name: str) -> None:
    rng = np.random.default_rng(13)
    d = 256
    x = np.concatenate([kv_like(rng, 48, d), rng.standard_normal((16, d)).astype(np.float32)])
    c_bytes, c_float = c_quantize(tmp_path, name, x, d)
    qk, bsz = BLOCK[name]
    assert len(c_bytes) == x.size // qk * bsz
    py_bytes = quantize(name, x)
    blocks_c = np.frombuffer(c_bytes, np.uint8).reshape(-1, bsz)
    blocks_py = np.frombuffer(py_bytes, np.uint8).reshape(-1, bsz)
    diff = np.flatnonzero((blocks_c != blocks_py).any(axis=1))
    assert diff.size == 0, f"{diff.size} of {len(blocks_c)} blocks differ, first {diff[:5]}"
    # dequantisation: equal as bit patterns
    py_float = dequantize(name, c_bytes)
    assert np.array_equal(py_float.view(np.uint32), c_float.view(np.uint32))
    # constant blocks are exact in the HQQ types, zero blocks in all
    assert np.array_equal(py_float[:128], np.zeros(128, np.float32))
    if name != "tq3_0":
        assert np.array_equal(py_float[d:d + 128], np.full(128, 0.75, np.float32))


@pytest.mark.parametrize("variant", ["aarch64-dotprod", "aarch64-i8mm"])
def test_aarch64_quantiser_gives_the_same_bytes(tmp_path: Path, variant: str) -> None:
    """The phone's cache holds the same bytes: the aarch64 builds (QEMU) quantise exactly as numpy and x86."""
    if os.environ.get("S3D8_SKIP_CROSS") == "1" or shutil.which("qemu-aarch64") is None:
        pytest.skip("no aarch64 build or qemu-aarch64 this run (counted as a failure by ci/summarize.py)")
    rng = np.random.default_rng(14)
    x = kv_like(rng, 16, 256)
    for name in ("q4_hqq", "q4_hqq_128", "tq3_0"):
        q, f = c_quantize(tmp_path, name, x, 256, variant)
        assert q == quantize(name, x), name
        assert np.array_equal(f.view(np.uint32), dequantize(name, q).view(np.uint32)), name


def test_reference_errors_on_gaussian_data() -> None:
    """The numbers docs/kv-cache.md quotes (relative MSE, N(0,1), 32768 values)."""
    x = np.random.default_rng(5).standard_normal(32768).astype(np.float32)
    err = {n: float(((dequantize(n, quantize(n, x)) - x) ** 2).sum() / (x ** 2).sum())
           for n in ("q4_hqq", "q4_hqq_128", "tq3_0")}
    assert 0.0050 < err["q4_hqq"] < 0.0060
    assert 0.0085 < err["q4_hqq_128"] < 0.0103
    assert 0.0240 < err["tq3_0"] < 0.0280
    # the table is the Lloyd-Max quantiser of N(0, 1), scaled: at most 0.0021 sigma off
    scaled = kv_types.TQ3_LEVELS.astype(np.float64) * (kv_types.LLOYD_MAX_N01[-1] / 88.0)
    assert np.abs(scaled - kv_types.LLOYD_MAX_N01).max() < 0.0021


def test_type_ids_are_the_series_and_clear_of_upstream() -> None:
    """ci/check_upstream.py reads the ids from the patches; they are these, and the pinned upstream enum
    (removed ids included) has none of them."""
    import sys
    sys.path.insert(0, str(REPO / "ci"))
    import check_upstream
    import upstream

    ids = check_upstream.series_type_ids()
    assert {n: ids[f"GGML_TYPE_{n.upper()}"] for n in TYPE_IDS} == TYPE_IDS
    assert len(set(ids.values())) == len(ids)
    tree = upstream.tree_path()
    if not (tree / check_upstream.GGML_H).is_file():
        pytest.fail(f"pinned upstream tree {tree} missing: run `python3 ci/upstream.py fetch`")
    assert check_upstream.check_ids(tree, check_upstream.patches.PATCH_DIR) == []
    assert not set(TYPE_IDS.values()) & set(check_upstream.enum_values((tree / check_upstream.GGML_H).read_text()))


def test_gguf_py_of_the_series_knows_the_types() -> None:
    """The series' gguf-py (work/llama.cpp/gguf-py) has the ids and the block sizes of the reference."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("series_gguf_constants",
                                                  REPO / "work" / "llama.cpp" / "gguf-py" / "gguf" / "constants.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for name, tid in TYPE_IDS.items():
        t = mod.GGMLQuantizationType[name.upper()]
        assert int(t) == tid and mod.GGML_QUANT_SIZES[t] == BLOCK[name]

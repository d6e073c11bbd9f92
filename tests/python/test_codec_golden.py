"""Committed golden vectors: reproducible byte for byte, self-consistent, and readable from manifest.txt
the way a C test will read them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gguf_s3d8 import (
    S3D8InputError,
    decode_int8,
    dequantize_s3d8,
    quantize_activations,
    quantize_s3d8_with_codebook,
    read_container,
    reference_matmul,
)
from gguf_s3d8.golden import generate

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "s3d8_golden"


def test_regenerating_reproduces_the_committed_files(tmp_path: Path) -> None:
    generate(tmp_path)
    committed = sorted(p.name for p in GOLDEN.iterdir() if p.is_file())
    assert sorted(p.name for p in tmp_path.iterdir()) == committed
    for name in committed:
        assert (tmp_path / name).read_bytes() == (GOLDEN / name).read_bytes(), (
            f"{name} differs: the codec's output changed; if on purpose, rerun "
            "python -m gguf_s3d8.golden --out tests/data/s3d8_golden and explain why in the commit")


def test_golden_set_is_small() -> None:
    assert sum(p.stat().st_size for p in GOLDEN.iterdir() if p.is_file()) < 1_400_000


def load(name: str, dtype: str) -> np.ndarray:
    return np.fromfile(GOLDEN / name, dtype=np.dtype(dtype).newbyteorder("<"))


def manifest_lines() -> list[list[str]]:
    text = (GOLDEN / "manifest.txt").read_text()
    return [line.split() for line in text.splitlines() if line and not line.startswith("#")]


def test_manifests_agree() -> None:
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    assert manifest["byte_order"] == "little"
    lines = manifest_lines()
    assert [l[0] for l in lines] == [c["name"] for c in manifest["cases"]]
    for line, case in zip(lines, manifest["cases"]):
        assert len(line) == 11
        keys = ["n", "k", "m", "file_w", "file_codebook", "file_container", "file_x", "file_y", "file_xq", "file_xs"]
        assert line[1:] == [str(case[k]) for k in keys]
        for f in line[4:]:
            assert f == "-" or (GOLDEN / f).is_file()
    for fname, info in manifest["files"].items():
        assert (GOLDEN / fname).stat().st_size == info["bytes"]
    ms = {int(l[3]) for l in lines if l[6] != "-"}
    assert ms == {1, 2, 3, 7, 8, 17}
    residues = {int(l[1]) % 3 for l in lines if l[6] != "-"}
    assert residues == {0, 1, 2}


@pytest.mark.parametrize("line", manifest_lines(), ids=lambda l: l[0])
def test_each_case_as_a_c_reader_would(line: list[str]) -> None:
    name, n, k, m = line[0], int(line[1]), int(line[2]), int(line[3])
    file_w, file_cb, file_c, file_x, file_y, file_xq, file_xs = line[4:]
    cb = load(file_cb, "u1").reshape(32, 3)
    if file_c == "-":
        w = load(file_w, "f4").reshape(n, k)
        with pytest.raises(S3D8InputError, match="non-finite"):
            quantize_s3d8_with_codebook(w, cb, name=name)
        return
    container = load(file_c, "u1")
    assert container.size == n * 43 * k // 128
    c = read_container(container, name=name)
    assert (c.n, c.k) == (n, k) and np.array_equal(c.codebook, cb)
    w = load(file_w, "f4").reshape(n, k) if file_w != "-" else dequantize_s3d8(container)
    assert np.array_equal(quantize_s3d8_with_codebook(w, cb, name=name).reshape(-1), container)
    x = load(file_x, "f4").reshape(-1, k)[:m]
    xq, xs = quantize_activations(x)
    assert np.array_equal(xq, load(file_xq, "i1").reshape(-1, k)[:m])
    assert np.array_equal(xs, load(file_xs, "u2")[:m])
    y = load(file_y, "f4").reshape(-1, n)[:m]
    assert np.array_equal(reference_matmul(container, x).view(np.uint32), y.view(np.uint32))


def test_special_case_covers_what_it_claims() -> None:
    w = load("special.w.f32", "f4").reshape(48, 2048)
    w_int, alpha = decode_int8(load("special.container.u8", "u1"))
    assert alpha[6] == 0 and alpha[11] == 0 and w[11].any()             # zero row; subnormal row -> 0
    assert 0 < alpha[12] < np.finfo(np.float32).tiny                        # subnormal bf16 scale
    assert alpha[14] == np.float32(1.015625) and alpha[15] == 1.0 and alpha[16] == np.float32(1.0078125)
    assert w_int[0, 1] == 12 and w_int[0, 2] == -12                        # ties -> lowest index (12 < 10's index)
    assert np.signbit(w[3, 0]) and w_int[3, 0] >= 0                         # -0.0 stored positive
    xq = load("x.xq.i8", "i1").reshape(17, -1)
    xs = load("x.xs.bf16", "u2")
    assert not xq[1].any() and xs[1] == 0 and xs[5] == 0x0040 and xs[7] == 0x0040
    assert xq[7].max() == 127 and xq[7].min() == -127
    y = load("special.y.f32", "f4")
    assert not np.isnan(y).any()


# --- the committed files against the format, read here from docs/s3d8-format.md alone ---------------------------------
# (no gguf_s3d8 function below: the checks above replay the numpy codec that wrote the files; these hold the files to
# the normative text, independently of it, and the C test test-s3d8-golden holds the C kernels to the same files)

def spec_bf16_rne(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bits, round to nearest even (finite inputs)."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def spec_bf16_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, np.uint32) << 16).view(np.float32)


def spec_decode(c: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Format section 4 (layout) and section 2 (bits): k, n, codebook, alpha (fp32), w_int and the sign bits (n x k)."""
    assert bytes(c[:4]) == b"S3D8" and c[4] == 1 and not c[5:8].any() and not c[112:128].any()
    k, n = (int(v) for v in c[8:16].view("<u4"))
    cb = c[16:112].reshape(32, 3).astype(np.int32)
    alpha = spec_bf16_f32(c[128:128 + 2 * n].view("<u2"))
    body = (128 + 2 * n + 63) // 64 * 64
    assert not c[128 + 2 * n:body].any()
    t = -(-n // 3)
    b = c[body:body + t * k].reshape(t, k).astype(np.int32)
    assert not c[body + t * k:].any()
    idx = (b >> 1) & 31
    signs = [b & 1, (b >> 6) & 1, ((b >> 7) ^ b) & 1]
    w = np.empty((3 * t, k), np.int32)
    sign = np.empty((3 * t, k), bool)
    for d in range(3):
        w[d::3] = np.where(signs[d] == 1, -cb[idx, d], cb[idx, d])
        sign[d::3] = signs[d] == 1
    return k, n, cb, alpha, w[:n], sign[:n]


def spec_matmul(c: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Format section 3: the activations' bf16 scales and int8 values, and y (m x n), every step in fp32."""
    k, n, _, alpha, w, _ = spec_decode(c)
    x = np.asarray(x, np.float32)
    s_bits = spec_bf16_rne(np.abs(x).max(axis=1) / np.float32(127))
    s = spec_bf16_f32(s_bits)
    inv = np.where(s == 0, np.float32(0), np.float32(1) / np.where(s == 0, np.float32(1), s)).astype(np.float32)
    xq = np.clip(np.rint(x * inv[:, None]), -127, 127).astype(np.int64)
    acc = xq @ w.T.astype(np.int64)
    assert np.abs(acc).max() < 2**31
    with np.errstate(over="ignore"):  # the special case's huge scales overflow to inf, as fp32 does in C
        y = (acc.astype(np.float32) * s[:, None]) * alpha[None, :]
    return s_bits, xq.astype(np.int8), y.astype(np.float32)


@pytest.mark.parametrize("line", [l for l in manifest_lines() if l[6] != "-"], ids=lambda l: l[0])
def test_each_case_follows_the_format_spec(line: list[str]) -> None:
    n, k, m = int(line[1]), int(line[2]), int(line[3])
    file_w, file_cb, file_c, file_x, file_y, file_xq, file_xs = line[4:]
    c = load(file_c, "u1")
    assert c.size == n * 43 * k // 128
    kk, nn, cb, alpha, _, sign = spec_decode(c)
    assert (kk, nn) == (k, n) and np.array_equal(cb, load(file_cb, "u1").reshape(32, 3))
    if file_w != "-":
        w = load(file_w, "f4").reshape(n, k)
        # section 1: alpha_i = bf16_rne(max_j |W_ij| / 127), and the sign of each weight
        assert np.array_equal(spec_bf16_rne(np.abs(w).max(axis=1) / np.float32(127)), c[128:128 + 2 * n].view("<u2"))
        # S = 1 iff w' = W / alpha < 0 in fp32 (a weight that underflows to -0 there is positive)
        with np.errstate(divide="ignore", invalid="ignore"):
            wn = w / alpha[:, None]
        assert np.array_equal(sign[alpha > 0], (wn < 0)[alpha > 0])
    s_bits, xq, y = spec_matmul(c, load(file_x, "f4").reshape(-1, k)[:m])
    assert np.array_equal(s_bits, load(file_xs, "u2")[:m])
    assert np.array_equal(xq, load(file_xq, "i1").reshape(-1, k)[:m])
    assert np.array_equal(y.view(np.uint32), load(file_y, "f4").reshape(-1, n)[:m].view(np.uint32))

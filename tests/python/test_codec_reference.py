"""Quantise / dequantise semantics and the integer reference matmul (format sections 1 and 3),
checked against straightforward re-derivations written independently of the codec's helpers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_s3d8 import (
    decode_int8,
    dequantize_s3d8,
    quantize_activations,
    quantize_s3d8,
    quantize_s3d8_with_codebook,
    read_container,
    reference_matmul,
)
from gguf_s3d8.errors import S3D8InputError
from gguf_s3d8.golden import grid_container, pad_codebook

K = 2048
N = 48


def bf16(x: float) -> np.float32:
    """Independent bf16 RNE for one value via the standard integer trick on its bits."""
    u = int(np.array([x], np.float32).view(np.uint32)[0])
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return np.array([u & 0xFFFFFFFF], np.uint32).view(np.float32)[0]


def direct_quantise(w: np.ndarray, cb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Section 1 written out row triple by row triple: returns (int weights +/-C, alpha)."""
    n, k = w.shape
    alpha = np.array([bf16(np.float32(np.abs(r).max()) / np.float32(127)) for r in w], np.float32)
    wp = np.zeros((-(-n // 3) * 3, k), np.float32)
    for i in range(n):
        if alpha[i] != 0:
            wp[i] = w[i] / alpha[i]
    ints = np.zeros_like(wp, dtype=np.int16)
    c = cb.astype(np.float32)
    for p in range(wp.shape[0] // 3):
        a = np.abs(wp[3 * p:3 * p + 3]).T                          # (k, 3)
        dist = (((c[None, :, 0] - a[:, 0:1]) ** 2 + (c[None, :, 1] - a[:, 1:2]) ** 2)
                + (c[None, :, 2] - a[:, 2:3]) ** 2)
        q = dist.argmin(axis=1)                                    # first minimum = lowest index
        for d in range(3):
            ints[3 * p + d] = np.where(wp[3 * p + d] < 0, -cb[q, d].astype(np.int16), cb[q, d])
    return ints[:n], alpha


@pytest.fixture(scope="module")
def case() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(21)
    w = rng.laplace(scale=0.05, size=(N, K)).astype(np.float32)
    w[5] = 0.0
    w[7, ::3] = -0.0
    w[9] *= np.float32(1e-35)
    cb = rng.integers(0, 128, size=(32, 3)).astype(np.uint8)
    return w, cb, quantize_s3d8_with_codebook(w, cb, name="case")


def test_container_matches_direct_quantisation(case) -> None:
    w, cb, container = case
    ints, alpha = direct_quantise(w, cb)
    w_int, alpha_c = decode_int8(container)
    assert np.array_equal(alpha_c, alpha)
    assert np.array_equal(w_int.astype(np.int16), ints)
    assert np.array_equal(dequantize_s3d8(container), alpha[:, None] * ints.astype(np.float32))


def test_negative_zero_is_stored_positive(case) -> None:
    w, cb, container = case
    w_int, _ = decode_int8(container)
    assert (w_int[7, ::3] >= 0).all()
    assert (w_int[5] >= 0).all()                                   # zero row: positive signs


@settings(max_examples=6, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([48, 248, 448]))
def test_grid_matrices_requantise_to_the_same_container(seed: int, n: int) -> None:
    """A canonical container whose rows all reach 127 alpha is a fixed point of dequantise -> quantise."""
    cb = pad_codebook()
    container = grid_container(n, cb, seed)
    again = quantize_s3d8_with_codebook(dequantize_s3d8(container), cb)
    assert np.array_equal(again, container)


def direct_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    q = np.zeros(x.shape, np.int8)
    s = np.zeros(x.shape[0], np.float32)
    for t, row in enumerate(x):
        s[t] = bf16(np.float32(np.abs(row).max()) / np.float32(127))
        inv = np.float32(0) if s[t] == 0 else np.float32(1) / s[t]
        for j, v in enumerate(row):
            r = float(np.float32(v * inv))
            fl = np.floor(r)
            rounded = fl + 1 if r - fl > 0.5 or (r - fl == 0.5 and fl % 2 == 1) else fl
            q[t, j] = int(min(127, max(-127, rounded)))
    return q, s


def test_activation_quantisation_rules() -> None:
    x = np.array([
        [127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5],        # s = 1: ties to even
        [0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],              # zero row: s = 0, all zero
        [1e30, -1e30, 1.0, -3e29, 0.0, 5e27, -5e27, 2e28],
        [127 * 2.0**-127 * 1.005, -(127 * 2.0**-127 * 1.005), 2.0**-130, 0, 0, 0, 0, 0],  # clamps at +/-127
    ], dtype=np.float32)
    q, s_bits = quantize_activations(x)
    eq, es = direct_activations(x)
    assert np.array_equal(q, eq)
    assert np.array_equal(s_bits, (es.view(np.uint32) >> 16).astype(np.uint16))
    assert q[0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert q[3, :2].tolist() == [127, -127] and s_bits[3] == 0x0040
    assert not q[1].any() and s_bits[1] == 0


def test_activation_scale_with_overflowing_reciprocal() -> None:
    # s = 2^-133 (bf16 subnormal): 1/s overflows to inf; nonzero entries saturate, zeros stay 0
    x = np.array([[127 * 2.0**-133, -(127 * 2.0**-133), 0.0, 0.0]], np.float32)
    q, s_bits = quantize_activations(x)
    assert s_bits[0] == 0x0001 and q[0].tolist() == [127, -127, 0, 0]


def test_activation_input_checks() -> None:
    with pytest.raises(S3D8InputError, match="'act'.*non-finite"):
        quantize_activations(np.array([[1.0, np.nan]], np.float32), name="act")
    with pytest.raises(S3D8InputError, match="2-D"):
        quantize_activations(np.ones(3, np.float32))


def independent_matmul(container: np.ndarray, x: np.ndarray) -> np.ndarray:
    r = read_container(container)
    cb = np.asarray(r.codebook).astype(np.int64)
    b = np.asarray(r.packed).astype(np.int64)
    s0, q, s1, s2 = b & 1, (b >> 1) & 31, (b >> 6) & 1, ((b >> 7) ^ b) & 1
    rows = []
    for d, s in enumerate((s0, s1, s2)):
        rows.append(np.where(s == 1, -cb[q, d], cb[q, d]))
    w_int = np.stack(rows, axis=1).reshape(-1, r.k)[: r.n]            # (n, k)
    alpha = (np.asarray(r.scales_bf16).astype(np.uint32) << 16).view(np.float32)
    xq, xs = direct_activations(x)
    y = np.zeros((x.shape[0], r.n), np.float32)
    for t in range(x.shape[0]):
        acc = w_int @ xq[t].astype(np.int64)
        assert np.abs(acc).max() < 2**31
        for i in range(r.n):
            y[t, i] = np.float32(np.float32(np.int32(acc[i])) * xs[t]) * alpha[i]
    return y


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 2, 3, 7]))
def test_reference_matmul_equals_independent_derivation(seed: int, m: int) -> None:
    rng = np.random.default_rng(seed)
    w = (rng.laplace(size=(N, K)) * np.exp(rng.uniform(-5, 5, size=(N, 1)))).astype(np.float32)
    x = (rng.laplace(size=(m, 64)) * np.exp(rng.uniform(-20, 20, size=(m, 1)))).astype(np.float32)
    x = np.tile(x, (1, K // 64))
    container = quantize_s3d8(w, seed=seed % 7)
    y = reference_matmul(container, x)
    assert y.dtype == np.float32 and y.shape == (m, N)
    assert np.array_equal(y.view(np.uint32), independent_matmul(container, x).view(np.uint32))


def test_reference_matmul_is_close_to_float_matmul(case) -> None:
    w, _, container = case
    x = np.random.default_rng(2).normal(size=(3, K)).astype(np.float32)
    y = reference_matmul(container, x)
    ref = x.astype(np.float64) @ dequantize_s3d8(container).astype(np.float64).T
    assert np.abs(y - ref).max() <= 0.02 * np.abs(ref).max()


def test_reference_matmul_checks_shapes(case) -> None:
    _, _, container = case
    with pytest.raises(S3D8InputError, match="'lin'.*shape"):
        reference_matmul(container, np.ones((2, K - 128), np.float32), name="lin")

"""qat.s3d8_torch and qat.ggml_torch compute what the numpy codec and gguf-py compute, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
import gguf_s3d8
from gguf_s3d8.assignment import nearest_centroid as np_nearest
from gguf_s3d8.scales import scales_to_fp32
from qat import ggml_torch, s3d8_torch
from qat.formats import s3d8_simulate


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _same(a: torch.Tensor | np.ndarray, b: np.ndarray) -> None:
    a = a.numpy() if isinstance(a, torch.Tensor) else a
    assert a.shape == b.shape
    diff = _bits(a) != _bits(b)
    assert not diff.any(), f"{int(diff.sum())} of {diff.size} values differ (bitwise), first at {np.argwhere(diff)[0]}"


def _adversarial(n: int, k: int, seed: int) -> np.ndarray:
    """Random weights with exact ties, zero and -0.0 rows/values, outliers and tiny rows."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    w[1] = 0.0
    w[2, : k // 2] = -0.0
    w[3] *= np.float32(1e-30)                      # subnormal-ish scale
    w[4, k // 2] = 5.0                                # outlier
    # rows with alpha == 1 exactly and half-integer values: many exact fp32 distance ties
    for r in range(5, min(n, 20)):
        w[r] = rng.integers(-254, 255, k).astype(np.float32) / 2
        w[r, 0] = 127.0
    return w


SHAPES_ELIGIBLE = [(48, 2048), (248, 2048), (448, 2048)]   # n % 3 = 0, 2, 1
SHAPES_OTHER = [(30, 96), (31, 200), (32, 130), (5, 7)]    # n % 3 = 0, 1, 2 (no container)


@pytest.mark.parametrize("n,k", SHAPES_ELIGIBLE)
def test_s3d8_matches_container(n: int, k: int) -> None:
    w = _adversarial(n, k, seed=n)
    rng = np.random.default_rng(n)
    zeros = rng.integers(0, 128, (32, 3)).astype(np.uint8) * (rng.random((32, 3)) < 0.7)  # -w' -> -0 entries
    for cb in (gguf_s3d8.fit_codebook(w, seed=1), zeros.astype(np.uint8)):
        want = gguf_s3d8.dequantize_s3d8(gguf_s3d8.quantize_s3d8_with_codebook(w, cb))
        _same(s3d8_torch.s3d8_dequantised(torch.from_numpy(w), torch.from_numpy(cb)), want)


@pytest.mark.parametrize("n,k", SHAPES_OTHER)
def test_s3d8_matches_codec_pieces(n: int, k: int) -> None:
    w = _adversarial(n, k, seed=k)
    cb = gguf_s3d8.fit_codebook(w, seed=0)
    want = s3d8_simulate(w, centroid_rule=gguf_s3d8.DEFAULT_CENTROID_RULE, seed=0) + np.float32(0)  # no -0
    _same(s3d8_torch.s3d8_dequantised(torch.from_numpy(w), torch.from_numpy(cb)), want)


def test_scales_and_nearest_centroid_ties() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 256)) * np.exp(rng.uniform(-40, 40, (64, 1)))).astype(np.float32)
    _same(s3d8_torch.absmax_scales(torch.from_numpy(x)), scales_to_fp32(gguf_s3d8.absmax_scale_bf16(x)))
    # integer and half-integer points around a codebook with duplicate centroids: exact ties everywhere
    cb = rng.integers(0, 128, (32, 3)).astype(np.uint8)
    cb[7] = cb[3]
    a0, a1, a2 = ((rng.integers(0, 256, 50_000) / 2).astype(np.float32) for _ in range(3))
    want = np_nearest(a0, a1, a2, cb)
    got = s3d8_torch.nearest_centroid(torch.from_numpy(a0), torch.from_numpy(a1), torch.from_numpy(a2),
                                      torch.from_numpy(cb))
    assert np.array_equal(got.numpy(), want.astype(np.int64))
    assert not (got.numpy() == 7).any()  # the duplicate never wins a tie


def test_activations_match_codec() -> None:
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((40, 384)) * np.exp(rng.uniform(-10, 10, (40, 1)))).astype(np.float32)
    x[0] = 0.0
    x[1, :5] = [127.5, -0.5, 1.5, 2.5, -2.5]       # halves round to even
    x[1, 5:] = 0.0
    x[2] *= np.float32(1e-38)                       # scale <= 2^-128: inv overflows (format §6)
    q, s_bits = gguf_s3d8.quantize_activations(x)
    tq, ts = s3d8_torch.quantize_activations(torch.from_numpy(x))
    assert np.array_equal(tq.numpy(), q.astype(np.float32))
    _same(ts, scales_to_fp32(s_bits))
    _same(s3d8_torch.fake_quant_activations(torch.from_numpy(x)),
          q.astype(np.float32) * scales_to_fp32(s_bits)[:, None])


def test_q8_0_matches_gguf_quants() -> None:
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((50, 192)) * 0.05).astype(np.float32)
    w[0] = 0.0
    w[1, :32] = np.arange(32, dtype=np.float32) - 15.5   # halves: round away from zero
    w[2, :32] = 1e-6
    Q8 = gguf.GGMLQuantizationType.Q8_0
    want = gguf.quants.dequantize(gguf.quants.quantize(w, Q8), Q8)
    _same(ggml_torch.q8_0_dequantised(torch.from_numpy(w)), want)
    with pytest.raises(ValueError):
        ggml_torch.q8_0_dequantised(torch.zeros(3, 33))


def test_fake_quant_cache_expires_trainable_weights_per_optimiser_step() -> None:
    """qat.student caches a fake-quantised weight per (parameter, version) and, for trainable weights, per
    optimiser step: FSDP2 refills its unsharded Parameters with each step's weights without bumping their
    version, so the step must expire them (weights_stepped); frozen weights stay cached."""
    from qat.student import WeightSpec, fake_quant_weight, weights_stepped

    spec = WeightSpec("w", "w", "q8_0", None, None)
    g = torch.Generator().manual_seed(0)
    trainable = torch.nn.Parameter(torch.randn(4, 64, generator=g))
    frozen = torch.nn.Parameter(torch.randn(4, 64, generator=g), requires_grad=False)
    before = {n: fake_quant_weight(w, spec).detach().clone() for n, w in (("t", trainable), ("f", frozen))}
    for w in (trainable, frozen):
        with torch.autograd._unsafe_preserve_version_counter(w):  # what FSDP2's all-gather does
            w.data.mul_(-2.0)
    for n, w in (("t", trainable), ("f", frozen)):  # same step: the cached value is reused
        assert torch.equal(fake_quant_weight(w, spec), before[n])
    weights_stepped()
    assert torch.equal(fake_quant_weight(trainable, spec), ggml_torch.q8_0_dequantised(trainable.detach()))
    assert not torch.equal(fake_quant_weight(trainable, spec), before["t"])
    assert torch.equal(fake_quant_weight(frozen, spec), before["f"])
    with torch.no_grad():
        trainable.add_(1.0)  # an in-place step (one process) bumps the version: no weights_stepped() needed
    assert torch.equal(fake_quant_weight(trainable, spec), ggml_torch.q8_0_dequantised(trainable.detach()))

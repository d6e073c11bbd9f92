"""bf16 round-to-nearest-even, absmax scales and normalisation (format sections 1 and 3)."""

from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_s3d8.bf16 import bf16_bits_to_fp32, bf16_is_finite, bf16_round, fp32_to_bf16_bits
from gguf_s3d8.scales import absmax_scale_bf16, normalise, row_absmax


def exact(bits32: int) -> Fraction:
    return Fraction(struct.unpack("<f", struct.pack("<I", bits32))[0])


def bf16_by_value(x: np.float32) -> int:
    """Independent RNE: compare the exact distances to the two bf16 neighbours of x (finite x)."""
    u = int(np.array([x], dtype=np.float32).view(np.uint32)[0])
    lo = u >> 16
    hi = lo + 1
    v = exact(u)
    d_lo = abs(v - exact(lo << 16))
    if (hi << 16) & 0x7F800000 == 0x7F800000:  # the next bf16 is infinite: distance to 2^128
        sign = -1 if u >> 31 else 1
        d_hi = abs(v - sign * Fraction(2) ** 128)
    else:
        d_hi = abs(v - exact(hi << 16))
    if d_lo < d_hi or (d_lo == d_hi and lo % 2 == 0):
        return lo
    return hi & 0xFFFF


@settings(max_examples=400, deadline=None)
@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_bf16_rounding_matches_exact_value_rounding(x: float) -> None:
    v = np.float32(x)
    assert int(fp32_to_bf16_bits(np.array([v]))[0]) == bf16_by_value(v)


@pytest.mark.parametrize(
    "value, expected",
    [
        (1.0, 0x3F80),
        (1.0 + 2.0**-8, 0x3F80),                # halfway, even neighbour is below
        (1.0 + 3 * 2.0**-8, 0x3F82),            # halfway, even neighbour is above
        (1.0 + 3 * 2.0**-9, 0x3F81),            # above halfway: up
        (-(1.0 + 3 * 2.0**-8), 0xBF82),
        (2.0**-127, 0x0040),                    # subnormal stays subnormal
        (2.0**-149, 0x0000),                    # smallest fp32 subnormal rounds to +0
        (-(2.0**-149), 0x8000),
        (float(np.finfo(np.float32).max), 0x7F80),  # rounds to +inf
        (0.0, 0x0000),
        (-0.0, 0x8000),
    ],
)
def test_bf16_known_values(value: float, expected: int) -> None:
    assert int(fp32_to_bf16_bits(np.array([value], dtype=np.float32))[0]) == expected


def test_bf16_nan_stays_nan_and_widening_is_exact() -> None:
    bits = fp32_to_bf16_bits(np.array([np.nan, np.inf, -np.inf], dtype=np.float32))
    assert np.isnan(bf16_bits_to_fp32(bits[:1]))[0]
    assert bits[1] == 0x7F80 and bits[2] == 0xFF80
    all_bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    wide = bf16_bits_to_fp32(all_bits)
    finite = bf16_is_finite(all_bits)
    assert np.array_equal(finite, np.isfinite(wide))
    # widening then rounding is the identity on every non-NaN pattern
    keep = ~np.isnan(wide)
    assert np.array_equal(fp32_to_bf16_bits(wide[keep]), all_bits[keep])


def test_bf16_matches_torch_if_available() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    ours = fp32_to_bf16_bits(x)
    theirs = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, theirs)


def test_absmax_scale_definition() -> None:
    rows = np.array([
        [0.0, -0.0, 0.0, 0.0],
        [-0.0, -0.0, -0.0, -0.0],
        [1.0, -127.0, 3.0, 0.5],
        [127.0 * (1 + 3 * 2.0**-8), 0.0, 0.0, 0.0],
        [1e-40, -3e-40, 0.0, 0.0],
    ], dtype=np.float32)
    bits = absmax_scale_bf16(rows)
    assert bits.dtype == np.uint16
    assert bits.tolist()[:4] == [0x0000, 0x0000, 0x3F80, 0x3F82]   # zero rows give +0, never -0
    assert bits[4] == 0                                             # 3e-40/127 is below bf16's range
    # fp32 division then RNE, element by element
    amax = row_absmax(rows)
    assert np.array_equal(bf16_round(amax / np.float32(127)), bf16_bits_to_fp32(bits))


def test_normalise_divides_in_fp32_and_zeroes_zero_scales() -> None:
    w = np.array([[3.0, -0.0, -1e-45], [5.0, -7.0, 1.0]], dtype=np.float32)
    alpha = np.array([1e30, 0.0], dtype=np.float32)
    out = normalise(w, alpha[:, None])
    assert out.dtype == np.float32
    assert out[0, 0] == np.float32(3.0) / np.float32(1e30)
    assert np.signbit(out[0, 2])                         # -1e-45 / 1e30 underflows to -0.0
    assert out[1].tolist() == [0.0, 0.0, 0.0] and not np.signbit(out[1]).any()

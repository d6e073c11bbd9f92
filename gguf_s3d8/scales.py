"""Absmax scales and normalisation (format sections 1 and 3).

The same scale rule serves weights (one scale per output row, ``alpha_i``) and activations (one scale per
token row, ``s``): ``bf16_rne(max_j |x_j| / 127)`` with the division done in fp32. Both callers go
through :func:`absmax_scale_bf16` so the two can never drift apart.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .bf16 import bf16_bits_to_fp32, fp32_to_bf16_bits
from .constants import SCALE_DIVISOR


def row_absmax(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``max_j |x_ij|`` per row of a 2-D fp32 array, always non-negative (an all ``-0.0`` row gives +0).

    Computed as max(|max|, |min|) so that no full-size ``abs`` temporary is made for huge matrices.
    """
    if rows.ndim != 2:
        raise ValueError(f"expected a 2-D array, got shape {rows.shape}")
    if rows.shape[1] == 0:
        return np.zeros(rows.shape[0], dtype=np.float32)
    hi = np.abs(rows.max(axis=1))
    lo = np.abs(rows.min(axis=1))
    return np.maximum(hi, lo).astype(np.float32, copy=False)


def absmax_scale_bf16(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """Per-row scale ``bf16_rne(max_j |x_ij| / 127)`` as bf16 bit patterns; all-zero rows give 0."""
    amax = row_absmax(rows)
    return fp32_to_bf16_bits(amax / np.float32(SCALE_DIVISOR))


def normalise(values: npt.NDArray[np.float32], scale: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``w' = W / alpha`` in fp32, and exactly +0 where ``alpha == 0`` (broadcasting ``scale`` over ``values``).

    A row whose scale rounded to zero (all zeros, or so tiny that ``max/127`` is below bf16's smallest
    subnormal) is normalised to +0 everywhere, hence quantised as zeros with positive signs.
    """
    v = np.asarray(values, dtype=np.float32)
    s = np.asarray(scale, dtype=np.float32)
    out = np.zeros(np.broadcast_shapes(v.shape, s.shape), dtype=np.float32)
    np.divide(v, s, out=out, where=(s != np.float32(0)))
    return out


def scales_to_fp32(scales_bf16: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """The fp32 value of stored bf16 scales (exact widening)."""
    return bf16_bits_to_fp32(scales_bf16)

"""Checks on what callers hand to the quantiser: a finite 2-D float matrix and a valid codebook."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .constants import CENTROID_MAX, N_CENTROIDS, VECTOR_DIM
from .errors import S3D8InputError


def as_weight_matrix(w: npt.ArrayLike, *, name: str = "") -> npt.NDArray[np.float32]:
    """Return ``w`` as a C-contiguous fp32 (n, k) array after checking rank, dtype and finiteness.

    Floating inputs of another width are converted to fp32 first (exact for fp16/bf16 sources).
    Non-finite values are rejected: their scale would be NaN/inf and the container unusable.
    """
    arr = np.asarray(w)
    if arr.ndim != 2:
        raise S3D8InputError(name, f"expected a 2-D weight matrix (n rows, k columns), got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise S3D8InputError(name, f"expected floating-point weights, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    check_finite(arr, name=name, what="weight")
    return arr


#: Elements checked per step, so that checking a 128256 x 4096 matrix needs no full-size mask.
_FINITE_CHUNK = 1 << 22


def check_finite(arr: npt.NDArray[np.floating], *, name: str, what: str) -> None:
    """Raise :class:`S3D8InputError` naming the tensor and the first non-finite element's position."""
    flat = arr.reshape(-1)
    for start in range(0, flat.size, _FINITE_CHUNK):
        finite = np.isfinite(flat[start:start + _FINITE_CHUNK])
        if not finite.all():
            first = np.unravel_index(start + int(np.argmin(finite)), arr.shape)
            pos = tuple(int(i) for i in first)
            count = int(flat.size - np.count_nonzero(np.isfinite(flat)))
            raise S3D8InputError(name, f"{count} non-finite {what} value(s), first {arr[pos]!r} at index {pos}")


def as_codebook(codebook: npt.ArrayLike, *, name: str = "") -> npt.NDArray[np.uint8]:
    """Validate a (32, 3) codebook of integers in 0..127 and return it as uint8."""
    c = np.asarray(codebook)
    if c.shape != (N_CENTROIDS, VECTOR_DIM):
        raise S3D8InputError(name, f"codebook must have shape ({N_CENTROIDS}, {VECTOR_DIM}), got {c.shape}")
    if np.issubdtype(c.dtype, np.floating):
        if not np.isfinite(c).all() or not np.array_equal(c, np.trunc(c)):
            raise S3D8InputError(name, "codebook entries must be integers")
    elif not np.issubdtype(c.dtype, np.integer):
        raise S3D8InputError(name, f"codebook must be integer, got dtype {c.dtype}")
    if c.size and (c.min() < 0 or c.max() > CENTROID_MAX):
        raise S3D8InputError(name, f"codebook entries must lie in 0..{CENTROID_MAX}, got {c.min()}..{c.max()}")
    return c.astype(np.uint8)

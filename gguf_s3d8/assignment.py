"""Nearest-centroid search, exactly as the format defines it (section 1).

``q = argmin_l  sum_d (C[l][d] - |w'_d|)^2`` evaluated in fp32, ties to the lowest ``l``. "In fp32" is
taken literally, with a fixed evaluation order that every implementation (C quantiser, torch QAT) must
copy to agree bit for bit::

    t_d  = fl(C[l][d] - a_d)            (fp32 subtraction, a_d = |w'_d|)
    sq_d = fl(t_d * t_d)                (fp32 product; no fused multiply-add anywhere)
    dist = fl(fl(sq_0 + sq_1) + sq_2)   (left to right)

and the running minimum is replaced only on a strict ``<``, so equal fp32 distances keep the lowest
index. Rounding can make two centroids tie in fp32 although one is nearer in exact arithmetic; the
lowest index then wins. The ``||a||^2 - 2 a.c + ||c||^2`` (matmul) formulation rounds differently and
is therefore not used.

The search streams over fixed-size chunks, so temporary memory is bounded whatever the matrix size.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

#: Elements per chunk: large enough to amortise numpy call overhead, small enough to stay in cache.
ASSIGN_CHUNK = 16384


def nearest_centroid(
    a0: npt.NDArray[np.floating],
    a1: npt.NDArray[np.floating],
    a2: npt.NDArray[np.floating],
    centroids: npt.ArrayLike,
    *,
    chunk: int = ASSIGN_CHUNK,
) -> npt.NDArray[np.uint8]:
    """Index of the nearest centroid for each point ``(a0, a1, a2)``, ties to the lowest index.

    ``a0, a1, a2`` are the (non-negative) components, arrays of one shape and one float dtype; the
    distance is computed in that dtype. The format's assignment uses fp32 (pass float32 arrays); codebook
    fitting reuses this routine in float64 on its training points. Returns uint8 of the same shape.
    """
    x0, x1, x2 = (np.asarray(a) for a in (a0, a1, a2))
    if not (x0.shape == x1.shape == x2.shape):
        raise ValueError(f"component shapes differ: {x0.shape}, {x1.shape}, {x2.shape}")
    dtype = x0.dtype
    if dtype not in (np.float32, np.float64) or x1.dtype != dtype or x2.dtype != dtype:
        raise TypeError(f"components must share one float32/float64 dtype, got {x0.dtype}, {x1.dtype}, {x2.dtype}")
    c = np.asarray(centroids)
    if c.ndim != 2 or c.shape[1] != 3 or not 1 <= c.shape[0] <= 256:
        raise ValueError(f"centroids must have shape (L, 3) with 1 <= L <= 256, got {c.shape}")
    c = c.astype(dtype)  # integer codebooks convert exactly
    n_centroids = c.shape[0]

    shape = x0.shape
    f0, f1, f2 = x0.reshape(-1), x1.reshape(-1), x2.reshape(-1)
    total = f0.size
    out = np.empty(total, dtype=np.uint8)
    size = max(1, min(chunk, total))
    d_buf = np.empty(size, dtype=dtype)
    t_buf = np.empty(size, dtype=dtype)
    best_buf = np.empty(size, dtype=dtype)
    lt_buf = np.empty(size, dtype=bool)
    for start in range(0, total, size):
        stop = min(total, start + size)
        m = stop - start
        p0, p1, p2 = f0[start:stop], f1[start:stop], f2[start:stop]
        d, t, best, lt = d_buf[:m], t_buf[:m], best_buf[:m], lt_buf[:m]
        idx = out[start:stop]
        for l in range(n_centroids):
            np.subtract(c[l, 0], p0, out=d)
            np.multiply(d, d, out=d)
            np.subtract(c[l, 1], p1, out=t)
            np.multiply(t, t, out=t)
            np.add(d, t, out=d)
            np.subtract(c[l, 2], p2, out=t)
            np.multiply(t, t, out=t)
            np.add(d, t, out=d)
            if l == 0:
                best[...] = d
                idx[...] = 0
            else:
                np.less(d, best, out=lt)
                np.copyto(idx, np.uint8(l), where=lt)
                np.minimum(best, d, out=best)
    return out.reshape(shape)


def centroid_distances(a: npt.NDArray[np.float32], centroids: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """All 32 fp32 distances of the points ``a`` (shape (..., 3)) in the normative evaluation order.

    Small-input helper for tests, golden-vector construction and diagnostics (memory grows with L).
    """
    p = np.asarray(a, dtype=np.float32)
    c = np.asarray(centroids).astype(np.float32)
    t = c[:, 0] - p[..., 0, None]
    d = t * t
    t = c[:, 1] - p[..., 1, None]
    d = d + t * t
    t = c[:, 2] - p[..., 2, None]
    return d + t * t

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


class CellAssigner:
    """Exact fast path for :func:`nearest_centroid` with a fixed integer codebook and fp32 points.

    Integer cells ``[i0, i0+1] x [i1, i1+1] x [i2, i2+1]`` (0 <= i < 128) are classified once per codebook,
    lazily as points arrive: a cell is *certain* when one centroid ``s`` beats every other centroid ``l``
    on the whole cell by a margin in exact arithmetic, i.e. the lower bound over the cell of the linear
    function ``d_l(a) - d_s(a) = 2 a.(c_s - c_l) + |c_l|^2 - |c_s|^2`` (an integer, computed exactly) is
    at least 1. The fp32 evaluation of a distance with ``a, c`` in [0, 128] is within ``5 * 2^-24 * 3 *
    128^2 < 0.015`` of the exact value, so in a certain cell ``s`` is also the strict fp32 minimum and
    hence exactly what :func:`nearest_centroid` returns.

    In an uncertain cell the same bound excludes every centroid ``l`` with bound >= 1 (it is strictly
    farther than ``s`` in fp32 everywhere in the cell, so it can neither win nor tie). When at most
    ``_MAX_CANDIDATES`` remain, points there are resolved among those candidates only, evaluated in
    ascending index order with the normative fp32 formula and a strict ``<`` (so ties still go to the
    lowest index). Points in cells with more candidates, or with a component >= 128 (possible when a scale
    rounded down to a bf16 subnormal; coordinate 128 is a permanently uncertain cell), go through
    :func:`nearest_centroid`. Tests compare both paths on adversarial data.
    """

    _GRID = 128
    _SIDE = _GRID + 1          # cell coordinate 128 collects every component >= 128
    _UNKNOWN = 0
    _CANDIDATES = 254          # uncertain cell with a short candidate list
    _UNCERTAIN = 255           # brute force over all 32 centroids
    _MAX_CANDIDATES = 4
    _BATCH = 1 << 14           # cells classified per step (bounds the (batch, 32) temporaries)
    _CHUNK = 1 << 15           # points per step (keeps the working set in cache)

    def __init__(self, codebook: npt.ArrayLike) -> None:
        c = np.asarray(codebook)
        if c.shape != (32, 3) or not np.issubdtype(c.dtype, np.integer) or c.min() < 0 or c.max() > 127:
            raise ValueError("CellAssigner needs a (32, 3) integer codebook with entries in 0..127")
        self.codebook = c.astype(np.uint8)
        ci = c.astype(np.int64)
        i = np.arange(self._GRID, dtype=np.int64)
        # squared distance (times 4) from cell centres i + 1/2 to the centroids, per dimension: (128, 32)
        self._centre = [((2 * i[:, None] + 1 - 2 * ci[None, :, d]) ** 2).astype(np.int32) for d in range(3)]
        # per dimension, min over a in [i, i+1] of 2 a (c_s - c_l): (128, 32 s, 32 l)
        self._lower = []
        for d in range(3):
            delta = ci[:, None, d] - ci[None, :, d]
            lo = np.minimum(2 * i[:, None, None] * delta, 2 * (i[:, None, None] + 1) * delta)
            self._lower.append(lo.astype(np.int32))
        norms = (ci**2).sum(axis=1)
        self._norm_diff = (norms[None, :] - norms[:, None]).astype(np.int32)   # [s, l] = |c_l|^2 - |c_s|^2
        side = self._SIDE
        state = np.zeros((side, side, side), dtype=np.uint8)                   # 0 unknown, s + 1, 255 uncertain
        state[self._GRID, :, :] = state[:, self._GRID, :] = state[:, :, self._GRID] = self._UNCERTAIN
        self._state = state.reshape(-1)
        self._candidates = np.zeros((side**3, self._MAX_CANDIDATES), dtype=np.uint8)  # sparse (calloc)
        self._c32 = self.codebook.astype(np.float32)

    def _classify(self, cells: npt.NDArray[np.intp]) -> None:
        side = self._SIDE
        for start in range(0, cells.size, self._BATCH):
            cell = cells[start:start + self._BATCH]
            i0, i1, i2 = cell // (side * side), (cell // side) % side, cell % side
            centre = self._centre[0][i0] + self._centre[1][i1] + self._centre[2][i2]
            s = centre.argmin(axis=1)
            bound = self._lower[0][i0, s] + self._lower[1][i1, s] + self._lower[2][i2, s] + self._norm_diff[s]
            bound[np.arange(cell.size), s] = np.iinfo(np.int32).max
            keep = bound < 1
            n_keep = keep.sum(axis=1)
            keep[np.arange(cell.size), s] = True
            state = np.where(n_keep == 0, s + 1,
                             np.where(n_keep < self._MAX_CANDIDATES, self._CANDIDATES, self._UNCERTAIN))
            self._state[cell] = state.astype(np.uint8)
            few = state == self._CANDIDATES
            if few.any():
                ranked = np.sort(np.where(keep[few], np.arange(32), 32), axis=1)[:, :self._MAX_CANDIDATES]
                # pad short lists by repeating their last candidate (an equal distance never wins on '<')
                last = ranked[np.arange(ranked.shape[0]), n_keep[few]]
                ranked = np.where(ranked == 32, last[:, None], ranked)
                self._candidates[cell[few]] = ranked.astype(np.uint8)

    def assign(self, a0: npt.NDArray[np.float32], a1: npt.NDArray[np.float32],
               a2: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Same result as ``nearest_centroid(a0, a1, a2, codebook)`` for fp32 components >= 0."""
        shape = np.shape(a0)
        x0, x1, x2 = (np.asarray(a, dtype=np.float32).reshape(-1) for a in (a0, a1, a2))
        out = np.empty(x0.size, dtype=np.uint8)
        for start in range(0, x0.size, self._CHUNK):
            sl = slice(start, start + self._CHUNK)
            out[sl] = self._assign_chunk(x0[sl], x1[sl], x2[sl])
        return out.reshape(shape)

    def _assign_chunk(self, x0: npt.NDArray[np.float32], x1: npt.NDArray[np.float32],
                      x2: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        side = np.int32(self._SIDE)
        top = np.float32(self._GRID)
        keys = np.minimum(x0, top).astype(np.int32)
        keys *= side
        keys += np.minimum(x1, top).astype(np.int32)
        keys *= side
        keys += np.minimum(x2, top).astype(np.int32)
        state = self._state.take(keys)
        if not state.all():                       # some cells not classified yet
            self._classify(np.unique(keys[state == self._UNKNOWN]).astype(np.intp))
            state = self._state.take(keys)
        out = state - np.uint8(1)
        few = state == self._CANDIDATES
        if few.any():
            out[few] = self._among_candidates(self._candidates[keys[few]], x0[few], x1[few], x2[few])
        slow = state == self._UNCERTAIN
        if slow.any():
            out[slow] = nearest_centroid(x0[slow], x1[slow], x2[slow], self.codebook)
        return out

    def _among_candidates(self, cand: npt.NDArray[np.uint8], x0: npt.NDArray[np.float32],
                          x1: npt.NDArray[np.float32], x2: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Nearest among per-point candidate lists (ascending), normative fp32 formula, strict '<'."""
        best_d = np.empty(x0.size, dtype=np.float32)
        best = cand[:, 0].copy()
        for j in range(cand.shape[1]):
            l = cand[:, j]
            t = self._c32[l, 0] - x0
            d = t * t
            t = self._c32[l, 1] - x1
            d += t * t
            t = self._c32[l, 2] - x2
            d += t * t
            if j == 0:
                best_d[...] = d
            else:
                better = d < best_d
                best[better] = l[better]
                np.minimum(best_d, d, out=best_d)
        return best

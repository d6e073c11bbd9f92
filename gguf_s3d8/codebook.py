"""Codebook fitting (format section 1): k-means++ then Lloyd on integer 3-vectors ``|rule(w')|``.

Training data are the 3-vectors of normalised weights (padding rows included, as in the authors' code),
made integer by the centroid rule — ``trunc`` (the reference code: truncate toward zero) or ``round``
(the paper: nearest, ties to even) — and clipped to 0..127. When a matrix has more than 2^20 vectors a
seeded random subsample of 2^20 is used.

Because the training points are integers in [0, 127]^3, identical points are merged into a weighted
histogram first; k-means (k-means++ sampling, Lloyd means, the changed-assignment fraction) on the
weighted unique points is exactly k-means on the multiset, only much faster, and it makes the result
independent of the order of the sample.

Lloyd keeps real-valued centroids (float64 means; empty clusters keep their previous value) and stops
when at most 1e-3 of the training assignments changed; the final centroids are made integer with the
same rule as the training points. All arithmetic is element-wise IEEE or exact integer sums (no BLAS,
no order-dependent float reductions), so the result is deterministic for a given seed.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .assignment import nearest_centroid
from .constants import (
    CENTROID_MAX,
    CENTROID_RULES,
    DEFAULT_CENTROID_RULE,
    FIT_CHANGE_THRESHOLD,
    FIT_MAX_ITERATIONS,
    FIT_SUBSAMPLE_VECTORS,
    N_CENTROIDS,
    VECTOR_DIM,
)
from .eligibility import n_triples
from .errors import S3D8InputError
from .inputs import as_weight_matrix
from .scales import absmax_scale_bf16, scales_to_fp32
from .triples import sampled_components, triple_components

F64 = npt.NDArray[np.float64]
_GRID = CENTROID_MAX + 1  # 128 integer levels per component
_TRIPLES_PER_CHUNK = 256


def check_centroid_rule(rule: str, *, name: str = "") -> str:
    """Return ``rule`` if it is ``"round"`` or ``"trunc"``, else raise naming the tensor."""
    if rule not in CENTROID_RULES:
        raise S3D8InputError(name, f"unknown centroid rule {rule!r}; expected one of {CENTROID_RULES}")
    return rule


def apply_centroid_rule(values: npt.ArrayLike, rule: str) -> npt.NDArray[np.floating]:
    """Make non-negative values integer by the centroid rule and clip them to 0..127.

    ``trunc`` truncates toward zero (floor, values being non-negative); ``round`` rounds to nearest, ties
    to even. Used for both the training vectors ``|w'|`` and the final centroids.
    """
    v = np.asarray(values)
    r = np.trunc(v) if rule == "trunc" else np.rint(v)
    return np.clip(r, 0, CENTROID_MAX)


def _point_keys(components: npt.NDArray[np.float32], rule: str) -> npt.NDArray[np.int64]:
    """Integer training points of (3, N) normalised components, encoded as ``(x0 * 128 + x1) * 128 + x2``."""
    ints = apply_centroid_rule(np.abs(components), rule).astype(np.int64)
    return (ints[0] * _GRID + ints[1]) * _GRID + ints[2]


def training_histogram(
    w: npt.NDArray[np.float32],
    rule: str,
    rng: np.random.Generator,
    max_vectors: int | None = FIT_SUBSAMPLE_VECTORS,
) -> tuple[F64, npt.NDArray[np.int64]]:
    """Unique integer training points (U, 3) and their multiplicities, from all vectors or a sample."""
    n, k = w.shape
    alpha = scales_to_fp32(absmax_scale_bf16(w))
    total = n_triples(n) * k
    hist = np.zeros(_GRID**VECTOR_DIM, dtype=np.int64)
    if max_vectors is not None and total > max_vectors:
        ids = np.sort(rng.choice(total, size=max_vectors, replace=False, shuffle=False)).astype(np.int64)
        hist += np.bincount(_point_keys(sampled_components(w, alpha, ids), rule), minlength=hist.size)
    else:
        for p0 in range(0, n_triples(n), _TRIPLES_PER_CHUNK):
            p1 = min(n_triples(n), p0 + _TRIPLES_PER_CHUNK)
            comps = triple_components(w, alpha, p0, p1).reshape(VECTOR_DIM, -1)
            hist += np.bincount(_point_keys(comps, rule), minlength=hist.size)
    keys = np.flatnonzero(hist)
    points = np.stack([keys // (_GRID * _GRID), (keys // _GRID) % _GRID, keys % _GRID], axis=1)
    return points.astype(np.float64), hist[keys]


def _squared_distance(points: F64, centroid: F64) -> F64:
    """Squared distances of (U, 3) points to one centroid, summed left to right."""
    t = points[:, 0] - centroid[0]
    d = t * t
    t = points[:, 1] - centroid[1]
    d += t * t
    t = points[:, 2] - centroid[2]
    d += t * t
    return d


def kmeans_plus_plus(points: F64, counts: npt.NDArray[np.int64], rng: np.random.Generator,
                     n_centroids: int = N_CENTROIDS) -> F64:
    """k-means++ seeding on weighted points: first centroid uniform over the multiset, each next one with
    probability proportional to count x squared distance to the nearest chosen centroid. If every point
    already coincides with a chosen centroid, the remaining slots repeat the first centroid."""
    cum = np.cumsum(counts)
    first = int(np.searchsorted(cum, rng.integers(0, int(cum[-1])), side="right"))
    chosen = [points[first]]
    d2 = _squared_distance(points, points[first])
    while len(chosen) < n_centroids:
        cw = np.cumsum(counts * d2)
        total = float(cw[-1])
        if total <= 0.0:
            break
        pick = int(np.searchsorted(cw, rng.random() * total, side="right"))
        pick = min(pick, len(points) - 1)
        chosen.append(points[pick])
        np.minimum(d2, _squared_distance(points, points[pick]), out=d2)
    while len(chosen) < n_centroids:
        chosen.append(chosen[0])
    return np.array(chosen, dtype=np.float64)


def lloyd(points: F64, counts: npt.NDArray[np.int64], centroids: F64, *,
          threshold: float = FIT_CHANGE_THRESHOLD, max_iterations: int = FIT_MAX_ITERATIONS) -> tuple[F64, int]:
    """Weighted Lloyd iterations; returns the real-valued centroids and the number of iterations run.

    Stops when the count-weighted fraction of changed assignments is <= ``threshold``; an empty cluster
    keeps its previous centroid. Means are exact integer sums divided once (float64).
    """
    c = centroids.copy()
    x0, x1, x2 = (np.ascontiguousarray(points[:, d]) for d in range(VECTOR_DIM))
    labels = nearest_centroid(x0, x1, x2, c)
    total = int(counts.sum())
    weights = counts.astype(np.float64)
    iterations = 0
    for iterations in range(1, max_iterations + 1):  # noqa: B007 (the count is returned after the loop)
        size = np.bincount(labels, weights=weights, minlength=len(c))
        sums = [np.bincount(labels, weights=weights * x, minlength=len(c)) for x in (x0, x1, x2)]
        occupied = size > 0
        for d in range(VECTOR_DIM):
            c[occupied, d] = sums[d][occupied] / size[occupied]
        new_labels = nearest_centroid(x0, x1, x2, c)
        changed = int(counts[new_labels != labels].sum())
        labels = new_labels
        if changed <= threshold * total:
            break
    return c, iterations


def fit_codebook(
    w: npt.ArrayLike,
    *,
    centroid_rule: str = DEFAULT_CENTROID_RULE,
    seed: int = 0,
    name: str = "",
    max_vectors: int | None = FIT_SUBSAMPLE_VECTORS,
) -> npt.NDArray[np.uint8]:
    """Fit the (32, 3) uint8 codebook of one matrix ``w`` (n rows, k columns). Deterministic per seed.

    ``max_vectors``: subsample size when the matrix has more 3-vectors (None: always use all).
    """
    rule = check_centroid_rule(centroid_rule, name=name)
    arr = as_weight_matrix(w, name=name)
    if arr.size == 0:
        raise S3D8InputError(name, f"cannot fit a codebook to an empty matrix of shape {arr.shape}")
    rng = np.random.default_rng(seed)
    points, counts = training_histogram(arr, rule, rng, max_vectors)
    init = kmeans_plus_plus(points, counts, rng)
    centroids, _ = lloyd(points, counts, init)
    return apply_centroid_rule(centroids, rule).astype(np.uint8)

"""The importance-aware S3D8 encoder ``iw1`` (docs/s3d8-format.md §1 "Encoder freedom"; docs/codec.md).

A post-training encoder that uses an importance matrix (``llama-imatrix``: the mean squared activation
of every input column j, ``u_j``) to minimise the error that matters for the layer's output,
``sum_ij u_j (W_ij - W~_ij)^2``, instead of the plain weight MSE of the reference encoder. The decoder,
container and kernels are untouched: only the encoder's free choices (codebook, scales, indices) change.
Without an imatrix the same search runs with a data-free importance from the columns' largest weights
(step 1).

Steps, one matrix (n rows, k columns; rows grouped in triples, padding rows zero):

1. **Integer column weights** ``v_j = max(1, rint(u_j * (2^16 / max_j u_j)))`` (float64 arithmetic). When
   there is no imatrix (or it is all zero) the weights come from the columns' largest weights instead,
   ``v_j = max(1, rint(r_j^4 * 2^16))`` with ``r_j = max_i |W_ij| / max_ij |W_ij|`` (:func:`column_max_weights`):
   a data-free importance that finds the few super-activation columns of an FFN down projection. Integer
   weights make every sum below exact, hence independent of summation order and thread count, and identical
   in C and numpy.
2. **Importance-weighted codebook fit**: the reference fit (format §1: absmax scales, training points
   ``rule(|w'|)`` over *all* 3-vectors, k-means++ then Lloyd) where the point of triple p, column j counts
   ``v_j`` times; it stops at <= 1e-2 of the weight changing cluster (``IMPORTANCE_FIT_CHANGE_THRESHOLD``).
   k-means++ draws from splitmix64 (seeded), Lloyd assigns in fp32 (``t = x - c``, ``d = (t0^2 + t1^2) + t2^2``, ties to the lowest
   index) and takes exact integer means: the same arithmetic as ``ggml_s3d8_fit_codebook`` in C (which skips
   provably unchanged points with Hamerly's bounds; that never changes a label).
3. **Per-triple scale search**: for a clip factor ``c_t = (50 - t) / 50`` (fp32), ``t`` in ``0 ..
   CLIP_STEPS-1``, the triple's three scales are ``bf16(fp32(absmax_i / 127) * c_t)``; every column takes the
   centroid with the least squared error *in weight space* ``sum_d (|W_dj| - alpha_d C[l][d])^2`` (fp32,
   same evaluation order, ties to the lowest index), and the triple's error is
   ``sum_j v_j * err_j`` accumulated left to right in float64. Coarse to fine: ``t = 0, 3, .., 18``
   (``CLIP_COARSE``), then the best of those, ``t*``, against ``t* - 1, t* + 1, t* - 2, t* + 2`` (those in
   range), in that order; a later ``t`` wins only with a strictly smaller error (so ties keep the coarse
   pass's lowest ``t``, the larger scale).
4. **Lloyd in weight space** (``WEIGHT_SPACE_ITERATIONS`` rounds): every column takes its best entry in
   weight space under the rounded codebook, then each centroid component becomes the importance-weighted
   least-squares value ``C[l][d] = sum v_j alpha_d |W_dj| / sum v_j alpha_d^2`` over the columns that chose
   it (float64 sums in the order triple by triple, column by column; an unused entry keeps its value);
   the codebook is the result rounded to the nearest integer (ties to even) in 0..127. Step 3 runs again
   with it; steps 4 and 3 run ``CODEBOOK_SCALE_CYCLES`` (3) times.
5. **Least-squares row scales** (:func:`least_squares_scales`): per triple, each row's scale becomes
   ``bf16(fp32(sum_j v_j C_jd |W_dj| / sum_j v_j C_jd^2))`` under the triple's current indices, the indices are
   chosen again, and the triple keeps the new scales only when its error drops; at most ``LEAST_SQUARES_ROUNDS``
   (3) rounds, stopping at the first that does not lower it. Unlike step 3's clip the three rows move apart.
   (Steps 4 x 3 and 5 were added on 2026-12-07: KLD of the quality anchors' ffn_down from 0.488-0.521 to
   0.472-0.473 on SmolLM2 and from 0.435-0.439 to 0.405-0.421 on Gemma-3-270M, docs/quality.md.)
6. **Encode**: the chosen scales, the codebook, each column's index from step 3's weight-space rule and the
   signs ``W < 0`` (rows whose scale is 0 store zeros with positive signs, as in the reference encoder).

Without an importance (None, or all zero) every step runs with the column-maximum weights of step 1. (Until
2026-12-03 the weights were uniform there and steps 3-4 were skipped - with uniform weights the clipped scales
and the weight-space Lloyd minimise the plain weight MSE, which made SmolLM2 worse: KLD 1.85 against 1.04 of the
reference encoder.) The column-maximum weights take SmolLM2 from KLD 1.06-1.71 (uniform weights, three k-means
seeds) to 0.51-0.61 over six seeds (docs/quality.md).

``llama-quantize --imatrix`` (``quantize_s3d8`` in ggml, patch ggml-add-GGML_TYPE_S3D8-type-traits-validation-and-q) runs the same algorithm; the two give
byte-identical containers (tests/python/test_codec_importance.py compares them on real tensors).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from .assignment import nearest_centroid
from .bf16 import bf16_round, fp32_to_bf16_bits
from .codebook import _squared_distance, apply_centroid_rule, check_centroid_rule
from .constants import (
    CENTROID_MAX,
    DEFAULT_CENTROID_RULE,
    FIT_CHANGE_THRESHOLD,
    FIT_MAX_ITERATIONS,
    N_CENTROIDS,
    SCALE_DIVISOR,
    VECTOR_DIM,
)
from .container import allocate_container
from .eligibility import n_triples
from .errors import S3D8InputError
from .inputs import as_codebook, as_weight_matrix
from .packing import pack_bytes
from .quantize import check_eligible
from .scales import normalise, scales_to_fp32

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
U8 = npt.NDArray[np.uint8]

#: Name of the algorithm (recorded by the converter's report and llama-quantize's log).
ALGORITHM = "iw1"
#: The largest column weight: importances are scaled so that the largest becomes this integer.
IMPORTANCE_SCALE = 1 << 16
#: Without an imatrix the column weights are the column maxima to this power (:func:`column_max_weights`).
COLUMN_MAX_POWER = 4
#: Clip factors searched per triple: c_t = (50 - t) / 50 for t = 0 .. CLIP_STEPS - 1 (1.00 down to 0.60).
CLIP_STEPS = 21
CLIP_DENOMINATOR = 50
#: Stride of the coarse pass of the scale search (t = 0, 3, .., 18; then t* -+ 1, t* -+ 2).
CLIP_COARSE = 3
#: With an importance the codebook fit stops when at most this fraction of the weight changes cluster.
IMPORTANCE_FIT_CHANGE_THRESHOLD = 1e-2
#: Lloyd iterations in weight space (step 4).
WEIGHT_SPACE_ITERATIONS = 5
#: Rounds of step 4 then step 3 (the codebook, then the scales under it).
CODEBOOK_SCALE_CYCLES = 3
#: Rounds of least-squares row scales (step 5) at most.
LEAST_SQUARES_ROUNDS = 3

_GRID = CENTROID_MAX + 1
_TRIPLES_PER_CHUNK = 64
# every exact-integer sum below stays under 2^53 when the total weight x 127 does
_EXACT_LIMIT = float(2**53)


def clip_factors(steps: int = CLIP_STEPS) -> F32:
    """The fp32 clip factors ``(50 - t) / 50`` of the scale search (fp32 division of small integers)."""
    t = np.arange(steps, dtype=np.float32)
    return (np.float32(CLIP_DENOMINATOR) - t) / np.float32(CLIP_DENOMINATOR)


def column_weights(importance: npt.ArrayLike | None, k: int, *, name: str = "") -> I64:
    """Integer column weights ``v_j`` (step 1) from an importance vector of length k, or all ones."""
    if importance is None:
        return np.ones(k, dtype=np.int64)
    u = np.asarray(importance, dtype=np.float32).reshape(-1)
    if u.size != k:
        raise S3D8InputError(name, f"importance has {u.size} values, the matrix has {k} columns")
    if not np.isfinite(u).all() or (u < 0).any():
        raise S3D8InputError(name, "importance values must be finite and non-negative")
    top = float(u.max()) if u.size else 0.0
    if not top > 0.0:
        return np.ones(k, dtype=np.int64)
    v = np.rint(u.astype(np.float64) * (float(IMPORTANCE_SCALE) / top))
    return np.maximum(v, 1.0).astype(np.int64)


def column_max_weights(w: F32) -> I64:
    """Integer column weights without an imatrix (step 1'): ``v_j = max(1, rint(r_j^P * 2^16))`` with
    ``r_j = max_i |W_ij| / max_ij |W_ij|`` (float64, ``r^P`` as the product ``r * r * .. * r`` left to right),
    ``P = COLUMN_MAX_POWER``; all ones for an all-zero matrix.

    A data-free stand-in for the imatrix: an FFN's down projection reads a few "super-activation" columns that
    are huge on some tokens, and the weights of those columns (which write the model's massive residual
    dimension) are the largest of the matrix, 20-30 standard deviations against 10-15 for the other columns'
    largest (SmolLM2, docs/quality.md). Weighting the codebook fit by them keeps those columns exact.
    """
    k = w.shape[1]
    colmax = (np.maximum(w.max(axis=0), -w.min(axis=0)) if w.shape[0] else np.zeros(k, np.float32)).astype(np.float64)
    top = float(colmax.max()) if k else 0.0
    if not top > 0.0:
        return np.ones(k, dtype=np.int64)
    r = colmax / top
    x = r.copy()
    for _ in range(COLUMN_MAX_POWER - 1):
        x = x * r
    return np.maximum(np.rint(x * float(IMPORTANCE_SCALE)), 1.0).astype(np.int64)


class SplitMix64:
    """splitmix64 (the generator of ggml's S3D8 fitter): ``next()`` and ``uniform()`` in [0, 1)."""

    _MASK = (1 << 64) - 1

    def __init__(self, seed: int) -> None:
        self.state = int(seed) & self._MASK

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & self._MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
        return z ^ (z >> 31)

    def uniform(self) -> float:
        return float(self.next() >> 11) * (1.0 / 9007199254740992.0)


def _padded_triples(w: F32, p0: int, p1: int) -> F32:
    """Rows of triples p0..p1-1 as (p1-p0, 3, k), padding rows zero."""
    n, k = w.shape
    out = np.zeros(((p1 - p0) * VECTOR_DIM, k), dtype=np.float32)
    r0, r1 = VECTOR_DIM * p0, min(n, VECTOR_DIM * p1)
    if r1 > r0:
        out[: r1 - r0] = w[r0:r1]
    return out.reshape(p1 - p0, VECTOR_DIM, k)


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    total = n_triples(n)
    for p0 in range(0, total, _TRIPLES_PER_CHUNK):
        yield p0, min(total, p0 + _TRIPLES_PER_CHUNK)


def weighted_histogram(w: F32, alpha: F32, weights: I64, rule: str) -> tuple[F64, I64]:
    """Unique integer training points (U, 3) and their total weights (step 2's training set)."""
    k = w.shape[1]
    hist = np.zeros(_GRID**VECTOR_DIM, dtype=np.float64)
    wf = weights.astype(np.float64)
    for p0, p1 in _chunks(w.shape[0]):
        wn = normalise(np.abs(_padded_triples(w, p0, p1)), alpha[p0:p1, :, None])
        ints = apply_centroid_rule(wn, rule).astype(np.int64)
        keys = (ints[:, 0] * _GRID + ints[:, 1]) * _GRID + ints[:, 2]
        hist += np.bincount(keys.reshape(-1), weights=np.broadcast_to(wf, (p1 - p0, k)).reshape(-1),
                            minlength=hist.size)
    keys = np.flatnonzero(hist)
    points = np.stack([keys // (_GRID * _GRID), (keys // _GRID) % _GRID, keys % _GRID], axis=1)
    return points.astype(np.float64), hist[keys].astype(np.int64)


def kmeans_plus_plus_splitmix(points: F64, counts: I64, rng: SplitMix64) -> F64:
    """k-means++ seeding with splitmix64 draws, in the C fitter's order of operations."""
    total = int(counts.sum())
    r = rng.next() % total
    first = min(int(np.searchsorted(np.cumsum(counts), r, side="right")), len(points) - 1)
    chosen = [points[first]]
    d2 = _squared_distance(points, points[first])
    cf = counts.astype(np.float64)
    while len(chosen) < N_CENTROIDS:
        cw = np.cumsum(cf * d2)
        tot = float(cw[-1])
        if not tot > 0.0:
            break
        x = rng.uniform() * tot
        pick = min(int(np.searchsorted(cw, x, side="right")), len(points) - 1)
        chosen.append(points[pick])
        np.minimum(d2, _squared_distance(points, points[pick]), out=d2)
    while len(chosen) < N_CENTROIDS:
        chosen.append(chosen[0])
    return np.array(chosen, dtype=np.float64)


def lloyd_fp32(points: F64, counts: I64, centroids: F64, *, threshold: float = FIT_CHANGE_THRESHOLD,
               max_iterations: int = FIT_MAX_ITERATIONS) -> F64:
    """Lloyd iterations with fp32 assignment and exact integer means (the C fitter's arithmetic)."""
    c = centroids.copy()
    x = [np.ascontiguousarray(points[:, d], dtype=np.float32) for d in range(VECTOR_DIM)]
    xi = [points[:, d].astype(np.float64) for d in range(VECTOR_DIM)]
    total = int(counts.sum())
    if float(total) * CENTROID_MAX >= _EXACT_LIMIT:
        raise ValueError("total training weight too large for exact sums")
    weights = counts.astype(np.float64)
    labels = nearest_centroid(x[0], x[1], x[2], c.astype(np.float32))
    for _ in range(max_iterations):
        size = np.bincount(labels, weights=weights, minlength=N_CENTROIDS)
        occupied = size > 0
        for d in range(VECTOR_DIM):
            s = np.bincount(labels, weights=weights * xi[d], minlength=N_CENTROIDS)
            c[occupied, d] = s[occupied] / size[occupied]
        new = nearest_centroid(x[0], x[1], x[2], c.astype(np.float32))
        changed = int(counts[new != labels].sum())
        labels = new
        if changed <= threshold * total:
            break
    return c


def fit_codebook_weighted(w: F32, alpha: F32, weights: I64, *, rule: str, seed: int,
                          threshold: float = FIT_CHANGE_THRESHOLD) -> U8:
    """Step 2: the (32, 3) codebook fitted on ``rule(|W| / alpha)``, each point weighted by its column."""
    points, counts = weighted_histogram(w, alpha, weights, rule)
    init = kmeans_plus_plus_splitmix(points, counts, SplitMix64(seed))
    return apply_centroid_rule(lloyd_fp32(points, counts, init, threshold=threshold), rule).astype(np.uint8)


def assign_weight_space(a: F32, alpha: F32, cb32: F32) -> tuple[U8, F32]:
    """Nearest centroid in weight space for (P, 3, k) ``|W|`` and (P, 3) scales: indices and errors (fp32,
    ``d = ((a0 - alpha0 C0)^2 + (a1 - alpha1 C1)^2) + (a2 - alpha2 C2)^2``, ties to the lowest index)."""
    best = np.empty(a.shape[::2], dtype=np.float32)
    q = np.zeros(best.shape, dtype=np.uint8)
    d = np.empty_like(best)
    t = np.empty_like(best)
    for l in range(N_CENTROIDS):
        np.subtract(a[:, 0], alpha[:, 0, None] * cb32[l, 0], out=d)
        np.multiply(d, d, out=d)
        for dim in (1, 2):
            np.subtract(a[:, dim], alpha[:, dim, None] * cb32[l, dim], out=t)
            np.multiply(t, t, out=t)
            np.add(d, t, out=d)
        if l == 0:
            best[...] = d
        else:
            better = d < best
            q[better] = l
            np.minimum(best, d, out=best)
    return q, best


def weight_space_values(w: npt.ArrayLike, alpha: npt.ArrayLike, codebook: npt.ArrayLike) -> F32:
    """The values an S3D8 container with this ``codebook`` and row scales ``alpha`` (n,) (fp32 values of bf16
    numbers) stores for fp32 columns ``w`` (n, c) when each triple takes its nearest entry *in weight space*
    (:func:`assign_weight_space`) and the signs of ``w``: ``alpha_i * (+-C)``, exactly what
    :func:`gguf_s3d8.dequantize_s3d8` returns for such a container (+0 for zero codes and zero scales).

    GPTQ (``qat.gptq_s3d8``) quantises one column at a time with it; re-encoding the result with
    ``quantize_s3d8_with_codebook(values, codebook, scales_bf16=...)`` reproduces it bit for bit.
    """
    arr = np.ascontiguousarray(w, dtype=np.float32)
    n, c = arr.shape
    al = _padded_scales(alpha)
    cb32 = np.asarray(codebook, dtype=np.uint8).astype(np.float32)
    rows = _padded_triples(arr, 0, al.shape[0])
    q, _ = assign_weight_space(np.abs(rows), al, cb32)
    mag = cb32[q].transpose(0, 2, 1)  # (P, 3, c)
    signed = np.where((rows < 0) & (al[:, :, None] != 0), -mag, mag) + np.float32(0.0)  # int8 codes have no -0
    return (al[:, :, None] * signed).reshape(-1, c)[:n]


def _triple_error(err: F32, weights: I64) -> F64:
    """``sum_j v_j err_j`` per triple, accumulated left to right in float64 (as the C loop does)."""
    return np.cumsum(err.astype(np.float64) * weights.astype(np.float64), axis=1)[:, -1]


def base_scales(w: F32) -> F32:
    """``fp32(absmax_i / 127)`` per row, as (P, 3) over the padded triples (padding rows 0)."""
    n = w.shape[0]
    amax = np.zeros(n_triples(n) * VECTOR_DIM, dtype=np.float32)
    # max |w| without a full-size |w| temporary (max(max w, -min w)); + 0.0 turns the -0.0 of an all-zero row into +0
    amax[:n] = np.maximum(w.max(axis=1), -w.min(axis=1)) + np.float32(0.0) if w.shape[1] else 0
    return (amax / np.float32(SCALE_DIVISOR)).reshape(-1, VECTOR_DIM)


def clip_search_order(steps: int = CLIP_STEPS, coarse: int = CLIP_COARSE) -> tuple[list[int], list[int]]:
    """The scale search's clip steps: the coarse pass ``t = 0, coarse, ..`` and the offsets from its best
    ``t*`` tried afterwards, in order (``-1, +1, -2, +2, ..``)."""
    offsets = [sign * d for d in range(1, coarse) for sign in (-1, 1)]
    return list(range(0, steps, coarse)), offsets


def search_scales(w: F32, base: F32, codebook: U8, weights: I64, steps: int = CLIP_STEPS) -> tuple[F32, F64]:
    """Step 3: per triple, the clipped bf16 scales (P, 3) with the least importance-weighted error, and that
    error (P,)."""
    factors = clip_factors(steps)
    coarse, offsets = clip_search_order(steps)
    cb32 = codebook.astype(np.float32)
    out = np.empty_like(base)
    errors = np.empty(base.shape[0], dtype=np.float64)
    for p0, p1 in _chunks(w.shape[0]):
        a = np.abs(_padded_triples(w, p0, p1))
        best_e = np.full(p1 - p0, np.inf)
        best_t = np.zeros(p1 - p0, dtype=np.int64)

        # called only within this iteration, so the loop variables it reads are the current ones (B023)
        def consider(t: I64, valid: npt.NDArray[np.bool_], coarse_pass: bool) -> None:
            alpha = bf16_round(base[p0:p1] * factors[np.clip(t, 0, steps - 1)][:, None])  # noqa: B023
            _, err = assign_weight_space(a, alpha, cb32)  # noqa: B023
            e = _triple_error(err, weights)
            better = valid & (e < best_e)  # noqa: B023
            out[p0:p1][better] = alpha[better]  # noqa: B023
            best_e[better] = e[better]  # noqa: B023
            if coarse_pass:
                best_t[better] = t[better]  # noqa: B023

        everywhere = np.ones(p1 - p0, dtype=bool)
        for t in coarse:
            consider(np.full(p1 - p0, t, dtype=np.int64), everywhere, True)
        t_star = best_t.copy()
        for off in offsets:
            t = t_star + off
            consider(t, (t >= 0) & (t < steps), False)
        errors[p0:p1] = best_e
    return out, errors


def _error_and_sums(a: F32, alpha: F32, cb32: F32, weights: I64) -> tuple[F64, F64, F64]:
    """Per triple of ``a`` (P, 3, k), under the scales ``alpha`` (P, 3): the importance-weighted error (as step 3
    sums it) and each row's least-squares sums under the chosen entries, ``num = sum_j v_j C_jd |W_dj|`` and
    ``den = sum_j v_j C_jd^2`` (P, 3) (float64, left to right)."""
    q, err = assign_weight_space(a, alpha, cb32)
    cb64 = cb32.astype(np.float64)
    wf = weights.astype(np.float64)
    num = np.empty(alpha.shape, dtype=np.float64)
    den = np.empty(alpha.shape, dtype=np.float64)
    for d in range(VECTOR_DIM):
        c = cb64[q, d]  # (P, k)
        vc = wf[None, :] * c
        num[:, d] = np.cumsum(vc * a[:, d].astype(np.float64), axis=1)[:, -1]
        den[:, d] = np.cumsum(vc * c, axis=1)[:, -1]
    return _triple_error(err, weights), num, den


def least_squares_scales(w: F32, alpha: F32, codebook: U8, weights: I64,
                         rounds: int = LEAST_SQUARES_ROUNDS) -> tuple[F32, F64]:
    """Step 5: per triple, each row's importance-weighted least-squares scale under the triple's current indices,
    ``bf16(fp32(sum_j v_j C_jd |W_dj| / sum_j v_j C_jd^2))`` (float64 sums left to right; a zero scale or no
    nonzero entry keeps the scale); the triple keeps the new scales only when its error drops, and stops at the
    first round that does not lower it. The pass that measures a round's error also gives the next round's sums.
    Returns the (P, 3) scales and each triple's error under them."""
    cb32 = codebook.astype(np.float32)
    out = alpha.copy()
    errors = np.empty(alpha.shape[0], dtype=np.float64)
    for p0, p1 in _chunks(w.shape[0]):
        a = np.abs(_padded_triples(w, p0, p1))
        al = out[p0:p1].copy()
        best, num, den = _error_and_sums(a, al, cb32, weights)
        active = np.ones(p1 - p0, dtype=bool)
        for _ in range(rounds):
            ok = (den > 0) & (al != 0)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = (num / np.where(ok, den, 1.0)).astype(np.float32)
            new = np.where(ok, bf16_round(ratio), al)
            e, num, den = _error_and_sums(a, new, cb32, weights)
            take = active & (e < best)
            al[take] = new[take]
            best[take] = e[take]
            active = take
            if not active.any():
                break
        out[p0:p1] = al
        errors[p0:p1] = best
    return out, errors


def refine_codebook_weight_space(w: F32, alpha: F32, codebook: U8, weights: I64,
                                 iterations: int = WEIGHT_SPACE_ITERATIONS) -> U8:
    """Step 4: Lloyd iterations on the importance-weighted error in weight space, scales fixed."""
    c = codebook.astype(np.float64)
    wf = weights.astype(np.float64)
    for _ in range(iterations):
        cb32 = apply_centroid_rule(c, "round").astype(np.uint8).astype(np.float32)
        num = np.zeros((N_CENTROIDS, VECTOR_DIM))
        den = np.zeros((N_CENTROIDS, VECTOR_DIM))
        for p0, p1 in _chunks(w.shape[0]):
            a = np.abs(_padded_triples(w, p0, p1))
            al = alpha[p0:p1]
            q, _ = assign_weight_space(a, al, cb32)
            labels = q.reshape(-1)
            for d in range(VECTOR_DIM):
                ald = al[:, d, None].astype(np.float64)
                num[:, d] += np.bincount(labels, weights=((wf[None, :] * ald) * a[:, d]).reshape(-1),
                                         minlength=N_CENTROIDS)
                den[:, d] += np.bincount(labels, weights=(wf[None, :] * (ald * ald)).reshape(-1),
                                         minlength=N_CENTROIDS)
        ok = den > 0
        c[ok] = num[ok] / den[ok]
    return apply_centroid_rule(c, "round").astype(np.uint8)


def quantize_s3d8_importance(w: npt.ArrayLike, importance: npt.ArrayLike | None = None, *, name: str = "",
                             centroid_rule: str = DEFAULT_CENTROID_RULE, seed: int = 0) -> U8:
    """Encode ``w`` (n, k) with the ``iw1`` algorithm; returns the container (n, 43k/128) uint8.

    ``importance``: the imatrix entry of this matrix (k values, or (E, k) for a 3-D stack (E, n, k));
    None = uniform. A 3-D stack gives one container per slice.
    """
    if np.ndim(w) == 3:
        stack = np.asarray(w)
        imp = None if importance is None else np.asarray(importance).reshape(stack.shape[0], -1)
        return np.stack([quantize_s3d8_importance(ws, None if imp is None else imp[e], name=f"{name}[{e}]",
                                                  centroid_rule=centroid_rule, seed=seed)
                         for e, ws in enumerate(stack)])
    rule = check_centroid_rule(centroid_rule, name=name)
    arr = as_weight_matrix(w, name=name)
    n, k = arr.shape
    check_eligible(n, k, name=name)
    weights = column_weights(importance, k, name=name)
    if importance is None or not np.asarray(importance, dtype=np.float32).max() > 0:
        weights = column_max_weights(arr)
    base = base_scales(arr)
    alpha = bf16_round(base)
    codebook = fit_codebook_weighted(arr, alpha, weights, rule=rule, seed=seed, threshold=IMPORTANCE_FIT_CHANGE_THRESHOLD)
    alpha, _ = search_scales(arr, base, codebook, weights)
    for _ in range(CODEBOOK_SCALE_CYCLES):
        codebook = refine_codebook_weight_space(arr, alpha, codebook, weights)
        alpha, _ = search_scales(arr, base, codebook, weights)
    alpha, _ = least_squares_scales(arr, alpha, codebook, weights)
    return _encode_weight_space(arr, alpha, codebook, name)


def _encode_weight_space(arr: F32, alpha: F32, codebook: U8, name: str) -> U8:
    """Step 6: the container of ``arr`` under the (P, 3) scales and the codebook (weight-space indices)."""
    n, k = arr.shape
    scales = fp32_to_bf16_bits(alpha.reshape(-1)[:n])
    container, body = allocate_container(k, n, codebook, scales, name=name)
    cb32 = codebook.astype(np.float32)
    for p0, p1 in _chunks(n):
        rows = _padded_triples(arr, p0, p1)
        q, _ = assign_weight_space(np.abs(rows), alpha[p0:p1], cb32)
        neg = rows < 0
        zero = alpha[p0:p1] == 0
        neg[zero] = False
        body[p0:p1] = pack_bytes(q, neg[:, 0], neg[:, 1], neg[:, 2])
    return container


def quantize_s3d8_with_scales(w: npt.ArrayLike, codebook: npt.ArrayLike, scales_bf16: npt.ArrayLike, *,
                              name: str = "") -> U8:
    """Encode ``w`` (n, k) with a given (32, 3) codebook and row scales (n,) (bf16 bit patterns, uint16): iw1's
    step 6 (indices by the weight-space rule, signs of ``w``). Returns the container (n, 43k/128).

    For values that such a container stores (``alpha_i * (+-C)``, e.g. a GPTQ result, :func:`weight_space_values`)
    this gives back the same values bit for bit: their own entry is at distance 0.
    """
    arr = as_weight_matrix(w, name=name)
    n, k = arr.shape
    check_eligible(n, k, name=name)
    cb = as_codebook(codebook, name=name)
    sc = np.asarray(scales_bf16)
    if sc.shape != (n,) or sc.dtype != np.uint16:
        raise S3D8InputError(name, f"scales must be {n} bf16 bit patterns (uint16), got {sc.dtype} {sc.shape}")
    alpha = scales_to_fp32(sc)
    if not np.all(np.isfinite(alpha)) or np.any(sc & 0x8000):
        raise S3D8InputError(name, "scales must be finite and non-negative (no -0)")
    return _encode_weight_space(arr, _padded_scales(alpha), cb, name)


def _padded_scales(alpha: npt.ArrayLike) -> F32:
    """Row scales (n,) as (P, 3) over the padded triples (padding rows 0)."""
    a = np.asarray(alpha, dtype=np.float32)
    out = np.zeros(n_triples(a.shape[0]) * VECTOR_DIM, dtype=np.float32)
    out[: a.shape[0]] = a
    return out.reshape(-1, VECTOR_DIM)

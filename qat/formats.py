"""Fake-quantised weight formats (baselines of the paper, plus S3D8) with exact bits/param accounting.

Every format is a small frozen dataclass with

* ``quantise(w) -> w_hat``: the dequantised ("fake-quantised") weights, same shape, float32. Rows are
  output channels, the last axis is the input dimension k (the axis blocks run along). Pure function of
  ``w`` (deterministic); it has no gradient of its own - QAT wraps it in a straight-through estimator.
* ``bits_per_param(shape) -> float``: stored bits of one matrix of that shape divided by its element
  count, counting codes, scales and tables (see each class for the storage assumption).

Formats (reference-recipe section 8; "OWF" = the authors' optimal-weight-formats code):

* :class:`IntFormat` - K-level integers with one bf16 absmax scale per block of G inputs.
* :class:`StudentTFormat` - K-level cube-root-density (CRD) quantiser of a Student-t truncated at the
  expected block maximum, block-absmax bf16 scales; df and a scale multiplier fitted per tensor (min RMSE).
* :class:`LloydMaxFormat` - one K-level scalar table per matrix fitted by Lloyd-Max (1-D k-means) on the
  per-output-channel absmax-normalised weights.
* :class:`S3D8Format` - the project's S3D8 codec (``gguf_s3d8``), called as is (never re-implemented).

Element-bit accounting. A K-level code carries log2(K) bits of information; the formats here are costed
at exactly log2(K) bits per element, i.e. assuming the codes are packed in base K (e.g. for K = 6, five
codes in 13 bits = 2.600 bits, 53 codes in 137 bits = 2.585 bits; plain 3-bit fields would cost 3).
This is also how the paper's bits/param column counts INT K=6 (log2 6 + 16/128 = 2.71). Scales are bf16
(16 bits); per-matrix tables count 16 bits per entry (they are tiny either way).

The 1-D scalar searches work on sorted values with prefix sums: for a quantiser that is a monotone
step function, the squared error of every candidate table and a Lloyd-Max update are exact sums over
contiguous ranges of the sorted data, so a full-tensor search costs one sort plus O(K log N) per
candidate instead of a pass over the tensor per candidate. Sums are float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import torch

__all__ = [
    "WeightFormat",
    "IntFormat",
    "StudentTFormat",
    "LloydMaxFormat",
    "S3D8Format",
    "bf16_rne",
    "int_range",
    "sqnr_db",
    "crd_t_table",
    "expected_block_max_t",
]

SCALE_BITS = 16  # bf16 scales
TABLE_ENTRY_BITS = 16  # per-matrix look-up tables (bf16 entries)


@runtime_checkable
class WeightFormat(Protocol):
    """What the quality report and QAT need from a format."""

    @property
    def name(self) -> str: ...

    def quantise(self, w: torch.Tensor) -> torch.Tensor: ...

    def bits_per_param(self, shape: Sequence[int]) -> float: ...


# ---------------------------------------------------------------------------------------------------
# helpers


def bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to the nearest bfloat16 (ties to even) and return it as float32.

    torch's float32 -> bfloat16 cast rounds to nearest even, as ggml's ``GGML_FP32_TO_BF16`` does.
    """
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32)


def sqnr_db(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """Reconstruction SQNR in dB: 10 log10(sum w^2 / sum (w - w_hat)^2), accumulated in float64."""
    w64 = w.to(torch.float64)
    err = (w64 - w_hat.to(torch.float64)).square().sum().item()
    sig = w64.square().sum().item()
    if err == 0.0:
        return math.inf
    return 10.0 * math.log10(sig / err)


def int_range(levels: int) -> tuple[int, int]:
    """Integer code range of K levels, OWF's "asymmetric" IntFormat: (-h - [2h+1 < K], h), h = (K-1)//2.

    K=6 -> (-3, 2); K=8 -> (-4, 3); K=5 -> (-2, 2).
    """
    if levels < 2:
        raise ValueError(f"need at least 2 levels, got {levels}")
    h = (levels - 1) // 2
    return -h - int(2 * h + 1 < levels), h


def _as_matrix(w: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """(rows, k) float32 view of a weight of rank >= 1 (leading axes flattened into rows)."""
    if w.ndim == 0:
        raise ValueError("cannot quantise a scalar")
    shape = w.shape
    return w.detach().to(torch.float32).reshape(-1, shape[-1]), shape


def _blocked_absmax_scales(m: torch.Tensor, block: int | None, divisor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 absmax scales of blocks of ``block`` inputs (None: one per row) and the normalised values.

    Returns (scale per element (rows, k), normalised values u = m / scale, 0 where the scale is 0).
    A trailing partial block (k not a multiple of G) gets its own scale.
    """
    rows, k = m.shape
    g = k if block is None else block
    nb = -(-k // g)
    padded = torch.nn.functional.pad(m, (0, nb * g - k)) if nb * g != k else m
    amax = padded.abs().reshape(rows, nb, g).amax(dim=-1, keepdim=True)
    scale = bf16_rne(amax / divisor)
    scale_el = scale.expand(rows, nb, g).reshape(rows, nb * g)[:, :k]
    u = torch.where(scale_el == 0, torch.zeros_like(m), m / torch.where(scale_el == 0, torch.ones_like(scale_el), scale_el))
    return scale_el, u


def _blocks_bits(k: int, block: int | None) -> float:
    """Scale bits per element for one bf16 scale per block of G inputs (ragged last block counted)."""
    g = k if block is None else block
    return SCALE_BITS * (-(-k // g)) / k


class _SortedData:
    """Values sorted once, with float64 prefix sums of w, w*u and w*u^2 for exact range sums."""

    def __init__(self, u: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        uf = u.reshape(-1).to(torch.float64)
        order = torch.argsort(uf, stable=True)
        self.u = uf[order].contiguous()
        wt = torch.ones_like(self.u) if weight is None else weight.reshape(-1).to(torch.float64)[order]
        zero = torch.zeros(1, dtype=torch.float64)
        self.c0 = torch.cat([zero, torch.cumsum(wt, 0)])
        self.c1 = torch.cat([zero, torch.cumsum(wt * self.u, 0)])
        self.c2 = torch.cat([zero, torch.cumsum(wt * self.u * self.u, 0)])
        self.n = self.u.numel()

    def cuts(self, boundaries: torch.Tensor) -> torch.Tensor:
        """Bucket edges in sorted order: element i is in bucket j iff cuts[j] <= i < cuts[j+1].

        Matches ``torch.bucketize(x, boundaries)`` (right=False): x equal to a boundary goes to the
        lower bucket.
        """
        inner = torch.searchsorted(self.u, boundaries.to(torch.float64), right=True)
        return torch.cat([torch.zeros(1, dtype=torch.long), inner, torch.tensor([self.n])])

    def range_sums(self, cuts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lo, hi = cuts[:-1], cuts[1:]
        return self.c0[hi] - self.c0[lo], self.c1[hi] - self.c1[lo], self.c2[hi] - self.c2[lo]

    def sq_error(self, table: torch.Tensor) -> float:
        """Weighted squared error of nearest-level quantisation to the sorted ``table`` (midpoint rule)."""
        t = table.to(torch.float64)
        s0, s1, s2 = self.range_sums(self.cuts((t[1:] + t[:-1]) / 2))
        return float((s2 - 2 * t * s1 + t * t * s0).sum().clamp_min(0).item())


def _nearest_level(u: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Quantise to the nearest entry of a sorted table (boundaries at midpoints, ties to the lower)."""
    t = table.to(torch.float32)
    idx = torch.bucketize(u, (t[1:] + t[:-1]) / 2)
    return t[idx]


# ---------------------------------------------------------------------------------------------------
# INT


@dataclass(frozen=True)
class IntFormat:
    """K-level integer codes with a bf16 absmax scale per block of G consecutive inputs.

    ``scale = bf16(absmax(block) / min(|lo|, hi))``; ``code = clip(round_half_even(w / scale), lo, hi)``;
    ``w_hat = code * scale``. The code range is OWF's "asymmetric" one (:func:`int_range`), so for even
    K the extra negative level is only reached by rounding/clipping (for K=6 the absmax maps to +-2 and
    -3 is unused by construction, as in the reference). An all-zero block has scale 0 and decodes to 0.

    Bits: log2(K) per element (base-K packing) + 16 bits per block.
    """

    levels: int = 6
    block: int = 128

    def __post_init__(self) -> None:
        int_range(self.levels)
        if self.block < 1:
            raise ValueError(f"block must be positive, got {self.block}")

    @property
    def name(self) -> str:
        return f"INT K={self.levels} G={self.block}"

    @property
    def divisor(self) -> int:
        lo, hi = int_range(self.levels)
        return min(-lo, hi)

    def quantise(self, w: torch.Tensor) -> torch.Tensor:
        m, shape = _as_matrix(w)
        lo, hi = int_range(self.levels)
        scale, u = _blocked_absmax_scales(m, self.block, float(self.divisor))
        code = torch.clamp(torch.round(u), lo, hi)  # torch.round: half to even
        return (code * scale).reshape(shape)

    def bits_per_param(self, shape: Sequence[int]) -> float:
        return math.log2(self.levels) + _blocks_bits(int(shape[-1]), self.block)


# ---------------------------------------------------------------------------------------------------
# Student-t


def expected_block_max_t(df: float, block: int) -> float:
    """Approximate expected max |x| of ``block`` unit-scale Student-t(df) samples (df > 2).

    The asymptotic form used by the reference baseline (OWF ``crd_block_t``):
    ``(G * (2 ln(G/pi))^((df-3)/2))^(1/df) * sqrt(df/(df-2))``.
    """
    g = float(block)
    return (g * (2.0 * math.log(g / math.pi)) ** ((df - 3.0) / 2.0)) ** (1.0 / df) * math.sqrt(df / (df - 2.0))


def crd_t_table(levels: int, df: float, block: int, *, grid: int = 1 << 16) -> torch.Tensor:
    """Symmetric K-level cube-root-density table on [-1, 1] for absmax-normalised Student-t blocks.

    The values of a block are modelled as Student-t(df) truncated at the expected block max ``E``
    (:func:`expected_block_max_t`) and divided by ``E``, so the block absmax lands at +-1. For fine
    quantisation the MSE-optimal density of levels is proportional to ``pdf^(1/3)``; the K levels are
    the quantiles of that (truncated) density at ``p = i / (K - 1)``, ``i = 0..K-1`` - both end points
    +-1 are levels (the block maximum is always exactly representable), and 0 is a level iff K is odd.
    This is the reference's "symmetric, absmax" CRD layout. The inverse CDF is evaluated numerically
    (trapezoid rule on ``grid`` intervals of [0, E], float64, linear interpolation), which needs no
    special functions; the result is accurate to ~1e-9.
    """
    if df <= 2:
        raise ValueError(f"df must exceed 2, got {df}")
    if levels < 2:
        raise ValueError(f"need at least 2 levels, got {levels}")
    e = expected_block_max_t(df, block)
    x = torch.linspace(0.0, e, grid + 1, dtype=torch.float64)
    # cube root of the t density, up to a constant: (1 + x^2/df)^(-(df+1)/6)
    g = torch.exp(-(df + 1.0) / 6.0 * torch.log1p(x * x / df))
    cdf = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum((g[1:] + g[:-1]) * 0.5, 0)])
    cdf = cdf / cdf[-1]  # CDF of |x| under the truncated cube-root density: 0 at 0, 1 at E
    p = torch.arange(levels, dtype=torch.float64) / (levels - 1)
    r = (2 * p - 1).abs()  # symmetric density: the p-quantile is sign(2p-1) * (|x|-quantile at |2p-1|)
    idx = torch.searchsorted(cdf, r).clamp(1, grid)
    c0, c1 = cdf[idx - 1], cdf[idx]
    frac = torch.where(c1 > c0, (r - c0) / (c1 - c0), torch.zeros_like(r))
    mag = (x[idx - 1] + frac * (x[idx] - x[idx - 1])) / e
    mag = torch.where(r >= 1.0, torch.ones_like(mag), torch.where(r <= 0.0, torch.zeros_like(mag), mag))
    return torch.sign(2 * p - 1) * mag


def _log_spaced(lo: float, hi: float, n: int) -> tuple[float, ...]:
    return tuple(float(v) for v in np.exp(np.linspace(math.log(lo), math.log(hi), n)))


@dataclass(frozen=True)
class StudentTFormat:
    """K-level CRD Student-t table (:func:`crd_t_table`) with bf16 block-absmax scales, fitted per tensor.

    Fit: for each df in 12 log-spaced values in [3, 100] and each scale multiplier s in 9 log-spaced
    values in [1/4, 4] the table ``s * T(df)`` quantises the absmax-normalised values (nearest level);
    the pair with the least squared error in the original units (each block weighted by its scale^2)
    wins. ``s < 1`` clips the block maxima to ``+-s``; ``s > 1`` spreads the levels out. The chosen
    pair is exposed by :meth:`fit`.

    Bits: log2(K) per element + 16 bits per block + a per-matrix K-entry table (16 bits per entry).
    """

    levels: int = 6
    block: int = 128
    dfs: tuple[float, ...] = field(default_factory=lambda: _log_spaced(3.0, 100.0, 12))
    multipliers: tuple[float, ...] = field(default_factory=lambda: _log_spaced(0.25, 4.0, 9))

    @property
    def name(self) -> str:
        return f"Student-t K={self.levels} G={self.block}"

    def fit(self, w: torch.Tensor) -> tuple[float, float, torch.Tensor]:
        """(df, multiplier, table) minimising the squared reconstruction error of ``w``."""
        m, _ = _as_matrix(w)
        scale, u = _blocked_absmax_scales(m, self.block, 1.0)
        data = _SortedData(u, scale * scale)
        best: tuple[float, float, float, torch.Tensor] | None = None
        for df in self.dfs:
            base = crd_t_table(self.levels, df, self.block)
            for s in self.multipliers:
                table = base * s
                err = data.sq_error(table)
                if best is None or err < best[0]:
                    best = (err, df, s, table)
        assert best is not None
        return best[1], best[2], best[3]

    def quantise(self, w: torch.Tensor) -> torch.Tensor:
        m, shape = _as_matrix(w)
        _, _, table = self.fit(m)
        scale, u = _blocked_absmax_scales(m, self.block, 1.0)
        return (_nearest_level(u, table) * scale).reshape(shape)

    def bits_per_param(self, shape: Sequence[int]) -> float:
        numel = math.prod(int(s) for s in shape)
        return (math.log2(self.levels) + _blocks_bits(int(shape[-1]), self.block)
                + TABLE_ENTRY_BITS * self.levels / numel)


# ---------------------------------------------------------------------------------------------------
# Lloyd-Max


def lloyd_max_table(u: torch.Tensor, levels: int, *, threshold: float = 1e-3,
                    max_iterations: int = 10_000) -> torch.Tensor:
    """Scalar k-means (Lloyd-Max) table of ``levels`` values for the data ``u``, sorted ascending.

    Init: ``levels`` points evenly spaced from min(u) to max(u) ("uniform_minmax"). Each iteration assigns
    every value to its nearest level (midpoint boundaries, ties to the lower level) and moves each level
    to the mean of its values (an empty level keeps its value; a running max keeps the table sorted).
    Stops when at most ``threshold`` of the assignments changed. Runs on all values (the reference shuffles
    and starts from a 2^20 subset, doubling it; on the full data this is its fixed point), in float64,
    with exact range sums over the sorted data - deterministic.
    """
    data = _SortedData(u)
    lo, hi = float(data.u[0]), float(data.u[-1])
    table = torch.linspace(lo, hi, levels, dtype=torch.float64)
    cuts = data.cuts((table[1:] + table[:-1]) / 2)
    for _ in range(max_iterations):
        s0, s1, _ = data.range_sums(cuts)
        table = torch.where(s0 > 0, s1 / torch.where(s0 > 0, s0, torch.ones_like(s0)), table)
        table = torch.cummax(table, 0).values
        new_cuts = data.cuts((table[1:] + table[:-1]) / 2)
        changed = _changed_assignments(cuts, new_cuts)
        cuts = new_cuts
        if changed <= threshold * data.n:
            break
    return table


def _changed_assignments(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of sorted positions whose bucket differs between two cut vectors (same length)."""
    edges = torch.unique(torch.cat([a, b]))
    starts, stops = edges[:-1], edges[1:]
    ba = torch.searchsorted(a, starts, right=True) - 1
    bb = torch.searchsorted(b, starts, right=True) - 1
    return int(((stops - starts) * (ba != bb)).sum().item())


@dataclass(frozen=True)
class LloydMaxFormat:
    """Per-output-channel bf16 absmax scales and one K-level Lloyd-Max table per matrix.

    ``alpha_i = bf16(max_j |W_ij|)``; ``u = W / alpha`` lies in [-1, 1]; the table is fitted to all of u
    (:func:`lloyd_max_table`, threshold 1e-3) and every u goes to its nearest level.
    K = 6 is 8/3 bits' worth of levels (2^(8/3) = 6.35, rounded).

    Bits: log2(K) per element + 16 bits per row + the K-entry table (16 bits per entry) per matrix.
    """

    levels: int = 6
    threshold: float = 1e-3

    @property
    def name(self) -> str:
        return f"Lloyd-Max K={self.levels} per-channel"

    def fit(self, w: torch.Tensor) -> torch.Tensor:
        m, _ = _as_matrix(w)
        _, u = _blocked_absmax_scales(m, None, 1.0)
        return lloyd_max_table(u, self.levels, threshold=self.threshold)

    def quantise(self, w: torch.Tensor) -> torch.Tensor:
        m, shape = _as_matrix(w)
        scale, u = _blocked_absmax_scales(m, None, 1.0)
        table = lloyd_max_table(u, self.levels, threshold=self.threshold)
        return (_nearest_level(u, table) * scale).reshape(shape)

    def bits_per_param(self, shape: Sequence[int]) -> float:
        numel = math.prod(int(s) for s in shape)
        return (math.log2(self.levels) + _blocks_bits(int(shape[-1]), None)
                + TABLE_ENTRY_BITS * self.levels / numel)


# ---------------------------------------------------------------------------------------------------
# S3D8 (delegates to the codec)


@dataclass(frozen=True)
class S3D8Format:
    """S3D8 through the project's numpy codec ``gguf_s3d8`` - never a re-implementation.

    For matrices that can hold a container: ``dequantize_s3d8(quantize_s3d8(w))``, i.e. exactly what a
    GGUF stores. For the others (k not a multiple of 128, or too few rows for the header) the same codec
    pieces run without the container: ``fit_codebook``, bf16 row scales, the triples, ``nearest_centroid``
    and the signs - the arithmetic a container would hold if the shape fitted (:func:`s3d8_simulate`).

    Bits: the format's own accounting, ``(8 * ceil(n/3) * k + 16 * n + 32*3*8) / (n k)`` (codes, bf16 row
    scales, 96-byte codebook), as in the paper. A GGUF container of an eligible matrix is exactly
    ``43/16 = 2.6875`` bits per weight (:meth:`container_bits_per_param`).
    """

    centroid_rule: str | None = None
    seed: int = 0

    @property
    def name(self) -> str:
        return f"S3D8 ({self.rule})"

    @property
    def rule(self) -> str:
        import gguf_s3d8

        return self.centroid_rule or gguf_s3d8.DEFAULT_CENTROID_RULE

    def quantise(self, w: torch.Tensor) -> torch.Tensor:
        m, shape = _as_matrix(w)
        out = s3d8_simulate(m.numpy(), centroid_rule=self.rule, seed=self.seed)
        return torch.from_numpy(out).reshape(shape)

    def bits_per_param(self, shape: Sequence[int]) -> float:
        n = math.prod(int(s) for s in shape[:-1])
        k = int(shape[-1])
        return (8 * -(-n // 3) * k + SCALE_BITS * n + 32 * 3 * 8) / (n * k)

    @staticmethod
    def container_bits_per_param(shape: Sequence[int]) -> float | None:
        """Bits/weight of the GGUF container (None when the shape cannot hold one)."""
        import gguf_s3d8

        n, k = math.prod(int(s) for s in shape[:-1]), int(shape[-1])
        if gguf_s3d8.s3d8_ineligibility(n, k) is not None:
            return None
        return 8 * gguf_s3d8.container_nbytes(n, k) / (n * k)


def s3d8_simulate(w: np.ndarray, *, centroid_rule: str, seed: int = 0) -> np.ndarray:
    """S3D8-quantise and dequantise an fp32 (n, k) matrix with the codec; any shape.

    Eligible shapes go through the real container; others through the codec's building blocks (same
    codebook fit, scales, triples, assignment and signs), which give identical values for eligible
    shapes - ``tests/python/test_formats.py`` checks that.
    """
    import gguf_s3d8

    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if gguf_s3d8.s3d8_ineligibility(n, k) is None:
        return gguf_s3d8.dequantize_s3d8(gguf_s3d8.quantize_s3d8(w, centroid_rule=centroid_rule, seed=seed))
    return _s3d8_simulate_pieces(w, centroid_rule=centroid_rule, seed=seed)


def _s3d8_simulate_pieces(w: np.ndarray, *, centroid_rule: str, seed: int = 0) -> np.ndarray:
    import gguf_s3d8
    from gguf_s3d8.scales import scales_to_fp32
    from gguf_s3d8.triples import triple_components

    n, k = w.shape
    codebook = gguf_s3d8.fit_codebook(w, centroid_rule=centroid_rule, seed=seed)
    alpha = scales_to_fp32(gguf_s3d8.absmax_scale_bf16(w))
    n_trip = -(-n // 3)
    out = np.empty((n_trip * 3, k), dtype=np.float32)
    cb = codebook.astype(np.float32)
    step = 64
    for p0 in range(0, n_trip, step):
        p1 = min(n_trip, p0 + step)
        comps = triple_components(w, np.asarray(alpha, dtype=np.float32), p0, p1)  # (3, P, k)
        a = np.abs(comps)
        q = gguf_s3d8.nearest_centroid(a[0], a[1], a[2], codebook)  # (P, k)
        for d in range(3):
            mag = cb[q, d]
            out[3 * np.arange(p0, p1) + d] = np.where(comps[d] < 0, -mag, mag)
    rows = out[:n]
    return np.multiply(np.asarray(alpha, dtype=np.float32)[:, None], rows, dtype=np.float32)

"""The per-matrix tables of the table formats (:mod:`qat.formats`): Student-t cube-root-density tables
(:func:`crd_t_table`, :func:`expected_block_max_t`), Lloyd-Max tables (:func:`lloyd_max_table`) and the sorted data
their fits search (:class:`SortedData`, :func:`nearest_level`). Plain torch and numpy functions, no formats; the
formats that use them (``StudentTFormat``, ``LloydMaxFormat``) live in :mod:`qat.formats`, which re-exports these
names.

The 1-D scalar searches work on sorted values with prefix sums: for a quantiser that is a monotone
step function, the squared error of every candidate table and a Lloyd-Max update are exact sums over
contiguous ranges of the sorted data, so a full-tensor search costs one sort plus O(K log N) per
candidate instead of a pass over the tensor per candidate. Sums are float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["SortedData", "nearest_level", "expected_block_max_t", "crd_t_table", "log_spaced", "lloyd_max_table"]


class SortedData:
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


def nearest_level(u: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Quantise to the nearest entry of a sorted table (boundaries at midpoints, ties to the lower)."""
    t = table.to(torch.float32)
    idx = torch.bucketize(u, (t[1:] + t[:-1]) / 2)
    return t[idx]


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


def log_spaced(lo: float, hi: float, n: int) -> tuple[float, ...]:
    return tuple(float(v) for v in np.exp(np.linspace(math.log(lo), math.log(hi), n)))


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
    data = SortedData(u)
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

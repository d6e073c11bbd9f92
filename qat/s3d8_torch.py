"""The S3D8 arithmetic of ``gguf_s3d8`` in torch, for the per-step QAT forward (values only, no autograd).

Every function here computes bit for bit what the numpy codec computes (``tests/python/test_qat_torch_quant.py``
checks it on random and adversarial matrices); the codec stays the definition:

* :func:`absmax_scales` - ``gguf_s3d8.absmax_scale_bf16``: ``bf16_rne(max_j |W_ij| / 127)`` per row.
* :func:`normalise` - ``gguf_s3d8.normalise``: ``W / alpha`` in fp32, +0 where ``alpha == 0``.
* :func:`triples` - ``gguf_s3d8.triples.triple_components``: rows 3p..3p+2, zero padding rows.
* :func:`nearest_centroid` - ``gguf_s3d8.nearest_centroid`` in fp32: ``((C0-a0)^2 + (C1-a1)^2) + (C2-a2)^2``
  as separate fp32 operations (no fused multiply-add: each torch op rounds its result), running minimum
  replaced on a strict ``<`` (ties to the lowest index); points that are provably far from a tie are decided
  by a float64 matmul screen first.
* :func:`s3d8_dequantised` - ``dequantize_s3d8(quantize_s3d8_with_codebook(w, codebook))``.
* :func:`quantize_activations` / :func:`fake_quant_activations` - ``gguf_s3d8.quantize_activations`` (format §3)
  and its dequantised value ``x_q * s``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gguf_s3d8.constants import ACT_QMAX, N_CENTROIDS, SCALE_DIVISOR, VECTOR_DIM
from qat.numerics import absmax_bf16_scale, safe_divide, safe_reciprocal

__all__ = ["absmax_scales", "normalise", "triples", "nearest_centroid", "s3d8_dequantised", "s3d8_weight_space_values",
           "quantize_activations", "fake_quant_activations"]

#: Vectors assigned per step (bounds the (chunk, 32) distance matrix of the screen).
ASSIGN_CHUNK = 1 << 16
#: A lead (in squared distance) beyond twice the combined error (< 0.07) of the normative and screen distances.
SCREEN_MARGIN = 0.25


def absmax_scales(rows: torch.Tensor) -> torch.Tensor:
    """Per-row ``bf16_rne(max_j |x_ij| / 127)`` of a 2-D fp32 tensor, as fp32 values (all-zero rows: 0)."""
    amax = rows.detach().abs().amax(dim=1) if rows.shape[1] else rows.new_zeros(rows.shape[0])
    return absmax_bf16_scale(amax, SCALE_DIVISOR)


def normalise(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``values / scale`` in fp32 (``scale`` broadcast), exactly +0 where ``scale == 0``."""
    return safe_divide(values, scale)


def triples(w_norm: torch.Tensor) -> torch.Tensor:
    """Normalised rows (n, k) as triples (P, 3, k), P = ceil(n/3); rows >= n are +0."""
    n, k = w_norm.shape
    pad = -n % VECTOR_DIM
    if pad:
        w_norm = torch.cat([w_norm, w_norm.new_zeros(pad, k)])
    return w_norm.reshape(-1, VECTOR_DIM, k)


def _first_argmin(distances: Iterator[torch.Tensor]) -> torch.Tensor:
    """Index (int64) of the smallest of the entries' distance tensors, in order; the running minimum is replaced
    on a strict ``<`` only, so ties go to the lowest index (the format's rule)."""
    best = idx = None
    for l, d in enumerate(distances):
        if best is None:
            best, idx = d, torch.zeros_like(d, dtype=torch.int64)
        else:
            assert idx is not None
            lt = d < best
            idx = torch.where(lt, l, idx)
            best = torch.where(lt, d, best)
    assert idx is not None
    return idx


def _normative_argmin(p0: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The format's search: fp32 ``((C0-a0)^2 + (C1-a1)^2) + (C2-a2)^2``, strict ``<`` (ties to the lowest)."""
    def dist(l: int) -> torch.Tensor:
        t = c[l, 0] - p0
        d = t * t
        t = c[l, 1] - p1
        d = d + t * t
        t = c[l, 2] - p2
        return d + t * t

    return _first_argmin(dist(l) for l in range(c.shape[0]))


def nearest_centroid(a0: torch.Tensor, a1: torch.Tensor, a2: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index (int64) of the nearest of the (L, 3) integer centroids for fp32 points, ties to the lowest.

    Exactly :func:`gguf_s3d8.nearest_centroid` in fp32. Fast path: fp32 distances minus ``|a|^2``,
    ``|c|^2 - 2 a.c`` (one small matmul), decide every point whose best centroid leads the runner-up by more
    than ``SCREEN_MARGIN``. For components below 2^8 the normative fp32 distance is within 0.015 of the exact
    one (see ``gguf_s3d8.assignment.CellAssigner``) and the matmul's within 0.05 (terms below 2^17, a few
    fp32 roundings of at most 2^-7 each), so such a point has a unique fp32 minimum at that centroid. The remaining points (near-ties, and components >= 2^8) go through the
    normative fp32 search.
    """
    c32 = codebook.to(device=a0.device, dtype=torch.float32)
    shape = a0.shape
    f0, f1, f2 = a0.reshape(-1), a1.reshape(-1), a2.reshape(-1)
    out = torch.empty(f0.numel(), dtype=torch.int64, device=a0.device)
    cn = (c32 * c32).sum(dim=1)
    for start in range(0, f0.numel(), ASSIGN_CHUNK):
        sl = slice(start, start + ASSIGN_CHUNK)
        p0, p1, p2 = f0[sl], f1[sl], f2[sl]
        pts = torch.stack([p0, p1, p2], dim=1)
        e = torch.addmm(cn[None, :], pts, c32.t(), alpha=-2.0)
        if c32.shape[0] > 1:
            # best and runner-up (two min passes are several times faster than topk over 32 columns)
            first, idx = e.min(dim=1)
            second = e.scatter(1, idx[:, None], float("inf")).amin(dim=1)
            unsure = (second - first <= SCREEN_MARGIN) | (pts.amax(dim=1) >= 256)
        else:
            idx = torch.zeros(pts.shape[0], dtype=torch.int64, device=a0.device)
            unsure = torch.zeros_like(idx, dtype=torch.bool)
        if bool(unsure.any()):
            u = unsure.nonzero()[:, 0]
            idx[u] = _normative_argmin(p0[u], p1[u], p2[u], c32)
        out[sl] = idx
    return out.reshape(shape)


def s3d8_dequantised(w: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """The dequantised S3D8 value of an fp32 matrix (n, k) with a frozen (32, 3) codebook (any shape).

    Equal to ``gguf_s3d8.dequantize_s3d8(gguf_s3d8.quantize_s3d8_with_codebook(w, codebook))`` for every
    shape a container can hold; the same arithmetic for the others.
    """
    if codebook.shape != (N_CENTROIDS, VECTOR_DIM):
        raise ValueError(f"codebook must have shape (32, 3), got {tuple(codebook.shape)}")
    w = w.detach().to(torch.float32)
    n, k = w.shape
    alpha = absmax_scales(w)
    comp = triples(normalise(w, alpha[:, None]))  # (P, 3, k)
    a = comp.abs()
    q = nearest_centroid(a[:, 0], a[:, 1], a[:, 2], codebook)  # (P, k)
    mag = codebook.to(device=w.device, dtype=torch.float32)[q]  # (P, k, 3)
    signed = torch.where(comp < 0, -mag.permute(0, 2, 1), mag.permute(0, 2, 1)) + 0.0  # (P, 3, k); int8 has no -0
    return alpha[:, None] * signed.reshape(-1, k)[:n]


def frozen_alpha(scales: torch.Tensor) -> torch.Tensor:
    """fp32 values of frozen bf16 row scales (bit patterns in an integer tensor)."""
    return (scales.to(torch.int32) << 16).view(torch.float32)


def s3d8_weight_space_values(w: torch.Tensor, codebook: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The S3D8 value of fp32 columns ``w`` (n, c) under a frozen codebook and frozen row scales ``alpha`` (n,)
    (fp32 values of bf16 numbers), each triple taking its nearest entry in weight space: bit for bit
    :func:`gguf_s3d8.importance.weight_space_values` (fp32 ``t = a_d - alpha_d * C_d``,
    ``d = (t0^2 + t1^2) + t2^2``, strict ``<``: ties to the lowest index; ``alpha * (+-C)`` with +0 for zero
    codes and rows whose scale is 0). Used by GPTQ (one column at a time) and by QAT students started from a
    GPTQ / importance-aware encoding (frozen scales).
    """
    if codebook.shape != (N_CENTROIDS, VECTOR_DIM):
        raise ValueError(f"codebook must have shape (32, 3), got {tuple(codebook.shape)}")
    w = w.detach().to(torch.float32)
    n, c = w.shape
    al = alpha.to(device=w.device, dtype=torch.float32).reshape(-1)
    if al.shape[0] != n:
        raise ValueError(f"alpha: {al.shape[0]} scales for {n} rows")
    pad = -n % VECTOR_DIM
    rows = triples(w)  # (P, 3, c)
    al3 = torch.cat([al, al.new_zeros(pad)]).reshape(-1, VECTOR_DIM)  # (P, 3)
    a = rows.abs()
    cb = codebook.to(device=w.device, dtype=torch.float32)

    def dist(l: int) -> torch.Tensor:  # weight space: t = a_d - alpha_d * C_d
        t = a[:, 0] - (al3[:, 0] * cb[l, 0])[:, None]
        d = t * t
        for dim in (1, 2):
            t = a[:, dim] - (al3[:, dim] * cb[l, dim])[:, None]
            d = d + t * t
        return d

    idx = _first_argmin(dist(l) for l in range(N_CENTROIDS))
    mag = cb[idx].permute(0, 2, 1)  # (P, 3, c)
    signed = torch.where((rows < 0) & (al3[:, :, None] != 0), -mag, mag) + 0.0  # int8 codes have no -0
    return (al3[:, :, None] * signed).reshape(-1, c)[:n]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Format §3 per row of (m, k) fp32 activations: ``(x_q as fp32 integers in [-127, 127], s fp32 (m,))``."""
    x = x.detach().to(torch.float32)
    s = absmax_scales(x)
    scaled = x * safe_reciprocal(s)[:, None]
    scaled = torch.nan_to_num(scaled, nan=0.0, posinf=float(ACT_QMAX), neginf=-float(ACT_QMAX))
    return torch.clamp(torch.round(scaled), -ACT_QMAX, ACT_QMAX) + 0.0, s  # + 0.0: int8 codes have no -0


def fake_quant_activations(x: torch.Tensor) -> torch.Tensor:
    """``x_q * s`` (exact in fp32) for activations of any shape (..., k), quantised per row as in format §3."""
    flat = x.reshape(-1, x.shape[-1])
    q, s = quantize_activations(flat)
    return (q * s[:, None]).reshape(x.shape)

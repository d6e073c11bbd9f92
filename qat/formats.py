"""Fake-quantised weight formats (baselines of the paper, plus S3D8) with exact bits/param accounting.

Every format is a small frozen dataclass with

* ``quantise(w) -> w_hat``: the dequantised ("fake-quantised") weights, same shape, float32. Rows are
  output channels, the last axis is the input dimension k (the axis blocks run along). Pure function of
  ``w`` (deterministic); it has no gradient of its own - QAT wraps it in a straight-through estimator.
* ``bits_per_param(shape) -> float``: stored bits of one matrix of that shape divided by its element
  count, counting codes, scales and tables (see each class for the storage assumption).
* ``quantiser(w) -> GroupQuantiser``: the per-matrix fitted part (tables, S3D8 codebook and row scales)
  as an object that quantises *columns*, one scale group at a time. ``quantise`` is exactly
  :func:`direct_cast` of this quantiser, and GPTQ (``qat/gptq.py``) drives the same object column by
  column, so GPTQ with an identity Hessian reproduces the direct cast bit for bit.
* ``qat_fit(w) -> dict`` and ``qat_quantise(w, fitted) -> w_hat``: the QAT split of reference-recipe section 4
  (``qat.train --format``). ``qat_fit`` is the per-matrix part that is fitted once on the teacher's weight and
  frozen (INT: nothing; Student-t: the scaled table of the chosen df and multiplier; Lloyd-Max: the level table;
  S3D8: the codebook), as plain tensors; ``qat_quantise`` quantises the *current* weight with it, recomputing
  the block / row scales from that weight. ``qat_quantise(w, qat_fit(w)) == quantise(w)`` bit for bit (tested).

Formats are named by ids (the baseline sweep's, ``qat.train --format``): :func:`format_from_id`.

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
(16 bits); per-matrix tables count 16 bits per entry (they are tiny either way). Padding: a ragged last
block (k not a multiple of G) still stores a whole scale; S3D8 stores ceil(n/3) triples, so the padding
rows of the last triple cost codes (see :meth:`S3D8Format.bits_per_param`). The base-K bound has no
per-row padding; a real base-K packing of a row of k codes needs ceil(k log2 K) bits (<1 bit per row,
< 2e-3 bits/param at k = 576), which is ignored.

The per-matrix tables (Student-t, Lloyd-Max) and the sorted-data searches that fit them are in
:mod:`qat.format_tables` (re-exported here).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from qat.format_tables import SortedData as _SortedData
from qat.format_tables import crd_t_table, expected_block_max_t, lloyd_max_table
from qat.format_tables import log_spaced as _log_spaced
from qat.format_tables import nearest_level as _nearest_level
from qat.numerics import absmax_bf16_scale, bf16_rne, safe_divide

__all__ = [
    "WeightFormat",
    "GroupQuantiser",
    "format_from_id",
    "format_id",
    "format_family",
    "FORMAT_KINDS",
    "FormatKind",
    "torch_twin",
    "torch_activations",
    "twin_values",
    "direct_cast",
    "IntFormat",
    "StudentTFormat",
    "LloydMaxFormat",
    "S3D8Format",
    "S3D8Quantiser",
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

    def quantiser(self, w: torch.Tensor) -> "GroupQuantiser": ...

    def qat_fit(self, w: torch.Tensor) -> dict[str, torch.Tensor]: ...

    def qat_quantise(self, w: torch.Tensor, fitted: dict[str, torch.Tensor]) -> torch.Tensor: ...


@runtime_checkable
class GroupQuantiser(Protocol):
    """A format fitted to one matrix, quantising columns group by group (what GPTQ needs).

    ``group`` is the number of consecutive input columns sharing one set of scale parameters (the block G,
    or k when there is one scale per row). ``group_params(cols)`` computes those parameters from the
    current values of one group's columns (rows, <= group); ``quantise_columns(cols, params)`` returns the
    dequantised values of any subset of that group's columns (rows, c), element-wise given the params.
    """

    @property
    def group(self) -> int: ...

    def group_params(self, cols: torch.Tensor) -> object: ...

    def quantise_columns(self, cols: torch.Tensor, params: object) -> torch.Tensor: ...


def direct_cast(q: GroupQuantiser, m: torch.Tensor) -> torch.Tensor:
    """Quantise an fp32 matrix (rows, k) group by group with a fitted quantiser (no error feedback)."""
    out = torch.empty_like(m)
    k = m.shape[1]
    for g0 in range(0, k, q.group):
        cols = m[:, g0:g0 + q.group]
        out[:, g0:g0 + q.group] = q.quantise_columns(cols, q.group_params(cols))
    return out


# ---------------------------------------------------------------------------------------------------
# helpers


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
    scale = absmax_bf16_scale(amax, divisor)
    scale_el = scale.expand(rows, nb, g).reshape(rows, nb * g)[:, :k]
    return scale_el, safe_divide(m, scale_el)


@dataclass(frozen=True)
class _TableQuantiser:
    """Nearest level of a sorted table times a bf16 absmax scale per group (Student-t, Lloyd-Max, INT absmax).

    ``table=None`` is the integer grid lo..hi with round-half-even and clipping (INT).
    """

    group: int
    divisor: float
    table: torch.Tensor | None = None
    lo: int = 0
    hi: int = 0

    def group_params(self, cols: torch.Tensor) -> torch.Tensor:
        return absmax_bf16_scale(cols.abs().amax(dim=1, keepdim=True), self.divisor)

    def quantise_columns(self, cols: torch.Tensor, params: object) -> torch.Tensor:
        assert isinstance(params, torch.Tensor)
        u = safe_divide(cols, params)
        if self.table is None:
            return torch.clamp(torch.round(u), self.lo, self.hi) * params  # torch.round: half to even
        return _nearest_level(u, self.table) * params


@dataclass(frozen=True)
class _AffineIntQuantiser:
    """K-level affine integers: scale = bf16((max - min) / (K-1)) over a range that includes 0, integer zero
    point ``z = round(-min/scale)``; ``w_hat = (clip(round(w/scale) + z, 0, K-1) - z) * scale``."""

    group: int
    levels: int

    def group_params(self, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xmin = cols.amin(dim=1, keepdim=True).clamp_max(0)
        xmax = cols.amax(dim=1, keepdim=True).clamp_min(0)
        scale = bf16_rne((xmax - xmin) / (self.levels - 1))
        zero = torch.round(safe_divide(-xmin, scale)).clamp(0, self.levels - 1)
        return scale, zero

    def quantise_columns(self, cols: torch.Tensor, params: object) -> torch.Tensor:
        assert isinstance(params, tuple)
        scale, zero = params
        code = torch.clamp(torch.round(safe_divide(cols, scale)) + zero, 0, self.levels - 1)
        return (code - zero) * scale


def _blocks_bits(k: int, block: int | None) -> float:
    """Scale bits per element for one bf16 scale per block of G inputs (ragged last block counted)."""
    g = k if block is None else block
    return SCALE_BITS * (-(-k // g)) / k



# ---------------------------------------------------------------------------------------------------
# INT


@dataclass(frozen=True)
class IntFormat:
    """K-level integer codes with a bf16 scale (absmax) or scale and zero point (affine) per block of G inputs.

    ``scale = bf16(absmax(block) / min(|lo|, hi))``; ``code = clip(round_half_even(w / scale), lo, hi)``;
    ``w_hat = code * scale``. The code range is OWF's "asymmetric" one (:func:`int_range`), so for even
    K the extra negative level is only reached by rounding/clipping (for K=6 the absmax maps to +-2 and
    -3 is unused by construction, as in the reference). An all-zero block has scale 0 and decodes to 0.

    ``affine=True`` (GPTQ's asymmetric parameterisation): codes 0..K-1, ``scale = bf16((max - min)/(K-1))``
    over the block's range widened to include 0, zero point ``z = round(-min/scale)`` (an integer in
    0..K-1, stored as bf16 like the reference's scale/zero dtype), ``w_hat = (clip(round(w/scale)+z) - z) *
    scale``. All K levels are usable and 0 is exact.

    Bits: log2(K) per element (base-K packing) + 16 bits per block (+ 16 more for the affine zero point).
    """

    levels: int = 6
    block: int = 128
    affine: bool = False

    def __post_init__(self) -> None:
        int_range(self.levels)
        if self.block < 1:
            raise ValueError(f"block must be positive, got {self.block}")

    @property
    def name(self) -> str:
        return f"INT K={self.levels} G={self.block}" + (" affine" if self.affine else "")

    @property
    def divisor(self) -> int:
        lo, hi = int_range(self.levels)
        return min(-lo, hi)

    def quantiser(self, w: torch.Tensor) -> GroupQuantiser:
        k = int(w.shape[-1])
        if self.affine:
            return _AffineIntQuantiser(group=min(self.block, k), levels=self.levels)
        lo, hi = int_range(self.levels)
        return _TableQuantiser(group=min(self.block, k), divisor=float(self.divisor), lo=lo, hi=hi)

    def quantise(self, w: torch.Tensor) -> torch.Tensor:
        m, shape = _as_matrix(w)
        return direct_cast(self.quantiser(m), m).reshape(shape)

    def qat_fit(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}  # nothing is fitted: the grid is fixed, the scales (and zero points) are per block

    def qat_quantise(self, w: torch.Tensor, fitted: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.quantise(w)

    def bits_per_param(self, shape: Sequence[int]) -> float:
        per_block = 2 if self.affine else 1
        return math.log2(self.levels) + per_block * _blocks_bits(int(shape[-1]), self.block)


# ---------------------------------------------------------------------------------------------------
# Student-t




class _TableFormat:
    """What :class:`StudentTFormat` and :class:`LloydMaxFormat` share: a per-matrix K-level table fitted on the
    absmax-normalised weight (:meth:`fitted_table`), nearest level times a bf16 absmax scale per block of
    :attr:`scale_block` elements (None: one per row), and the same bit count (log2(K) per element, 16 bits per
    scale, the K-entry table at 16 bits an entry)."""

    levels: int

    @property
    def scale_block(self) -> int | None:
        raise NotImplementedError

    def fitted_table(self, w: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _table_quantiser(self, table: torch.Tensor, k: int) -> _TableQuantiser:
        block = self.scale_block
        return _TableQuantiser(group=k if block is None else min(block, k), divisor=1.0, table=table)

    def quantiser(self, w: torch.Tensor) -> GroupQuantiser:
        return self._table_quantiser(self.fitted_table(w), int(w.shape[-1]))

    def qat_quantise(self, w: torch.Tensor, fitted: dict[str, torch.Tensor]) -> torch.Tensor:
        m, shape = _as_matrix(w)
        return direct_cast(self._table_quantiser(fitted["table"], int(m.shape[-1])), m).reshape(shape)

    def quantise(self, w: torch.Tensor) -> torch.Tensor:
        m, shape = _as_matrix(w)
        return direct_cast(self.quantiser(m), m).reshape(shape)

    def bits_per_param(self, shape: Sequence[int]) -> float:
        numel = math.prod(int(s) for s in shape)
        return (math.log2(self.levels) + _blocks_bits(int(shape[-1]), self.scale_block)
                + TABLE_ENTRY_BITS * self.levels / numel)


@dataclass(frozen=True)
class StudentTFormat(_TableFormat):
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

    @property
    def scale_block(self) -> int | None:
        return self.block

    def fitted_table(self, w: torch.Tensor) -> torch.Tensor:
        return self.fit(w)[2]

    def qat_fit(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The table ``multiplier * T(df)`` of the fit (float64, as :meth:`quantiser` uses it), df and multiplier."""
        df, s, table = self.fit(w)
        return {"table": table, "df": torch.tensor(df, dtype=torch.float64),
                "multiplier": torch.tensor(s, dtype=torch.float64)}


# ---------------------------------------------------------------------------------------------------
# Lloyd-Max



@dataclass(frozen=True)
class LloydMaxFormat(_TableFormat):
    """Per-output-channel bf16 absmax scales and one K-level Lloyd-Max table per matrix.

    "Per-channel" is the scaling, as in the reference (``F.Scaled(log2 K, "lloyd_max", BFLOAT16, (1, None),
    "absmax")``: block shape (1, None) = one scale per output row); the table is one per matrix.

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

    @property
    def scale_block(self) -> int | None:
        return None  # one per-channel scale per row

    def fitted_table(self, w: torch.Tensor) -> torch.Tensor:
        return self.fit(w)

    def qat_fit(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The level table (float64, as :meth:`quantiser` uses it)."""
        return {"table": self.fit(w)}


# ---------------------------------------------------------------------------------------------------
# S3D8 (delegates to the codec)


@dataclass(frozen=True)
class S3D8Format:
    """S3D8 through the project's numpy codec ``gguf_s3d8`` - never a re-implementation.

    For matrices that can hold a container: ``dequantize_s3d8(quantize_s3d8(w))``, i.e. exactly what a
    GGUF stores. For the others (k not a multiple of 128, or too few rows for the header) the same codec
    pieces run without the container (:class:`S3D8Quantiser`: ``fit_codebook``, bf16 row scales, the
    triples, the nearest centroid, the signs, and the byte packing/decoding tables) - the values a
    container would hold if the shape fitted (:func:`s3d8_simulate`).

    Bits: the format's own accounting, ``(8 * ceil(n/3) * k + 16 * n + 32*3*8) / (n k)`` (codes including
    the padding rows of the last triple, bf16 row scales, 96-byte codebook), as in the paper. A GGUF
    container of an eligible matrix is exactly ``43/16 = 2.6875`` bits per weight
    (:meth:`container_bits_per_param`).
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

    def quantiser(self, w: torch.Tensor) -> "S3D8Quantiser":
        m, _ = _as_matrix(w)
        return S3D8Quantiser.fit(m.numpy(), centroid_rule=self.rule, seed=self.seed)

    def quantise(self, w: torch.Tensor) -> torch.Tensor:
        m, shape = _as_matrix(w)
        out = s3d8_simulate(m.numpy(), centroid_rule=self.rule, seed=self.seed)
        return torch.from_numpy(out).reshape(shape)

    def qat_fit(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """The (32, 3) uint8 codebook, fitted as :meth:`quantiser` and :meth:`quantise` fit it."""
        import gguf_s3d8

        m, _ = _as_matrix(w)
        cb = gguf_s3d8.fit_codebook(np.ascontiguousarray(m.numpy()), centroid_rule=self.rule, seed=self.seed)
        return {"codebook": torch.from_numpy(np.asarray(cb, dtype=np.uint8))}

    def qat_quantise(self, w: torch.Tensor, fitted: dict[str, torch.Tensor]) -> torch.Tensor:
        """S3D8 with the frozen codebook and bf16 row scales of the current ``w``: the codec's arithmetic in torch
        (:func:`qat.s3d8_torch.s3d8_dequantised`, bit-exact with the codec for every shape). With frozen row
        scales too (``fitted["scales"]``: bf16 bit patterns, e.g. a QAT student started from GPTQ's containers),
        each triple takes its nearest entry in weight space (:func:`qat.s3d8_torch.s3d8_weight_space_values`)."""
        from qat.s3d8_torch import frozen_alpha, s3d8_dequantised, s3d8_weight_space_values

        m, shape = _as_matrix(w)
        if "scales" in fitted:
            return s3d8_weight_space_values(m, fitted["codebook"], frozen_alpha(fitted["scales"])).reshape(shape)
        return s3d8_dequantised(m, fitted["codebook"]).reshape(shape)

    def bits_per_param(self, shape: Sequence[int]) -> float:
        n = math.prod(int(s) for s in shape[:-1])
        k = int(shape[-1])
        return (8 * -(-n // 3) * k + SCALE_BITS * n + 32 * 3 * 8) / (n * k)

    @staticmethod
    def container_bits_per_param(shape: Sequence[int]) -> float | None:
        """Bits/weight of the GGUF container (None when the shape cannot hold one)."""
        from gguf_s3d8.ggml_types import S3D8

        n, k = math.prod(int(s) for s in shape[:-1]), int(shape[-1])
        if S3D8.ineligibility(n, k) is not None:
            return None
        return 8 * S3D8.encoded_nbytes((n, k)) / (n * k)


class S3D8Quantiser:
    """One matrix's fixed S3D8 codebook and bf16 row scales, quantising any subset of its columns.

    Every step is the codec's: ``triple_components`` (normalisation ``W / alpha`` and zero padding rows),
    the exact nearest-centroid search (``CellAssigner``), ``sign_bits``, ``pack_bytes`` and the kernels'
    64-entry decoding tables (``decode_bytes``), and ``alpha * (+-C)`` (``dequantized_values``). A column's
    row triples are independent of the other columns, so quantising columns one at a time (GPTQ) or all at
    once (direct cast) gives the same values; :meth:`container` turns packed bytes of all k columns into a
    real container (eligible shapes).
    """

    _TRIPLES_PER_CHUNK = 2048

    def __init__(self, codebook: np.ndarray, scales_bf16: np.ndarray) -> None:
        from gguf_s3d8.assignment import CellAssigner
        from gguf_s3d8.packing import decode_tables
        from gguf_s3d8.scales import scales_to_fp32

        self.codebook = np.asarray(codebook, dtype=np.uint8)
        self.scales_bf16 = np.asarray(scales_bf16, dtype=np.uint16)
        self.alpha = scales_to_fp32(self.scales_bf16).astype(np.float32)
        self.n = int(self.scales_bf16.shape[0])
        self.group = 0  # set by fit (= k): one parameter set (the fixed scales) for the whole row
        self._assigner = CellAssigner(self.codebook)
        self._tables = decode_tables(self.codebook)

    @classmethod
    def fit(cls, w: np.ndarray, *, centroid_rule: str, seed: int = 0) -> "S3D8Quantiser":
        """Codebook (``fit_codebook``) and row scales (``absmax_scale_bf16``) of an fp32 (n, k) matrix."""
        import gguf_s3d8

        w = np.ascontiguousarray(w, dtype=np.float32)
        q = cls(gguf_s3d8.fit_codebook(w, centroid_rule=centroid_rule, seed=seed), gguf_s3d8.absmax_scale_bf16(w))
        q.group = int(w.shape[1])
        return q

    def pack(self, cols: np.ndarray) -> np.ndarray:
        """S3D8 bytes (ceil(n/3), c) of fp32 columns (n, c) under the fixed codebook and scales."""
        from gguf_s3d8.packing import pack_bytes, sign_bits
        from gguf_s3d8.triples import triple_components

        cols = np.ascontiguousarray(cols, dtype=np.float32)
        n_trip = -(-self.n // 3)
        out = np.empty((n_trip, cols.shape[1]), dtype=np.uint8)
        for p0 in range(0, n_trip, self._TRIPLES_PER_CHUNK):
            p1 = min(n_trip, p0 + self._TRIPLES_PER_CHUNK)
            comps = triple_components(cols, self.alpha, p0, p1)  # (3, P, c)
            a = np.abs(comps)
            s = sign_bits(comps)
            out[p0:p1] = pack_bytes(self._assigner.assign(a[0], a[1], a[2]), s[0], s[1], s[2])
        return out

    def unpack(self, packed: np.ndarray) -> np.ndarray:
        """Dequantised fp32 values (n, c) of packed bytes (ceil(n/3), c), through the decoding tables."""
        from gguf_s3d8.packing import decode_bytes
        from gguf_s3d8.quantize import dequantized_values

        w0, w1, w2 = decode_bytes(packed, self._tables)
        w_int = np.stack([w0, w1, w2], axis=1).reshape(-1, packed.shape[1])[: self.n]
        return dequantized_values(w_int, self.alpha)

    def container(self, packed: np.ndarray) -> np.ndarray:
        """The GGUF container (n, 43k/128) holding ``packed`` (all k columns); raises if ineligible."""
        from gguf_s3d8.container import allocate_container

        k = packed.shape[1]
        container, body = allocate_container(k, self.n, self.codebook, self.scales_bf16)
        body[...] = packed
        return container

    def group_params(self, cols: torch.Tensor) -> None:
        return None  # codebook and scales are fixed for the whole matrix

    def quantise_columns(self, cols: torch.Tensor, params: object = None) -> torch.Tensor:
        return torch.from_numpy(self.unpack(self.pack(cols.detach().to(torch.float32).numpy())))


def s3d8_simulate(w: np.ndarray, *, centroid_rule: str, seed: int = 0) -> np.ndarray:
    """S3D8-quantise and dequantise an fp32 (n, k) matrix with the codec; any shape.

    Eligible shapes go through the real container; others through the codec's building blocks
    (:class:`S3D8Quantiser`), which give identical values for eligible shapes - ``tests/python/test_formats.py``
    checks that.
    """
    import gguf_s3d8

    from gguf_s3d8.ggml_types import S3D8

    w = np.ascontiguousarray(w, dtype=np.float32)
    n, k = w.shape
    if S3D8.ineligibility(n, k) is None:
        return gguf_s3d8.dequantize_s3d8(gguf_s3d8.quantize_s3d8(w, centroid_rule=centroid_rule, seed=seed))
    return _s3d8_simulate_pieces(w, centroid_rule=centroid_rule, seed=seed)


def _s3d8_simulate_pieces(w: np.ndarray, *, centroid_rule: str, seed: int = 0) -> np.ndarray:
    q = S3D8Quantiser.fit(w, centroid_rule=centroid_rule, seed=seed)
    return q.unpack(q.pack(w))


# ---------------------------------------------------------------------------------------------------
# format ids


@dataclass(frozen=True)
class FormatKind:
    """One family of simulated formats in the format-id table: its class, the pattern of its ids, how an id's match
    makes the format, the id of a format (None: non-default fit settings, which have no id) and its report family.
    ``ggml_type``: the ggml type the family simulates exactly (its entry in ``gguf_s3d8.ggml_types``), if any."""

    cls: type
    pattern: str
    make: Callable[[re.Match[str]], WeightFormat]
    ident: Callable[[Any], str | None]
    family: Callable[[Any], str]
    ggml_type: str | None = None


#: The one table of format ids (``qat.train --format``, the baseline sweep), in the order ids are tried.
FORMAT_KINDS: tuple[FormatKind, ...] = (
    FormatKind(IntFormat, r"int(\d+)_g(\d+)(_affine)?",
               lambda m: IntFormat(int(m.group(1)), int(m.group(2)), affine=m.group(3) is not None),
               lambda f: f"int{f.levels}_g{f.block}" + ("_affine" if f.affine else ""),
               lambda f: "INT affine" if f.affine else "INT"),
    FormatKind(StudentTFormat, r"studentt(\d+)_g(\d+)", lambda m: StudentTFormat(int(m.group(1)), int(m.group(2))),
               lambda f: f"studentt{f.levels}_g{f.block}" if f == StudentTFormat(f.levels, f.block) else None,
               lambda f: "Student-t"),
    FormatKind(LloydMaxFormat, r"lloydmax(\d+)", lambda m: LloydMaxFormat(int(m.group(1))),
               lambda f: f"lloydmax{f.levels}" if f == LloydMaxFormat(f.levels) else None,
               lambda f: "Lloyd-Max"),
    FormatKind(S3D8Format, r"s3d8", lambda m: S3D8Format(), lambda f: "s3d8" if f == S3D8Format() else None,
               lambda f: "S3D8", ggml_type="s3d8"),
)


def _kind_of(fmt: WeightFormat) -> FormatKind | None:
    return next((k for k in FORMAT_KINDS if isinstance(fmt, k.cls)), None)


def format_from_id(name: str) -> WeightFormat:
    """The format named by a baseline-sweep id (``qat.train --format``).

    ``int{K}_g{G}`` (:class:`IntFormat` K levels, block G), ``int{K}_g{G}_affine`` (affine INT),
    ``studentt{K}_g{G}`` (:class:`StudentTFormat`), ``lloydmax{K}`` (:class:`LloydMaxFormat`, per-channel
    scales), ``s3d8`` (:class:`S3D8Format`, the codec's default centroid rule, seed 0). Raises ValueError
    for anything else. ``format_id(format_from_id(s)) == s``.
    """
    for kind in FORMAT_KINDS:
        m = re.fullmatch(kind.pattern, name)
        if m:
            return kind.make(m)
    raise ValueError(f"unknown format id {name!r} (int<K>_g<G>[_affine], studentt<K>_g<G>, lloydmax<K>, s3d8)")


def format_id(fmt: WeightFormat) -> str:
    """The id of a format (inverse of :func:`format_from_id`; non-default fit settings have no id)."""
    kind = _kind_of(fmt)
    ident = None if kind is None else kind.ident(fmt)
    if ident is None:
        raise ValueError(f"{fmt!r} has no format id")
    return ident


def format_family(fmt: WeightFormat) -> str:
    """The family a format is reported under: INT, INT affine, Student-t, Lloyd-Max or S3D8."""
    kind = _kind_of(fmt)
    if kind is None:
        raise ValueError(f"{fmt!r}: unknown format family")
    return kind.family(fmt)


def _resolve(ref: str) -> Any:
    """The object a ``"module:name"`` reference of the table of types names, imported."""
    import importlib

    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def torch_twin(type_name: str) -> Any:
    """The torch fake-quantiser of a ggml type, as ``gguf_s3d8.ggml_types`` names it (``torch_twin``: a function of the
    weight, or for S3D8 the :class:`S3D8Format` class), imported here: the codec imports neither torch nor qat."""
    from gguf_s3d8.ggml_types import ggml_type

    ref = ggml_type(type_name).torch_twin
    if ref is None:
        raise ValueError(f"ggml type {type_name!r} has no torch twin")
    return _resolve(ref)


def torch_activations(type_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The fake-quantiser of the activations that ggml's CPU matmul pairs with a weight of the type
    (``gguf_s3d8.ggml_types``' ``torch_activations``; None: they stay as they are)."""
    from gguf_s3d8.ggml_types import ggml_type

    ref = ggml_type(type_name).torch_activations
    return None if ref is None else _resolve(ref)


def twin_values(type_name: str) -> Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]:
    """``values(w, frozen)``: the fake-quantised value of a weight ``w`` (GGUF row order) of a ggml type, given the
    frozen per-matrix part the type has (S3D8: ``{"codebook"}``, with ``"scales"`` where the row scales are frozen
    too; the others: none). A twin that is a format class computes ``qat_quantise(w, frozen)``; a twin function
    is applied to ``w``; a lossless type (F32) gives ``w`` itself."""
    from gguf_s3d8.ggml_types import ggml_type

    if ggml_type(type_name).lossless:
        return lambda w, frozen: w
    twin = torch_twin(type_name)
    if isinstance(twin, type):
        return twin().qat_quantise
    return lambda w, frozen: twin(w)

"""Quantise a weight matrix to an S3D8 container and back (format sections 1, 2 and 4).

Public entry points: :func:`quantize_s3d8` (fits the codebook), :func:`quantize_s3d8_with_codebook`
(a frozen codebook, e.g. from QAT), :func:`dequantize_s3d8`, :func:`decode_int8`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from .assignment import CellAssigner
from .codebook import fit_codebook
from .constants import DEFAULT_CENTROID_RULE, VECTOR_DIM
from .container import allocate_container, read_container
from .eligibility import n_triples, s3d8_ineligibility
from .errors import S3D8IneligibleError, S3D8InputError
from .inputs import as_codebook, as_weight_matrix
from .packing import decode_bytes, decode_tables, pack_bytes, sign_bits
from .scales import absmax_scale_bf16, scales_to_fp32
from .triples import triple_components

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

#: Triples processed per step: bounds temporaries to ~ a few x (3 * this * k) fp32 values.
TRIPLES_PER_CHUNK = 64


def check_eligible(n: int, k: int, *, name: str = "") -> None:
    """Raise :class:`S3D8IneligibleError` (naming the tensor and the reason) unless n x k fits S3D8."""
    reason = s3d8_ineligibility(n, k)
    if reason is not None:
        raise S3D8IneligibleError(name, f"shape (n={n}, k={k}) cannot be stored as S3D8: {reason}")


def encode_triples(components: F32, assigner: CellAssigner) -> U8:
    """Pack normalised components (3, P, k) of P triples into their (P, k) bytes: nearest centroid of
    ``|w'|`` (fp32, ties to the lowest index; ``assigner`` is the exact fast path of
    :func:`~gguf_s3d8.assignment.nearest_centroid` for the matrix's codebook) and the signs ``w' < 0``."""
    a = np.abs(components)
    q = assigner.assign(a[0], a[1], a[2])
    s = sign_bits(components)
    return pack_bytes(q, s[0], s[1], s[2])


def quantize_s3d8_with_codebook(w: npt.ArrayLike, codebook: npt.ArrayLike, *, name: str = "") -> U8:
    """Quantise fp32 weights (n, k) with a given (32, 3) codebook; returns the container (n, 43k/128) uint8.

    Order of checks: input (rank, dtype, finiteness), then shape eligibility, then the codebook.
    A 3-D stack of expert matrices (E, n, k) with codebooks (E, 32, 3) gives (E, n, 43k/128), one
    container per slice (errors name the slice as ``name[e]``).
    """
    if np.ndim(w) == 3:
        cbs = np.asarray(codebook)
        if cbs.ndim != 3 or cbs.shape[0] != np.shape(w)[0]:
            raise S3D8InputError(name, f"a 3-D weight stack needs one codebook per slice, got shape {cbs.shape}")
        return np.stack([quantize_s3d8_with_codebook(ws, cb, name=f"{name}[{e}]")
                         for e, (ws, cb) in enumerate(zip(np.asarray(w), cbs))])
    arr = as_weight_matrix(w, name=name)
    n, k = arr.shape
    check_eligible(n, k, name=name)
    cb = as_codebook(codebook, name=name)
    scales = absmax_scale_bf16(arr)
    alpha = scales_to_fp32(scales)
    container, body = allocate_container(k, n, cb, scales, name=name)
    assigner = CellAssigner(cb)
    for p0, p1 in _triple_chunks(n):
        body[p0:p1] = encode_triples(triple_components(arr, alpha, p0, p1), assigner)
    return container


def quantize_s3d8(w: npt.ArrayLike, *, name: str = "", centroid_rule: str = DEFAULT_CENTROID_RULE,
                  seed: int = 0) -> U8:
    """Fit a codebook to ``w`` (n rows, k columns) and quantise it; returns the container (n, 43k/128).

    Ready for ``GGUFWriter.add_tensor(name, container, raw_dtype=GGMLQuantizationType.S3D8)``.
    A 3-D stack of expert matrices (E, n, k) gets one codebook per slice and gives (E, n, 43k/128).
    """
    if np.ndim(w) == 3:
        return np.stack([quantize_s3d8(ws, name=f"{name}[{e}]", centroid_rule=centroid_rule, seed=seed)
                         for e, ws in enumerate(np.asarray(w))])
    arr = as_weight_matrix(w, name=name)
    check_eligible(*arr.shape, name=name)
    codebook = fit_codebook(arr, centroid_rule=centroid_rule, seed=seed, name=name)
    return quantize_s3d8_with_codebook(arr, codebook, name=name)


def decode_int8(container: npt.ArrayLike | bytes, *, name: str = "") -> tuple[npt.NDArray[np.int8], F32]:
    """Validate and decode a container through the 64-entry tables, as the kernels do.

    Returns ``(w_int, alpha)``: the signed centroid components int8 (n, k) and the fp32 row scales (n,).
    """
    c = read_container(container, name=name)
    tables = decode_tables(c.codebook)
    out = np.empty((n_triples(c.n) * VECTOR_DIM, c.k), dtype=np.int8)
    rows = out.reshape(n_triples(c.n), VECTOR_DIM, c.k)
    for p0, p1 in _triple_chunks(c.n):
        w0, w1, w2 = decode_bytes(c.packed[p0:p1], tables)
        rows[p0:p1, 0], rows[p0:p1, 1], rows[p0:p1, 2] = w0, w1, w2
    return out[: c.n], scales_to_fp32(c.scales_bf16)


def dequantized_values(w_int: npt.NDArray[np.int8], alpha: F32) -> F32:
    """``W~ = alpha_i * (+/- C)`` in fp32 (broadcasting alpha over the leading axis of ``w_int``)."""
    return np.multiply(np.asarray(alpha, dtype=np.float32)[:, None], w_int.astype(np.float32), dtype=np.float32)


def dequantize_s3d8(container: npt.ArrayLike | bytes, *, name: str = "") -> F32:
    """Validate a container and return the dequantised fp32 matrix (n, k).

    A 3-D array (E, n, 43k/128) of expert slices (as GGUFReader returns it) gives (E, n, k).
    """
    if not isinstance(container, (bytes, bytearray, memoryview)) and np.ndim(container) == 3:
        return np.stack([dequantize_s3d8(c, name=f"{name}[{e}]") for e, c in enumerate(np.asarray(container))])
    w_int, alpha = decode_int8(container, name=name)
    return dequantized_values(w_int, alpha)


def _triple_chunks(n: int) -> Iterator[tuple[int, int]]:
    total = n_triples(n)
    for p0 in range(0, total, TRIPLES_PER_CHUNK):
        yield p0, min(total, p0 + TRIPLES_PER_CHUNK)

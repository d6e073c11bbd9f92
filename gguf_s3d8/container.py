"""The self-describing S3D8 container of one 2-D slice (format section 4): layout, writing, validation.

Layout (little endian), n rows of k columns, ``B = round_up(128 + 2n, 64)``::

    0    "S3D8"   4    version 1   5   3 zero bytes   8  k (u32)   12  n (u32)
    16   codebook C[l][d] at 16 + 3l + d (each <= 127)   112  16 zero bytes
    128  n bf16 scales   128 + 2n .. B  zero
    B    packed body, triple p column j at B + p*k + j   then zero up to n * 43k/128

The reader accepts nothing that a conforming writer would not produce: besides the checks ggml's
``ggml_validate_row_data`` makes (magic, version, reserved bytes, k and n against the size, table
entries, finite scales) it also requires zero padding, non-negative scales and zero signs in the padding
rows of the last triple, so that a buggy writer is caught.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from .bf16 import bf16_is_finite
from .constants import (
    CENTROID_MAX,
    CODEBOOK_SIZE,
    MAGIC,
    N_CENTROIDS,
    OFF_CODEBOOK,
    OFF_CODEBOOK_PAD,
    OFF_K,
    OFF_MAGIC,
    OFF_N,
    OFF_RESERVED,
    OFF_SCALES,
    OFF_VERSION,
    RESERVED_SIZE,
    VECTOR_DIM,
    VERSION,
)
from .eligibility import (
    body_nbytes,
    body_offset,
    container_nbytes,
    n_triples,
    row_nbytes,
    s3d8_ineligibility,
    scales_end,
)
from .errors import S3D8FormatError, S3D8IneligibleError, S3D8InputError
from .inputs import as_codebook

U8 = npt.NDArray[np.uint8]
_U32 = np.dtype("<u4")
_BF16 = np.dtype("<u2")


@dataclass(frozen=True)
class S3D8Container:
    """A validated container. Arrays are read-only views into the buffer it was read from.

    ``codebook`` (32, 3) uint8; ``scales_bf16`` (n,) uint16 bf16 bit patterns; ``packed`` (ceil(n/3), k).
    """

    k: int
    n: int
    codebook: U8
    scales_bf16: npt.NDArray[np.uint16]
    packed: U8


def allocate_container(k: int, n: int, codebook: npt.ArrayLike, scales_bf16: npt.ArrayLike, *,
                       name: str = "") -> tuple[U8, U8]:
    """Zeroed container of shape (n, 43k/128) with header, codebook and scales written.

    Returns ``(container, body)`` where ``body`` is the writable (ceil(n/3), k) view of the packed bytes,
    so a quantiser can fill it chunk by chunk without a second full-size array.
    """
    reason = s3d8_ineligibility(n, k)
    if reason is not None:
        raise S3D8IneligibleError(name, f"shape (n={n}, k={k}) cannot be stored as S3D8: {reason}")
    cb = as_codebook(codebook, name=name)
    sc = np.asarray(scales_bf16)
    if sc.shape != (n,) or sc.dtype != np.uint16:
        raise S3D8InputError(name, f"scales must be uint16 bf16 bits of shape ({n},), got {sc.dtype} {sc.shape}")
    flat = np.zeros(container_nbytes(n, k), dtype=np.uint8)
    flat[OFF_MAGIC:OFF_MAGIC + len(MAGIC)] = np.frombuffer(MAGIC, dtype=np.uint8)
    flat[OFF_VERSION] = VERSION
    flat[OFF_K:OFF_K + 4] = np.array([k], dtype=_U32).view(np.uint8)
    flat[OFF_N:OFF_N + 4] = np.array([n], dtype=_U32).view(np.uint8)
    flat[OFF_CODEBOOK:OFF_CODEBOOK + CODEBOOK_SIZE] = cb.reshape(-1)
    flat[OFF_SCALES:scales_end(n)] = sc.astype(_BF16).view(np.uint8)
    b = body_offset(n)
    body = flat[b:b + body_nbytes(n, k)].reshape(n_triples(n), k)
    return flat.reshape(n, row_nbytes(k)), body


def write_container(k: int, n: int, codebook: npt.ArrayLike, scales_bf16: npt.ArrayLike,
                    packed: npt.ArrayLike, *, name: str = "") -> U8:
    """Assemble a container (n, 43k/128) uint8 from its parts; inverse of :func:`read_container`."""
    container, body = allocate_container(k, n, codebook, scales_bf16, name=name)
    pk = np.asarray(packed)
    if pk.shape != body.shape or pk.dtype != np.uint8:
        raise S3D8InputError(name, f"packed bytes must be uint8 of shape {body.shape}, got {pk.dtype} {pk.shape}")
    body[...] = pk
    return container


def _fail(name: str, reason: str) -> S3D8FormatError:
    return S3D8FormatError(name, f"corrupt container: {reason}")


def _first_nonzero(region: U8, offset: int) -> str:
    i = int(np.flatnonzero(region)[0])
    return f"byte {offset + i} is 0x{int(region[i]):02x}"


def read_container(buf: npt.ArrayLike | bytes, *, name: str = "") -> S3D8Container:
    """Validate one container and return its parts.

    ``buf`` is the slice's bytes: a bytes object or a uint8 array, either flat or shaped (n, 43k/128) as
    GGUFReader gives it (then the shape must agree with the header too). Raises
    :class:`S3D8FormatError`, whose message names the tensor, on any inconsistency.
    """
    arr = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, (bytes, bytearray, memoryview)) else np.asarray(buf)
    if arr.dtype != np.uint8:
        raise _fail(name, f"expected uint8 bytes, got dtype {arr.dtype}")
    if arr.ndim not in (1, 2):
        raise _fail(name, f"expected one 2-D slice (n, row bytes) or flat bytes, got shape {arr.shape}")
    flat = arr.reshape(-1)
    size = flat.size
    if size < OFF_SCALES:
        raise _fail(name, f"{size} bytes is shorter than the {OFF_SCALES}-byte header")
    magic = bytes(flat[OFF_MAGIC:OFF_MAGIC + len(MAGIC)])
    if magic != MAGIC:
        raise _fail(name, f"bad magic {magic!r} (expected {MAGIC!r})")
    version = int(flat[OFF_VERSION])
    if version != VERSION:
        raise _fail(name, f"unsupported version {version} (expected {VERSION})")
    reserved = flat[OFF_RESERVED:OFF_RESERVED + RESERVED_SIZE]
    if reserved.any():
        raise _fail(name, f"reserved flag bytes 5..7 must be zero: {_first_nonzero(reserved, OFF_RESERVED)}")
    k = int(flat[OFF_K:OFF_K + 4].view(_U32)[0])
    n = int(flat[OFF_N:OFF_N + 4].view(_U32)[0])
    reason = s3d8_ineligibility(n, k)
    if reason is not None:
        raise _fail(name, f"header k={k}, n={n} is not a valid S3D8 shape: {reason}")
    expected = container_nbytes(n, k)
    if size != expected:
        raise _fail(name, f"buffer has {size} bytes but header k={k}, n={n} needs n*43k/128 = {expected}")
    if arr.ndim == 2 and arr.shape != (n, row_nbytes(k)):
        raise _fail(name, f"buffer shape {arr.shape} disagrees with header k={k}, n={n} "
                          f"(expected ({n}, {row_nbytes(k)}))")
    codebook = flat[OFF_CODEBOOK:OFF_CODEBOOK + CODEBOOK_SIZE]
    if codebook.max() > CENTROID_MAX:
        bad = int(np.flatnonzero(codebook > CENTROID_MAX)[0])
        raise _fail(name, f"codebook entry C[{bad // VECTOR_DIM}][{bad % VECTOR_DIM}] = {int(codebook[bad])} "
                          f"exceeds {CENTROID_MAX}")
    pad = flat[OFF_CODEBOOK_PAD:OFF_SCALES]
    if pad.any():
        raise _fail(name, f"bytes {OFF_CODEBOOK_PAD}..{OFF_SCALES - 1} after the codebook must be zero: "
                          f"{_first_nonzero(pad, OFF_CODEBOOK_PAD)}")
    scales = flat[OFF_SCALES:scales_end(n)].view(_BF16)
    finite = bf16_is_finite(scales)
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        raise _fail(name, f"scale of row {i} is not finite (bf16 0x{int(scales[i]):04x})")
    negative = (scales & np.uint16(0x8000)) != 0
    if negative.any():
        i = int(np.flatnonzero(negative)[0])
        raise _fail(name, f"scale of row {i} is negative (bf16 0x{int(scales[i]):04x}); scales are absmax/127")
    b = body_offset(n)
    gap = flat[scales_end(n):b]
    if gap.any():
        raise _fail(name, f"padding between scales and body must be zero: {_first_nonzero(gap, scales_end(n))}")
    body_end = b + body_nbytes(n, k)
    tail = flat[body_end:]
    if tail.any():
        raise _fail(name, f"bytes after the packed body must be zero: {_first_nonzero(tail, body_end)}")
    packed = flat[b:body_end].reshape(n_triples(n), k)
    _check_padding_signs(packed, n, name)
    return S3D8Container(k=k, n=n, codebook=_readonly(codebook.reshape(N_CENTROIDS, VECTOR_DIM)),
                         scales_bf16=_readonly(scales.astype(np.uint16, copy=False)), packed=_readonly(packed))


def _check_padding_signs(packed: U8, n: int, name: str) -> None:
    """Padding rows of the last triple have S = 0: bit 6 clear when row 3p+1 is padding, and bit 7 equal to
    bit 0 (S0 ^ S2 with S2 = 0) when row 3p+2 is padding."""
    real_rows = n % VECTOR_DIM
    if real_rows == 0:
        return
    last = packed[-1]
    bad = np.zeros(last.shape, dtype=bool)
    if real_rows == 1:
        bad |= (last & np.uint8(0x40)) != 0
    bad |= (((last >> np.uint8(7)) ^ last) & np.uint8(1)) != 0
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise _fail(name, f"padding row of the last triple has a negative sign at column {j} "
                          f"(byte 0x{int(last[j]):02x}); padding rows must have S = 0")


_G = TypeVar("_G", bound=np.generic)


def _readonly(a: npt.NDArray[_G]) -> npt.NDArray[_G]:
    v = a.view()
    v.flags.writeable = False
    return v

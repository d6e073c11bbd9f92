"""Container geometry (format section 4): sizes, body offset and which (n, k) can hold a container.

A ggml row of S3D8 is ``43 k / 128`` bytes, so a slice of n rows has ``n * 43 k / 128`` bytes while the
packed body needs ``ceil(n / 3) * k``: the difference (``n k / 384`` minus the padding rows of the last
triple) must hold the 128-byte header, the 2n bytes of bf16 scales and the alignment padding. Small
matrices therefore may not fit; they get a fallback type from the converter.
"""

from __future__ import annotations

from .constants import BLOCK_SIZE, BODY_ALIGN, OFF_SCALES, TYPE_SIZE, VECTOR_DIM

_U32_MAX = 0xFFFFFFFF


def n_triples(n: int) -> int:
    """Number of packed row triples, ``ceil(n / 3)``."""
    return -(-n // VECTOR_DIM)


def row_nbytes(k: int) -> int:
    """ggml_row_size(S3D8, k) = 43 k / 128 (k must be a multiple of 128)."""
    return k // BLOCK_SIZE * TYPE_SIZE


def container_nbytes(n: int, k: int) -> int:
    """Size of one 2-D slice: n * 43 k / 128 bytes."""
    return n * row_nbytes(k)


def scales_end(n: int) -> int:
    """First byte after the n bf16 scales."""
    return OFF_SCALES + 2 * n


def body_offset(n: int) -> int:
    """Offset B of the packed body: the end of the scales rounded up to a multiple of 64."""
    return -(-scales_end(n) // BODY_ALIGN) * BODY_ALIGN


def body_nbytes(n: int, k: int) -> int:
    """Size of the packed body, ``ceil(n/3) * k``."""
    return n_triples(n) * k


def s3d8_ineligibility(n: int, k: int) -> str | None:
    """Why an n x k matrix (n output rows, k input columns) cannot be stored as S3D8, or None if it can."""
    if n <= 0 or k <= 0:
        return f"empty matrix (n={n}, k={k})"
    if n > _U32_MAX or k > _U32_MAX:
        return f"n={n} or k={k} does not fit the container's u32 fields"
    if k % BLOCK_SIZE != 0:
        return f"k={k} (row length, ne0) is not a multiple of {BLOCK_SIZE}"
    need = body_offset(n) + body_nbytes(n, k)
    have = container_nbytes(n, k)
    if need > have:
        return (f"too small: header, scales and body need {need} bytes but {n} rows of "
                f"{row_nbytes(k)} bytes give {have}")
    return None


def is_s3d8_eligible(n: int, k: int) -> bool:
    """True when an n x k matrix can be stored as S3D8."""
    return s3d8_ineligibility(n, k) is None

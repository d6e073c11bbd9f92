"""Sign rule, byte layout and table decoding (format sections 1 and 2).

One byte holds the 5-bit centroid index q of a row triple plus the three signs::

    b = S0 | (q << 1) | (S1 << 6) | ((S0 ^ S2) << 7)

S2 is stored xor-ed with S0 so that ``I2 = (b & 0x3F) ^ (b >> 7) = (q << 1) | S2``: each of the three rows
then decodes with one AND/shift and one 64-entry table lookup (L0, L1, L2 below), which is what the
NEON (TBL) and AVX512-VBMI (vpermb) kernels do.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .constants import N_CENTROIDS, VECTOR_DIM

U8 = npt.NDArray[np.uint8]
I8 = npt.NDArray[np.int8]
Bool = npt.NDArray[np.bool_]

_TABLE_SIZE = 2 * N_CENTROIDS  # 64


def sign_bits(normalised: npt.NDArray[np.float32]) -> Bool:
    """S = 1 iff w' < 0. Both +0 and -0 are "positive" (S = 0); padding rows are +0, hence S = 0."""
    return np.less(normalised, np.float32(0))


def pack_bytes(q: U8, s0: Bool, s1: Bool, s2: Bool) -> U8:
    """Pack index and signs of a triple into the S3D8 byte (arrays of equal shape)."""
    qq = np.asarray(q, dtype=np.uint8)
    if qq.size and int(qq.max()) >= N_CENTROIDS:
        raise ValueError(f"centroid index {int(qq.max())} out of range 0..{N_CENTROIDS - 1}")
    b0 = np.asarray(s0, dtype=np.uint8)
    b1 = np.asarray(s1, dtype=np.uint8)
    b2 = np.asarray(s2, dtype=np.uint8)
    return (b0 | (qq << np.uint8(1)) | (b1 << np.uint8(6)) | ((b0 ^ b2) << np.uint8(7))).astype(np.uint8)


def unpack_bytes(b: U8) -> tuple[U8, Bool, Bool, Bool]:
    """Inverse of :func:`pack_bytes`: (q, S0, S1, S2)."""
    bb = np.asarray(b, dtype=np.uint8)
    s0 = (bb & np.uint8(1)).astype(bool)
    q = ((bb >> np.uint8(1)) & np.uint8(0x1F)).astype(np.uint8)
    s1 = ((bb >> np.uint8(6)) & np.uint8(1)).astype(bool)
    s2 = (((bb >> np.uint8(7)) ^ bb) & np.uint8(1)).astype(bool)
    return q, s0, s1, s2


def decode_tables(codebook: npt.NDArray[np.integer]) -> tuple[I8, I8, I8]:
    """The three 64-entry int8 tables of section 2, built once per matrix.

    ``L0[2l] = +C[l][0], L0[2l+1] = -C[l][0]`` (sign in the index LSB), ``L1[l] = +C[l][1],
    L1[32+l] = -C[l][1]`` (sign in the index MSB), ``L2`` like ``L0`` with component 2.
    """
    c = np.asarray(codebook, dtype=np.int16).reshape(N_CENTROIDS, VECTOR_DIM)
    l0 = np.empty(_TABLE_SIZE, dtype=np.int16)
    l2 = np.empty(_TABLE_SIZE, dtype=np.int16)
    l0[0::2], l0[1::2] = c[:, 0], -c[:, 0]
    l2[0::2], l2[1::2] = c[:, 2], -c[:, 2]
    l1 = np.concatenate([c[:, 1], -c[:, 1]])
    return l0.astype(np.int8), l1.astype(np.int8), l2.astype(np.int8)


def decode_bytes(b: U8, tables: tuple[I8, I8, I8]) -> tuple[I8, I8, I8]:
    """Decode packed bytes with the tables exactly as the kernels do; returns int8 rows 3p, 3p+1, 3p+2."""
    bb = np.asarray(b, dtype=np.uint8)
    l0, l1, l2 = tables
    i0 = bb & np.uint8(0x3F)
    i1 = (bb >> np.uint8(1)) & np.uint8(0x3F)
    i2 = i0 ^ (bb >> np.uint8(7))
    return l0[i0], l1[i1], l2[i2]

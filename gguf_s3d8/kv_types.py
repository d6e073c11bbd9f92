"""numpy reference of the KV-cache types Q4_HQQ, Q4_HQQ_128 and TQ3_0 (ggml-kvq.h in the patch series).

The types themselves (ids, geometry, which codec encodes each) are defined in :mod:`gguf_s3d8.ggml_types`, the one table
of types (``TYPES["tq3_0"].encode(x)``, ``.decode(data)``, ``KV_TYPES``); this module holds their codecs.

Quantisers and dequantisers give the bytes and floats of the C reference bit for bit: every step is the
same fp32 operation in the same order (the C file is compiled without fused multiply-adds), sums run
sequentially over the values of a block, and fp16 rounding is numpy's round-to-nearest-even, as ggml's.
The HQQ shrinkage uses p = 0.5 (|e|^-0.5 = 1/sqrt|e|, correctly rounded on both sides) for that reason.

Layouts (little endian, per block):
  Q4_HQQ     (32 values, 20 bytes):  fp16 d, fp16 m, 16 bytes of nibbles (low: value j, high: j + 16)
  Q4_HQQ_128 (128 values, 68 bytes): fp16 d, fp16 m, 64 bytes: sub-block b packed as Q4_HQQ at 16*b
  TQ3_0      (32 values, 14 bytes):  fp16 d, qs[8] (bits 0..1 of value j at qs[j % 8] bit 2*(j // 8)),
                                     hb[4] (bit 2 of value j at hb[j // 8] bit j % 8)
  value = d*q + m (HQQ types), d*TQ3_LEVELS[i] (TQ3_0).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt


#: the 8-level Lloyd-Max quantiser of N(0, 1) times 88/2.1519457, rounded (kvalues_tq3_0)
TQ3_LEVELS: Final = np.array([-88, -55, -31, -10, 10, 31, 55, 88], dtype=np.int8)
LLOYD_MAX_N01: Final = np.array([-2.1519457, -1.3439093, -0.7560053, -0.2450942,
                                 0.2450942, 0.7560053, 1.3439093, 2.1519457])
_TQ3_MIDPOINTS: Final = np.array([-71.5, -43.0, -20.5, 0.0, 20.5, 43.0, 71.5], dtype=np.float32)

HQQ_ITERS: Final = 20
F32 = np.float32
FloatArray = npt.NDArray[np.float32]


def _f16(x: FloatArray) -> FloatArray:
    """Round to fp16 and back (the value stored in a block)."""
    return x.astype(np.float16).astype(np.float32)


def hqq_params(xb: FloatArray) -> tuple[FloatArray, FloatArray]:
    """d = 1/s and m = -z/s (fp32) of each row of xb (n_blocks, group): range scale, HQQ zero point."""
    xb = np.ascontiguousarray(xb, dtype=F32)
    nb, n = xb.shape
    mn = xb[:, 0].copy()
    mx = xb[:, 0].copy()
    for j in range(1, n):
        mn = np.where(xb[:, j] < mn, xb[:, j], mn)
        mx = np.where(xb[:, j] > mx, xb[:, j], mx)
    const = ~(mx > mn)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.where(const, F32(1), F32(15) / np.where(const, F32(1), mx - mn)).astype(F32)
        z = (-mn * s).astype(F32)
        best_z = z.copy()
        best_err = np.full(nb, np.inf, dtype=F32)
        beta = F32(10)
        active = ~const
        for _ in range(HQQ_ITERS):
            err = np.zeros(nb, dtype=F32)
            zsum = np.zeros(nb, dtype=F32)
            for j in range(n):
                x = xb[:, j]
                q = np.floor(x * s + z + F32(0.5))
                q = np.where(q < 0, F32(0), np.where(q > 15, F32(15), q))
                e = x - (q - z) / s
                ae = np.abs(e)
                err = err + ae
                sh = ae - F32(1) / (beta * np.sqrt(ae))
                we = np.where(sh > 0, np.copysign(sh, e), F32(0))
                zsum = zsum + (q - (x - we) * s)
            improved = active & (err < best_err)
            best_err = np.where(improved, err, best_err)
            best_z = np.where(improved, z, best_z)
            z = np.where(improved, zsum / F32(n), z)
            active = improved
            beta = F32(beta * F32(1.01))
            if not active.any():
                break
        d = np.where(const, F32(0), F32(1) / s)
        m = np.where(const, mn, -best_z / s)
    return d.astype(F32), m.astype(F32)


def _hqq_codes(xb: FloatArray, d16: FloatArray, m16: FloatArray) -> npt.NDArray[np.uint8]:
    with np.errstate(divide="ignore"):
        idv = np.where(d16 != 0, F32(1) / np.where(d16 != 0, d16, F32(1)), F32(0)).astype(F32)
    q = np.floor((xb - m16[:, None]) * idv[:, None] + F32(0.5))
    return np.clip(q, 0, 15).astype(np.uint8)


def _pack_nibbles(q: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """(nb, G) codes -> (nb, G/2) bytes, each 32-value sub-block as in Q4_1."""
    nb, g = q.shape
    q = q.reshape(nb, g // 32, 2, 16)
    return (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(nb, g // 2).astype(np.uint8, copy=False)


def _unpack_nibbles(qs: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    nb, h = qs.shape
    qs = qs.reshape(nb, h // 16, 1, 16)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(nb, 2 * h)


def quantize_hqq(x: npt.ArrayLike, group: int) -> bytes:
    """Q4_HQQ (group 32) or Q4_HQQ_128 (group 128) bytes of a float array whose size is a multiple of group."""
    xb = np.asarray(x, dtype=F32).reshape(-1, group)
    d, m = hqq_params(xb)
    d16, m16 = d.astype(np.float16), m.astype(np.float16)
    q = _hqq_codes(xb, d16.astype(F32), m16.astype(F32))
    out = np.empty((xb.shape[0], 4 + group // 2), dtype=np.uint8)
    out[:, 0:2] = d16.view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = m16.view(np.uint8).reshape(-1, 2)
    out[:, 4:] = _pack_nibbles(q)
    return out.tobytes()


def dequantize_hqq(data: bytes, group: int) -> FloatArray:
    b = np.frombuffer(data, dtype=np.uint8).reshape(-1, 4 + group // 2)
    d = b[:, 0:2].copy().view(np.float16).astype(F32)
    m = b[:, 2:4].copy().view(np.float16).astype(F32)
    q = _unpack_nibbles(b[:, 4:]).astype(F32)
    return (d * q + m).reshape(-1).astype(F32)


def _tq3_index(v: FloatArray) -> npt.NDArray[np.uint8]:
    """Nearest level (ties to the lower one): the number of midpoints below v."""
    return (v[..., None] > _TQ3_MIDPOINTS).sum(axis=-1).astype(np.uint8)


def quantize_tq3_0(x: npt.ArrayLike) -> bytes:
    """TQ3_0 bytes: searched fp16 scale d = fp16(max|x|*f/88), f = 20/20 .. 10/20, least squared error."""
    xb = np.asarray(x, dtype=F32).reshape(-1, 32)
    nb = xb.shape[0]
    amax = np.zeros(nb, dtype=F32)
    for j in range(32):
        a = np.abs(xb[:, j])
        amax = np.where(a > amax, a, amax)
    levels = TQ3_LEVELS.astype(F32)
    best_d = np.zeros(nb, dtype=np.float16)
    best_err = np.full(nb, np.inf, dtype=F32)
    for c in range(11):
        f = F32(20 - c) / F32(20)
        dh = ((amax * f) / F32(88)).astype(np.float16)
        d = dh.astype(F32)
        with np.errstate(divide="ignore"):
            idv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)
        err = np.zeros(nb, dtype=F32)
        for j in range(32):
            e = xb[:, j] - d * levels[_tq3_index(xb[:, j] * idv)]
            err = err + e * e
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_d = np.where(better, dh, best_d)
    d = best_d.astype(F32)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, F32(1) / np.where(d != 0, d, F32(1)), F32(0)).astype(F32)
    q = _tq3_index(xb * idv[:, None])                      # (nb, 32)
    g = q.reshape(nb, 4, 8)                                # value 8*g + j
    qs = np.zeros((nb, 8), dtype=np.uint8)
    hb = np.zeros((nb, 4), dtype=np.uint8)
    for gi in range(4):
        qs |= ((g[:, gi, :] & 3) << (2 * gi)).astype(np.uint8)
        hb[:, gi] = ((g[:, gi, :] >> 2).astype(np.uint8) << np.arange(8, dtype=np.uint8)).sum(axis=1).astype(np.uint8)
    out = np.empty((nb, 14), dtype=np.uint8)
    out[:, 0:2] = best_d.view(np.uint8).reshape(-1, 2)
    out[:, 2:10] = qs
    out[:, 10:14] = hb
    return out.tobytes()


def tq3_indices(data: bytes) -> npt.NDArray[np.uint8]:
    b = np.frombuffer(data, dtype=np.uint8).reshape(-1, 14)
    qs, hb = b[:, 2:10], b[:, 10:14]
    j = np.arange(32)
    lo = (qs[:, j % 8] >> (2 * (j // 8))) & 3
    hi = (hb[:, j // 8] >> (j % 8)) & 1
    return (lo | (hi << 2)).astype(np.uint8)


def dequantize_tq3_0(data: bytes) -> FloatArray:
    b = np.frombuffer(data, dtype=np.uint8).reshape(-1, 14)
    d = b[:, 0:2].copy().view(np.float16).astype(F32)
    return (d * TQ3_LEVELS.astype(F32)[tq3_indices(data)]).reshape(-1).astype(F32)

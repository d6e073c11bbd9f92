"""The integer reference matmul (format section 3) that every C kernel is compared with bit for bit.

``y_i = ((float) acc_i * s) * alpha_i`` with ``acc_i = sum_j x_q[j] * w_int[i][j]`` exact in int32, the
activation quantised per row by :mod:`gguf_s3d8.activations` and ``w_int`` decoded through the 64-entry
tables. Accumulation is exact (int64 here, checked to fit int32), so the order of summation cannot matter;
the epilogue is two fp32 multiplications in exactly that order.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .activations import quantize_activations
from .errors import S3D8InputError
from .quantize import decode_int8
from .scales import scales_to_fp32

F32 = npt.NDArray[np.float32]
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
#: Output rows multiplied per step (bounds the int64 copy of the weights).
ROWS_PER_CHUNK = 1024


def integer_matmul(x_q: npt.NDArray[np.int8], w_int: npt.NDArray[np.int8], *, name: str = "") -> npt.NDArray[np.int32]:
    """Exact ``acc[t, i] = sum_j x_q[t, j] * w_int[i, j]``; raises if a sum leaves the int32 range."""
    m, k = x_q.shape
    n = w_int.shape[0]
    xq = x_q.astype(np.int64)
    acc = np.empty((m, n), dtype=np.int32)
    for r0 in range(0, n, ROWS_PER_CHUNK):
        r1 = min(n, r0 + ROWS_PER_CHUNK)
        part = xq @ w_int[r0:r1].astype(np.int64).T
        if part.size and (part.min() < _I32_MIN or part.max() > _I32_MAX):
            raise S3D8InputError(name, f"int32 accumulator overflow (k={k} is too long for exact int32 sums)")
        acc[:, r0:r1] = part
    return acc


def epilogue(acc: npt.NDArray[np.int32], s: F32, alpha: F32) -> F32:
    """``((float) acc * s) * alpha`` in fp32, in exactly that order (s per activation row, alpha per output)."""
    with np.errstate(over="ignore"):
        return (acc.astype(np.float32) * s[:, None]) * alpha[None, :]


def reference_matmul(container: npt.ArrayLike | bytes, x: npt.ArrayLike, *, name: str = "") -> F32:
    """y = x W^T through S3D8 integer arithmetic: x fp32 (m, k), container of W (n, k) -> fp32 (m, n)."""
    w_int, alpha = decode_int8(container, name=name)
    xa = np.asarray(x)
    if xa.ndim != 2 or xa.shape[1] != w_int.shape[1]:
        raise S3D8InputError(name, f"activations must have shape (m, {w_int.shape[1]}), got {xa.shape}")
    x_q, s_bits = quantize_activations(xa, name=name)
    acc = integer_matmul(x_q, w_int, name=name)
    return epilogue(acc, scales_to_fp32(s_bits), alpha)

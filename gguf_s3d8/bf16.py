"""bfloat16 round-to-nearest-even, the one definition every scale in the format goes through.

A bf16 number is the top 16 bits of an fp32 number. Rounding fp32 -> bf16 to nearest, ties to even, is the
integer trick ``(u + 0x7FFF + ((u >> 16) & 1)) >> 16`` on the fp32 bit pattern ``u``: it is exact for every
finite input (subnormals included: bf16 has fp32's exponent range, so subnormal fp32 values round to
subnormal bf16 values or to zero, and values near FLT_MAX may round to infinity), and matches PyTorch's
``.to(torch.bfloat16)`` and C's usual ``ggml_compute_fp32_to_bf16``. NaN is kept a (quiet) NaN.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_F32_ABS_MASK = np.uint32(0x7FFFFFFF)
_F32_INF_BITS = np.uint32(0x7F800000)


def fp32_to_bf16_bits(x: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """Round fp32 values to bfloat16 (nearest, ties to even); returns the bf16 bit patterns as uint16."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32)
    # uint32 arithmetic; wrap-around can only happen for NaN patterns, which are replaced below.
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    is_nan = (u & _F32_ABS_MASK) > _F32_INF_BITS
    quiet_nan = (u >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16)


def bf16_bits_to_fp32(bits: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """Widen bf16 bit patterns (uint16) to the fp32 values they denote (exact)."""
    b = np.ascontiguousarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def bf16_round(x: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """fp32 -> nearest-even bf16 -> fp32: the value a bf16 store of ``x`` would hold."""
    return bf16_bits_to_fp32(fp32_to_bf16_bits(x))


def bf16_is_finite(bits: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """True where a bf16 bit pattern is finite (exponent field not all ones)."""
    b = np.asarray(bits, dtype=np.uint16)
    return (b & np.uint16(0x7F80)) != np.uint16(0x7F80)

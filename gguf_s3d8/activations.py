"""Per-token activation quantisation (format section 3), shared by the runtime reference and QAT.

For each activation row x (one token) of length k::

    s   = bf16_rne(max_j |x_j| / 127)        (same rule as the weight scales)
    inv = (s == 0) ? 0 : 1.0f / s           (fp32)
    x_q = clamp(rne(x_j * inv), -127, 127)  (fp32 product, round half to even, int8)

Beyond the format page: when ``s <= 2^-128`` (a bf16 subnormal; row absmax below about 3.8e-37 but not
zero), ``1.0f / s`` overflows to +inf. IEEE arithmetic then gives ``x_j * inv = +/-inf`` for
``x_j != 0``, which the clamp maps to +/-127, and ``0 * inf = NaN`` for ``x_j == 0``, which this reference
maps to 0 (the mathematical value). Golden vectors avoid that corner (see docs/codec.md).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .constants import ACT_QMAX
from .errors import S3D8InputError
from .inputs import check_finite
from .scales import absmax_scale_bf16, scales_to_fp32

F32 = npt.NDArray[np.float32]


def quantize_activations(x: npt.ArrayLike, *, name: str = "") -> tuple[npt.NDArray[np.int8], npt.NDArray[np.uint16]]:
    """Quantise fp32 activations (m, k) per row; returns ``(x_q int8 (m, k), s as bf16 bits uint16 (m,))``."""
    arr = np.asarray(x)
    if arr.ndim != 2 or not np.issubdtype(arr.dtype, np.floating):
        raise S3D8InputError(name, f"activations must be a 2-D float array (m, k), got {arr.dtype} {arr.shape}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    check_finite(arr, name=name, what="activation")
    s_bits = absmax_scale_bf16(arr)
    s = scales_to_fp32(s_bits)
    inv = np.zeros_like(s)
    with np.errstate(over="ignore", invalid="ignore"):
        np.divide(np.float32(1), s, out=inv, where=(s != np.float32(0)))
        scaled = arr * inv[:, None]
    scaled[np.isnan(scaled)] = np.float32(0)
    q = np.clip(np.rint(scaled), -ACT_QMAX, ACT_QMAX)
    return q.astype(np.int8), s_bits

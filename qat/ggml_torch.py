"""Torch versions of the fallback types' arithmetic (values only), for matrices S3D8 cannot hold.

The converter stores such matrices as Q8_0 (or F16 when k % 32 != 0) through ``gguf.quants``, whose Q8_0 code is
bit-exact with ggml's reference quantiser; :func:`q8_0_dequantised` reproduces
``gguf.quants.dequantize(gguf.quants.quantize(w, Q8_0), Q8_0)`` bit for bit (tested):

    d  = max|block| / 127 (fp32);  id = 0 if d == 0 else 1 / d;  q = roundf(block * id)  (half away from zero)
    stored d16 = fp16_rne(d);      dequantised = q * float(d16)

At run time ggml's CPU matmul with a Q8_0 weight quantises the activations to Q8_0 blocks of 32 as well
(``quantize_row_q8_0``; the x86 SIMD path rounds half to even), and an F16 weight multiplies f16-rounded
activations: :func:`q8_0_activations` and :func:`qat.numerics.f16_round` model those.
"""

from __future__ import annotations

import torch

from qat.numerics import f16_round, safe_reciprocal

__all__ = ["Q8_0_BLOCK", "q8_0_dequantised", "q8_0_activations"]

Q8_0_BLOCK = 32


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf`` (half away from zero), written as gguf-py's ``np_roundf`` (every step exact in fp32)."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored))) + 0.0  # + 0.0: int8 codes have no -0


def _blocks(x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 needs the last dimension to be a multiple of {Q8_0_BLOCK}, got {x.shape[-1]}")
    return x.detach().to(torch.float32).reshape(-1, Q8_0_BLOCK)


def q8_0_dequantised(w: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize(w, Q8_0))`` of gguf-py, bit for bit (any shape whose last axis is a multiple of 32)."""
    b = _blocks(w)
    d = b.abs().amax(dim=1, keepdim=True) / 127
    q = _roundf(b * safe_reciprocal(d))
    return (q * f16_round(d)).reshape(w.shape)


def q8_0_activations(x: torch.Tensor) -> torch.Tensor:
    """Activations as ggml's Q8_0 matmul sees them: per 32-block, ``rne(x / d) * fp16(d)``, d = max|x| / 127."""
    b = _blocks(x)
    d = b.abs().amax(dim=1, keepdim=True) / 127
    return ((torch.round(b * safe_reciprocal(d)) + 0.0) * f16_round(d)).reshape(x.shape)



"""Torch numerics primitives shared by the fake quantisers (the lowest layer of ``qat``: imports only torch).

Each is one definition of a piece of arithmetic that the codec (numpy), ggml (C) and several torch modules
must agree on bit for bit:

* :func:`bf16_rne` / :func:`f16_round` - fp32 rounded to bfloat16 / float16 (nearest, ties to even), as fp32;
* :func:`absmax_bf16_scale` - ``bf16_rne(absmax / divisor)``, the bf16 absmax scale of S3D8 rows and of the
  simulated formats' groups;
* :func:`safe_reciprocal` - ``1 / d``, 0 where ``d`` is 0 (ggml's ``id = d ? 1/d : 0``; values are then
  *multiplied* by it, as ggml does);
* :func:`safe_divide` - ``x / d``, 0 where ``d`` is 0 (the codec's normalisation, which *divides*).

Multiplying by a reciprocal and dividing round differently, so both exist; callers pick the one that their
reference implementation uses.
"""

from __future__ import annotations

import torch

__all__ = ["bf16_rne", "f16_round", "absmax_bf16_scale", "safe_reciprocal", "safe_divide"]


def bf16_rne(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to the nearest bfloat16 (ties to even) and return it as float32.

    torch's float32 -> bfloat16 cast rounds to nearest even, as ggml's ``GGML_FP32_TO_BF16`` does.
    """
    return x.to(torch.float32).to(torch.bfloat16).to(torch.float32)


def f16_round(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16 (nearest even) -> fp32, what an F16 tensor or ggml's f16 matmul operand holds."""
    return x.detach().to(torch.float16).to(torch.float32)


def absmax_bf16_scale(amax: torch.Tensor, divisor: float) -> torch.Tensor:
    """``bf16_rne(amax / divisor)`` (fp32 division, then rounded to bf16): the bf16 absmax scale."""
    return bf16_rne(amax / divisor)


def safe_reciprocal(d: torch.Tensor) -> torch.Tensor:
    """``1 / d`` elementwise, 0 where ``d`` is 0."""
    zero = d == 0
    return torch.where(zero, torch.zeros_like(d), 1 / torch.where(zero, torch.ones_like(d), d))


def safe_divide(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``x / d`` elementwise (``d`` broadcast to ``x``), 0 where ``d`` is 0."""
    d = d.expand_as(x)
    zero = d == 0
    return torch.where(zero, torch.zeros_like(x), x / torch.where(zero, torch.ones_like(d), d))

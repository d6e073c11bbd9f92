"""Independent references of llama.cpp's Llama tensor layout, for the tests (the converter itself lays tensors
out with upstream's model classes, ``convert/upstream_source.py``).

* :func:`meta_rope_rows`: Meta's checkpoints apply RoPE to interleaved pairs (dims 2i, 2i+1 of a head); HF's
  ``rotate_half`` pairs dim i with i + head_dim/2, so HF's conversion script permuted the rows of
  ``q_proj``/``k_proj`` within each head. llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` expects Meta's order.
* :func:`llama3_rope_factors`: Llama 3.1+'s RoPE scaling (``rope_type: llama3``) as the per-frequency divisors of
  the ``rope_freqs.weight`` tensor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def meta_rope_rows(w: Any, n_head: int) -> Any:
    """The rows of a q/k projection (or bias; numpy array or torch tensor) from HF's rotate-half layout to Meta's.

    Within each head of ``d`` rows HF stores ``[x_0, x_2, x_4, ..., x_1, x_3, ...]`` (the even members of
    the rotary pairs first, then the odd ones); Meta/llama.cpp interleave them again. Viewing a head's
    rows as a ``(2, d/2)`` grid and transposing it to ``(d/2, 2)`` does exactly that.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot split {rows} q/k rows into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1+'s RoPE scaling (``rope_type: llama3``).

    Frequencies with wavelength below ``original_max_position_embeddings / high_freq_factor`` are kept
    (factor 1), those above ``.../low_freq_factor`` are divided by ``factor``, and the band in between is
    interpolated smoothly, in float32 step by step (bit-identical to upstream's converter for power-of-two
    head sizes).
    """
    f32 = np.float32
    base = float(rope.get("rope_theta", 10000.0))
    factor = f32(rope.get("factor", 8.0))
    lo = float(rope.get("low_freq_factor", 1.0))
    hi = float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    expo = np.arange(0, head_dim, 2, dtype=f32) / f32(head_dim)
    inv_freq = f32(1.0) / (np.float64(base) ** expo.astype(np.float64)).astype(f32)
    wavelen = f32(2 * math.pi) / inv_freq
    smooth = (f32(old_ctx) / wavelen - f32(lo)) / f32(hi - lo)
    mid = f32(1.0) / ((f32(1.0) - smooth) / factor + smooth)
    out = np.where(wavelen < old_ctx / hi, f32(1.0), np.where(wavelen > old_ctx / lo, factor, mid))
    return out.astype(f32)

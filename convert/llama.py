"""Llama-family layout helpers shared by the mllama text model (``convert/mllama.py``) and QAT (``qat.student``).

Text checkpoints of every architecture (Llama included) are converted by upstream's model classes
(``convert/upstream_source.py``); what stays here is what our own mllama conversion and QAT's row bookkeeping need:

* **q/k row order.** Meta's checkpoints apply RoPE to interleaved pairs (dims 2i, 2i+1 of a head);
  HF's ``rotate_half`` pairs dim i with i + head_dim/2, so HF's conversion script permuted the rows of
  ``q_proj``/``k_proj`` within each head. llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` expects Meta's order, so
  the converter undoes HF's permutation (:func:`hf_to_meta_rope_rows`; the same rows as upstream's
  ``LlamaModel.permute``, pinned by ``tests/python/test_convert_upstream.py``).
* **Llama-3 RoPE scaling** (``rope_type: llama3``) is not a GGUF key but a ``rope_freqs.weight`` tensor
  of per-frequency divisors (:func:`llama3_rope_factors`).
* :class:`LlamaHParams`: the hyper-parameters of a Llama text config.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConvertError

def hf_to_meta_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder the rows of a q/k projection (or bias) from HF's rotate-half layout to Meta's.

    Within each head of ``d`` rows HF stores ``[x_0, x_2, x_4, ..., x_1, x_3, ...]`` (the even members of
    the rotary pairs first, then the odd ones); Meta/llama.cpp interleave them again. Viewing a head's
    rows as a ``(2, d/2)`` grid and transposing it to ``(d/2, 2)`` does exactly that.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ConvertError(f"cannot split {rows} q/k rows into {n_head} heads of even size")
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def meta_layout(hf_name: str, w: Any, *, n_head: int, n_head_kv: int) -> Any:
    """An HF tensor (numpy array, or torch tensor: QAT applies it to row indices) in llama.cpp's layout: the
    rows of q/k projections (and biases) reordered by :func:`hf_to_meta_rope_rows`, everything else as is."""
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return hf_to_meta_rope_rows(w, n_head)
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return hf_to_meta_rope_rows(w, n_head_kv)
    return w


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3.1+'s RoPE scaling (``rope_type: llama3``).

    Frequencies with wavelength below ``original_max_position_embeddings / high_freq_factor`` are kept
    (factor 1), those above ``.../low_freq_factor`` are divided by ``factor``, and the band in between is
    interpolated smoothly. The arithmetic is float32 step by step, as in upstream's converter, so the
    tensor is bit-identical to upstream's for power-of-two head sizes (the power is evaluated in float64
    and rounded once; torch's float32 pow can differ from that by one ulp for other sizes).
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


@dataclass(frozen=True)
class LlamaHParams:
    """The hyper-parameters the llama GGUF needs, with HF's alternative key spellings resolved."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    n_ctx: int | None
    rope: dict[str, Any]  # rope_parameters / rope_scaling merged with rope_theta
    raw: dict[str, Any]

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: Path) -> "LlamaHParams":
        def need(*keys: str) -> Any:
            for k in keys:
                if k in cfg:
                    return cfg[k]
            raise ConvertError(f"{where}/config.json: missing {' / '.join(keys)}")

        n_head = int(need("num_attention_heads"))
        n_embd = int(need("hidden_size"))
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if "rope_theta" not in rope and "rope_theta" in cfg:
            rope["rope_theta"] = cfg["rope_theta"]
        if "rope_type" not in rope and "type" in rope:
            rope["rope_type"] = rope["type"]
        return cls(
            n_layer=int(need("num_hidden_layers")),
            n_embd=n_embd,
            n_ff=int(need("intermediate_size")),
            n_head=n_head,
            n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=int(cfg.get("head_dim") or n_embd // n_head),
            vocab_size=int(need("vocab_size")),
            rms_eps=float(need("rms_norm_eps")),
            n_ctx=cfg.get("max_position_embeddings"),
            rope=rope,
            raw=cfg,
        )

"""HF ``LlamaForCausalLM`` checkpoints (Llama 2/3/3.2 text, SmolLM/SmolLM2, ...) -> GGUF ``llama``.

What a llama GGUF needs beyond renaming tensors:

* **q/k row order.** Meta's checkpoints apply RoPE to interleaved pairs (dims 2i, 2i+1 of a head);
  HF's ``rotate_half`` pairs dim i with i + head_dim/2, so HF's conversion script permuted the rows of
  ``q_proj``/``k_proj`` within each head. llama.cpp's ``LLAMA_ROPE_TYPE_NORM`` expects Meta's order, so
  the converter undoes HF's permutation (:func:`hf_to_meta_rope_rows`).
* **Metadata** under ``llama.*`` (the same keys and values upstream's ``convert_hf_to_gguf.py`` writes),
  ``general.*`` from gguf-py's ``Metadata`` heuristics (model card, directory name, parameter count)
  and the tokenizer (``convert/vocab.py``).
* **Llama-3 RoPE scaling** (``rope_type: llama3``) is not a GGUF key but a ``rope_freqs.weight`` tensor
  of per-frequency divisors (:func:`llama3_rope_factors`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

import gguf

from .common import ConversionOptions, TensorJob, add_general_metadata
from .errors import ConvertError, read_json
from .registry import register_hf_architecture
from .safetensors_io import TensorRecord, iter_checkpoint
from .tensor_types import file_type_of
from .vocab import add_bpe_vocab

#: HF tensors that carry no weights llama.cpp uses.
_SKIP_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


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


def _load_config(model_dir: Path) -> dict[str, Any]:
    """config.json as transformers normalises it (like upstream: defaults such as ``head_dim`` filled in,
    legacy ``rope_scaling``/``rope_theta`` folded into ``rope_parameters``); the raw JSON if transformers
    cannot parse it. Never runs remote code."""
    path = model_dir / "config.json"
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    try:
        import warnings

        from transformers import AutoConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(model_dir, trust_remote_code=False).to_dict()
    except Exception:  # transformers raises assorted types for configs it does not know
        return raw


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

    def add_shape_metadata(self, writer: gguf.GGUFWriter) -> None:
        """The ``{arch}.*`` size keys shared by every llama-family text model (llama, mllama)."""
        writer.add_block_count(self.n_layer)
        if self.n_ctx is not None:
            writer.add_context_length(int(self.n_ctx))
        writer.add_embedding_length(self.n_embd)
        writer.add_feed_forward_length(self.n_ff)
        writer.add_head_count(self.n_head)
        writer.add_head_count_kv(self.n_head_kv)

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


class LlamaHfSource:
    """A ``LlamaForCausalLM`` safetensors checkpoint as a :class:`convert.common.ModelSource`."""

    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA]

    def __init__(self, model_dir: Path, *, tokenizer_pre: str | None = None) -> None:
        self.model_dir = model_dir
        self.tokenizer_pre = tokenizer_pre
        self.hp = LlamaHParams.from_config(_load_config(model_dir), model_dir)
        self.name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, self.hp.n_layer)
        self.records = [r for r in iter_checkpoint(model_dir) if not r.name.endswith(_SKIP_SUFFIXES)]
        rope_type = str(self.hp.rope.get("rope_type", "default")).lower()
        if rope_type not in ("default", "llama3", "linear", "yarn"):
            raise ConvertError(f"{model_dir}: unsupported rope_type {rope_type!r} "
                               "(supported: default, llama3, linear, yarn)")
        self.rope_type = rope_type

    # -- tensors ---------------------------------------------------------------------------------

    def _gguf_name(self, hf_name: str) -> str:
        name = self.name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ConvertError(f"{self.model_dir}: cannot map tensor {hf_name!r} to a llama GGUF tensor")
        return name

    def _loader(self, rec: TensorRecord) -> Callable[[], np.ndarray]:
        return lambda: self.layout(rec.name, rec.load_f32())

    def layout(self, hf_name: str, w: np.ndarray) -> np.ndarray:
        """An HF tensor in llama.cpp's layout (:func:`meta_layout` with this model's head counts)."""
        return meta_layout(hf_name, w, n_head=self.hp.n_head, n_head_kv=self.hp.n_head_kv)

    def tensor_jobs(self) -> list[TensorJob]:
        jobs: list[TensorJob] = []
        if self.rope_type == "llama3":
            factors = llama3_rope_factors(self.hp.rope, self.hp.head_dim)
            jobs.append(TensorJob(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", factors.shape,
                                  lambda: factors, "rope_parameters"))
        for rec in self.records:
            jobs.append(TensorJob(self._gguf_name(rec.name), rec.shape, self._loader(rec), rec.name))
        if not any(j.name == "token_embd.weight" for j in jobs):
            raise ConvertError(f"{self.model_dir}: checkpoint has no token embedding (model.embed_tokens.weight)")
        return jobs

    # -- metadata --------------------------------------------------------------------------------

    def add_metadata(self, writer: gguf.GGUFWriter, options: ConversionOptions) -> None:
        hp = self.hp
        add_general_metadata(writer, self.model_dir)

        hp.add_shape_metadata(writer)
        if hp.raw.get("is_causal") is False:
            writer.add_causal_attention(False)
        rope = hp.rope
        if self.rope_type == "linear" and rope.get("factor") is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["factor"]))
        elif self.rope_type == "yarn" and rope.get("factor") is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(rope["factor"]))
            writer.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
            if (v := rope.get("extrapolation_factor")) is not None:
                writer.add_rope_scaling_yarn_ext_factor(float(v))
            if (v := rope.get("attention_factor", rope.get("attn_factor"))) is not None:
                writer.add_rope_scaling_yarn_attn_factor(float(v))
            if (v := rope.get("beta_fast")) is not None:
                writer.add_rope_scaling_yarn_beta_fast(float(v))
            if (v := rope.get("beta_slow")) is not None:
                writer.add_rope_scaling_yarn_beta_slow(float(v))
        if rope.get("rope_theta") is not None:
            writer.add_rope_freq_base(float(rope["rope_theta"]))
        writer.add_layer_norm_rms_eps(hp.rms_eps)
        if hp.raw.get("head_dim") is not None:
            writer.add_key_length(int(hp.raw["head_dim"]))
            writer.add_value_length(int(hp.raw["head_dim"]))
        writer.add_file_type(file_type_of(options.out_type))
        writer.add_vocab_size(hp.vocab_size)
        writer.add_rope_dimension_count(hp.head_dim)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

        add_bpe_vocab(writer, self.model_dir, hp.vocab_size, self.tokenizer_pre)
        if hp.vocab_size == 49152:
            # SmolLM/Granite-small tokenizers: upstream marks BOS as not auto-added for this vocab size
            # (their chat templates start with <|im_start|> themselves); kept for identical metadata.
            writer.add_add_bos_token(False)


@register_hf_architecture("LlamaForCausalLM")
def _make(model_dir: Path, *, tokenizer_pre: str | None = None) -> LlamaHfSource:
    return LlamaHfSource(model_dir, tokenizer_pre=tokenizer_pre)

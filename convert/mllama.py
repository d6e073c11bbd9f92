"""HF ``MllamaForConditionalGeneration`` (Llama 3.2 Vision) -> two GGUF files.

* the **text model**, GGUF architecture ``mllama``: a Llama 3.1 decoder in which the layers listed in
  ``cross_attention_layers`` are cross-attention blocks (no self-attention) attending the projected
  image features;
* with ``--mmproj``, the **vision encoder + projector** for llama.cpp's mtmd (``clip`` file with
  projector type ``mllama``).

Both go through the architecture-independent writer in ``convert/common.py`` (type selection, S3D8 and
the other encodings, atomic writing). What is specific to mllama:

* **Three vocabulary sizes** (11B: tokenizer 128257 entries, ``embed_tokens`` 128264 rows, ``lm_head``
  128256 rows). The token list is the full tokenizer (``<|image|>`` = id 128256 keeps its learned
  embedding row), ``token_embd`` keeps all its rows and ``output`` its 128256 rows; ``mllama.vocab_size``
  records the number of output rows.
* **q/k permutation** only for the self-attention layers (RoPE); cross-attention and vision q/k are
  stored as they are (their q/k norms act per head-dimension element, there is no RoPE).
* **Gates** are stored raw (``tanh`` is applied at inference), as 1-D F32 tensors.
* Vision **tables** (position, tile-position, pre/post tile embeddings) are named without a ``.weight``
  suffix, which keeps them F32 under every ``--type`` (the shared type rules quantise only ``*.weight``
  matrices); the patch embedding is a convolution kernel and must not be S3D8/Q8_0 either - its width
  (patch size) makes the shared rules fall back to F16.

Tensor names (``L`` = layer): text as Llama plus ``blk.L.cross_attn_{q,k,v,output}.weight``,
``blk.L.cross_attn_{q,k}_norm.weight``, ``blk.L.cross_attn_attn_gate``, ``blk.L.cross_attn_mlp_gate``;
vision ``v.patch_embd.weight``, ``v.class_embd``, ``v.position_embd``, ``v.position_gate``,
``v.tile_position_embd``, ``v.{pre,post}_tile_position_{embd,gate}``, ``v.{pre,post}_ln.*``,
``v.blk.L.*`` (local layers) and ``v.global.blk.L.*`` (+ ``gate_attn``, ``gate_ffn``), ``mm.0.*``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

if __name__ == "__main__" and not __package__:
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))
    from convert.mllama import main as _main

    raise SystemExit(_main())

import numpy as np

import gguf

from .common import ConversionOptions, ConversionReport, TensorJob, write_gguf
from .errors import ConvertError, read_json
from .llama import LlamaHParams, hf_to_meta_rope_rows, llama3_rope_factors
from .safetensors_io import TensorRecord, iter_checkpoint
from .tensor_types import FALLBACK_TYPES, OUT_TYPES, S3D8Options, file_type_of

ARCH = "mllama"
HF_ARCH = "MllamaForConditionalGeneration"

# HF checkpoints exist in two spellings: the Hub layout of Meta's release (transformers 4.45) and the
# layout transformers >= 4.52 saves ("model.language_model.*", top-level "lm_head"). Both are mapped to
# one canonical form: "text.<name in MllamaTextModel>", "text.lm_head.weight", "vision.<...>", "proj.<...>".
_PREFIXES = (
    ("language_model.model.", "text."),
    ("model.language_model.", "text."),
    ("language_model.lm_head.", "text.lm_head."),
    ("lm_head.", "text.lm_head."),
    ("vision_model.", "vision."),
    ("model.vision_model.", "vision."),
    ("multi_modal_projector.", "proj."),
    ("model.multi_modal_projector.", "proj."),
)


def canonical_name(hf_name: str) -> str | None:
    for old, new in _PREFIXES:
        if hf_name.startswith(old):
            return new + hf_name[len(old):]
    return None


def _load_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    cfg = read_json(path)
    if not isinstance(cfg, dict) or not isinstance(cfg.get("text_config"), dict) \
            or not isinstance(cfg.get("vision_config"), dict):
        raise ConvertError(f"{path}: not an mllama config (text_config / vision_config missing)")
    return cfg


def _checkpoint(model_dir: Path) -> dict[str, TensorRecord]:
    out: dict[str, TensorRecord] = {}
    for rec in iter_checkpoint(model_dir):
        name = canonical_name(rec.name)
        if name is None:
            raise ConvertError(f"{model_dir}: unexpected tensor {rec.name!r} in an mllama checkpoint")
        out[name] = rec
    return out


def _job(name: str, rec: TensorRecord, load: Callable[[], np.ndarray] | None = None,
         shape: tuple[int, ...] | None = None) -> TensorJob:
    return TensorJob(name, tuple(shape if shape is not None else rec.shape), load or rec.load_f32, rec.name)


# ---------------------------------------------------------------------------------------------------
# text model
# ---------------------------------------------------------------------------------------------------

_TEXT_LAYER_MAP = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "cross_attn.q_proj.weight": "cross_attn_q.weight",
    "cross_attn.k_proj.weight": "cross_attn_k.weight",
    "cross_attn.v_proj.weight": "cross_attn_v.weight",
    "cross_attn.o_proj.weight": "cross_attn_output.weight",
    "cross_attn.q_norm.weight": "cross_attn_q_norm.weight",
    "cross_attn.k_norm.weight": "cross_attn_k_norm.weight",
    "cross_attn_attn_gate": "cross_attn_attn_gate",
    "cross_attn_mlp_gate": "cross_attn_mlp_gate",
}


@dataclass(frozen=True)
class MllamaTextHParams:
    base: LlamaHParams
    cross_layers: tuple[int, ...]
    image_token_id: int

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: Path) -> "MllamaTextHParams":
        tc = cfg["text_config"]
        base = LlamaHParams.from_config(tc, where)
        cross = tuple(int(i) for i in tc.get("cross_attention_layers") or ())
        if not cross or any(i < 0 or i >= base.n_layer for i in cross):
            raise ConvertError(f"{where}/config.json: bad text_config.cross_attention_layers {list(cross)}")
        if base.head_dim * base.n_head != base.n_embd:
            raise ConvertError(f"{where}/config.json: hidden_size must be num_attention_heads * head_dim")
        img = cfg.get("image_token_index", base.vocab_size)
        return cls(base, cross, int(img))


class MllamaTextSource:
    """The text decoder of an mllama checkpoint, planned by our own code: GGUF names, shapes, llama.cpp's row layout
    and HF names of every tensor (what QAT and GPTQ plan with). The file itself is written by the series' model class
    (``conversion/mllama.py``); ``tests/python/test_convert_upstream.py`` pins that both agree."""

    arch = ARCH

    def __init__(self, model_dir: Path, *, tokenizer_pre: str | None = None) -> None:
        self.model_dir = model_dir
        self.tokenizer_pre = tokenizer_pre
        self.cfg = _load_config(model_dir)
        self.hp = MllamaTextHParams.from_config(self.cfg, model_dir)
        rope_type = str(self.hp.base.rope.get("rope_type", "default")).lower()
        if rope_type not in ("default", "llama3"):
            raise ConvertError(f"{model_dir}: unsupported rope_type {rope_type!r} for mllama (default, llama3)")
        self.rope_type = rope_type
        self.records = {k: v for k, v in _checkpoint(model_dir).items() if k.startswith("text.")}

    def _gguf_name(self, name: str) -> str:
        rest = name[len("text."):]
        if rest == "embed_tokens.weight":
            return "token_embd.weight"
        if rest == "norm.weight":
            return "output_norm.weight"
        if rest == "lm_head.weight":
            return "output.weight"
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", rest)
        if m and m.group(2) in _TEXT_LAYER_MAP:
            il = int(m.group(1))
            is_cross = il in self.hp.cross_layers
            if (m.group(2).startswith("cross_attn") and not is_cross) or (m.group(2).startswith("self_attn") and is_cross):
                raise ConvertError(f"{self.model_dir}: tensor {name!r} does not match the layer type of layer {il}")
            return f"blk.{il}.{_TEXT_LAYER_MAP[m.group(2)]}"
        raise ConvertError(f"{self.model_dir}: cannot map text tensor {name!r}")

    canonical = staticmethod(canonical_name)

    @staticmethod
    def owns_weight(hf_name: str) -> bool:
        """True for the HF tensors (any naming of the checkpoint or of the loaded model) this file holds."""
        return (canonical_name(hf_name) or "").startswith("text.")

    def layout(self, hf_name: str, w: np.ndarray) -> np.ndarray:
        """An HF tensor in llama.cpp's layout: the self-attention q/k rows are permuted for RoPE."""
        hp = self.hp.base
        if hf_name.endswith("self_attn.q_proj.weight"):
            return hf_to_meta_rope_rows(w, hp.n_head)
        if hf_name.endswith("self_attn.k_proj.weight"):
            return hf_to_meta_rope_rows(w, hp.n_head_kv)
        return w

    def tensor_jobs(self) -> list[TensorJob]:
        hp = self.hp.base
        jobs: list[TensorJob] = []
        if self.rope_type == "llama3":
            factors = llama3_rope_factors(hp.rope, hp.head_dim)
            jobs.append(TensorJob("rope_freqs.weight", factors.shape, lambda: factors, "rope_parameters"))
        for name in sorted(self.records, key=_natural_key):
            rec = self.records[name]
            load = (lambda r: lambda: self.layout(r.name, r.load_f32()))(rec)
            jobs.append(_job(self._gguf_name(name), rec, load))
        have = {j.name for j in jobs}
        for need in ("token_embd.weight", "output.weight", "output_norm.weight"):
            if need not in have:
                raise ConvertError(f"{self.model_dir}: checkpoint has no {need} tensor")
        emb = next(j for j in jobs if j.name == "token_embd.weight")
        out = next(j for j in jobs if j.name == "output.weight")
        if out.shape[0] != hp.vocab_size:
            raise ConvertError(f"{self.model_dir}: lm_head has {out.shape[0]} rows, vocab_size is {hp.vocab_size}")
        if emb.shape[0] <= self.hp.image_token_id:
            raise ConvertError(f"{self.model_dir}: embed_tokens has {emb.shape[0]} rows, "
                               f"the image token id is {self.hp.image_token_id}")
        return jobs


# ---------------------------------------------------------------------------------------------------
# vision encoder + projector (mtmd)
# ---------------------------------------------------------------------------------------------------

_VISION_LAYER_MAP = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_out.weight",
    "input_layernorm.weight": "ln1.weight",
    "input_layernorm.bias": "ln1.bias",
    "post_attention_layernorm.weight": "ln2.weight",
    "post_attention_layernorm.bias": "ln2.bias",
    "mlp.fc1.weight": "ffn_up.weight",
    "mlp.fc1.bias": "ffn_up.bias",
    "mlp.fc2.weight": "ffn_down.weight",
    "mlp.fc2.bias": "ffn_down.bias",
    "gate_attn": "gate_attn",
    "gate_ffn": "gate_ffn",
}

_VISION_MAP = {
    "vision.patch_embedding.weight": "v.patch_embd.weight",
    "vision.class_embedding": "v.class_embd",
    "vision.gated_positional_embedding.embedding": "v.position_embd",
    "vision.gated_positional_embedding.gate": "v.position_gate",
    "vision.gated_positional_embedding.tile_embedding.weight": "v.tile_position_embd",
    "vision.pre_tile_positional_embedding.embedding.weight": "v.pre_tile_position_embd",
    "vision.pre_tile_positional_embedding.gate": "v.pre_tile_position_gate",
    "vision.post_tile_positional_embedding.embedding.weight": "v.post_tile_position_embd",
    "vision.post_tile_positional_embedding.gate": "v.post_tile_position_gate",
    "vision.layernorm_pre.weight": "v.pre_ln.weight",
    "vision.layernorm_pre.bias": "v.pre_ln.bias",
    "vision.layernorm_post.weight": "v.post_ln.weight",
    "vision.layernorm_post.bias": "v.post_ln.bias",
    "proj.weight": "mm.0.weight",
    "proj.bias": "mm.0.bias",
}


@dataclass(frozen=True)
class MllamaVisionHParams:
    image_size: int
    patch_size: int
    n_embd: int
    n_ff: int
    n_head: int
    n_layer: int
    n_layer_global: int
    taps: tuple[int, ...]
    max_num_tiles: int
    eps: float
    n_embd_out: int  # projector output = text hidden size
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @classmethod
    def from_config(cls, cfg: dict[str, Any], model_dir: Path) -> "MllamaVisionHParams":
        vc = cfg["vision_config"]
        tc = cfg["text_config"]
        try:
            hp = cls(
                image_size=int(vc.get("image_size", 560)), patch_size=int(vc.get("patch_size", 14)),
                n_embd=int(vc["hidden_size"]), n_ff=int(vc["intermediate_size"]),
                n_head=int(vc["attention_heads"]), n_layer=int(vc["num_hidden_layers"]),
                n_layer_global=int(vc["num_global_layers"]),
                taps=tuple(int(i) for i in vc["intermediate_layers_indices"]),
                max_num_tiles=int(vc.get("max_num_tiles", 4)), eps=float(vc.get("norm_eps", 1e-5)),
                n_embd_out=int(tc["hidden_size"]),
                image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConvertError(f"{model_dir}/config.json: incomplete vision_config ({e})") from e
        if vc.get("hidden_act", "gelu") != "gelu":
            raise ConvertError(f"{model_dir}/config.json: vision hidden_act {vc.get('hidden_act')!r} is not supported")
        if int(vc.get("vision_output_dim", hp.n_embd * (1 + len(hp.taps)))) != hp.n_embd * (1 + len(hp.taps)):
            raise ConvertError(f"{model_dir}/config.json: vision_output_dim must be hidden_size * (1 + #taps)")
        if any(t < 0 or t >= hp.n_layer for t in hp.taps):
            raise ConvertError(f"{model_dir}/config.json: intermediate_layers_indices out of range")
        pp = model_dir / "preprocessor_config.json"
        if pp.is_file():
            pc = read_json(pp)
            size = pc.get("size") or {}
            if size and (int(size.get("height", hp.image_size)) != hp.image_size
                         or int(size.get("width", hp.image_size)) != hp.image_size):
                raise ConvertError(f"{pp}: tile size {size} does not match vision_config.image_size {hp.image_size}")
            if int(pc.get("max_image_tiles", hp.max_num_tiles)) != hp.max_num_tiles:
                raise ConvertError(f"{pp}: max_image_tiles differs from vision_config.max_num_tiles")
            if int(pc.get("resample", 2)) != 2:
                raise ConvertError(f"{pp}: only bilinear resampling (resample=2) is supported")
            hp = MllamaVisionHParams(**{**hp.__dict__,
                                        "image_mean": tuple(float(x) for x in pc.get("image_mean", hp.image_mean)),
                                        "image_std": tuple(float(x) for x in pc.get("image_std", hp.image_std))})
        return hp


class MllamaVisionSource:
    """The vision encoder and projector of an mllama checkpoint, as an mtmd ``clip`` GGUF."""

    arch = "clip"

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.cfg = _load_config(model_dir)
        self.hp = MllamaVisionHParams.from_config(self.cfg, model_dir)
        self.records = {k: v for k, v in _checkpoint(model_dir).items() if not k.startswith("text.")}

    def _gguf_name(self, name: str) -> str:
        if name in _VISION_MAP:
            return _VISION_MAP[name]
        m = re.fullmatch(r"vision\.(transformer|global_transformer)\.layers\.(\d+)\.(.+)", name)
        if m and m.group(3) in _VISION_LAYER_MAP:
            prefix = "v" if m.group(1) == "transformer" else "v.global"
            return f"{prefix}.blk.{int(m.group(2))}.{_VISION_LAYER_MAP[m.group(3)]}"
        raise ConvertError(f"{self.model_dir}: cannot map vision tensor {name!r}")

    canonical = staticmethod(canonical_name)

    @staticmethod
    def owns_weight(hf_name: str) -> bool:
        """True for the HF tensors (any naming of the checkpoint or of the loaded model) this file holds."""
        return (canonical_name(hf_name) or "").startswith(("vision.", "proj."))

    @staticmethod
    def layout(hf_name: str, w: np.ndarray) -> np.ndarray:
        """Vision tensors are stored in HF's layout (no RoPE permutation)."""
        return w

    def tensor_jobs(self) -> list[TensorJob]:
        jobs = [_job(self._gguf_name(n), self.records[n]) for n in sorted(self.records, key=_natural_key)]
        have = {j.name for j in jobs}
        for need in ("v.patch_embd.weight", "v.class_embd", "v.position_embd", "v.tile_position_embd", "mm.0.weight"):
            if need not in have:
                raise ConvertError(f"{self.model_dir}: checkpoint has no {need} tensor")
        return jobs

    def add_metadata(self, writer: gguf.GGUFWriter, options: ConversionOptions) -> None:
        hp = self.hp
        writer.add_type(gguf.GGUFType.MMPROJ)
        writer.add_name(f"{self.model_dir.name} (vision)")
        writer.add_file_type(file_type_of(options.out_type))
        writer.add_string("clip.projector_type", "mllama")
        writer.add_bool("clip.has_vision_encoder", True)
        writer.add_bool("clip.use_gelu", True)
        writer.add_uint32("clip.vision.image_size", hp.image_size)
        writer.add_uint32("clip.vision.patch_size", hp.patch_size)
        writer.add_uint32("clip.vision.embedding_length", hp.n_embd)
        writer.add_uint32("clip.vision.feed_forward_length", hp.n_ff)
        writer.add_uint32("clip.vision.block_count", hp.n_layer)
        writer.add_uint32("clip.vision.global_block_count", hp.n_layer_global)
        writer.add_uint32("clip.vision.projection_dim", hp.n_embd_out)
        writer.add_uint32("clip.vision.attention.head_count", hp.n_head)
        writer.add_float32("clip.vision.attention.layer_norm_epsilon", hp.eps)
        writer.add_uint32("clip.vision.preproc_max_tiles", hp.max_num_tiles)
        # the intermediate features are the *inputs* of these layers (Meta's reference semantics)
        writer.add_array("clip.vision.feature_layer", list(hp.taps))
        writer.add_array("clip.vision.image_mean", list(hp.image_mean))
        writer.add_array("clip.vision.image_std", list(hp.image_std))


def _natural_key(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# ---------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------

def text_source(model_dir: Path, *, tokenizer_pre: str | None = None) -> MllamaTextSource:
    """The text model as our own source - QAT's and GPTQ's planning still uses it (names, layouts, types); the
    converter writes the text GGUF with the series' upstream-style model class (``conversion/mllama.py``,
    ``convert/upstream_source.py``), and ``tests/python/test_convert_upstream.py`` pins that the two agree."""
    return MllamaTextSource(model_dir, tokenizer_pre=tokenizer_pre)


def vision_source(model_dir: Path) -> MllamaVisionSource:
    """The mmproj (vision encoder + projector) GGUF of an mllama checkpoint."""
    return MllamaVisionSource(model_dir)


def is_mllama(model_dir: Path) -> bool:
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and (cfg.get("architectures") or [None])[0] == HF_ARCH


def convert(model_dir: Path, outfile: Path | None, options: ConversionOptions, *,
            mmproj: Path | None = None, mmproj_options: ConversionOptions | None = None,
            tokenizer_pre: str | None = None, progress: bool = True) -> list[ConversionReport]:
    """Write the text GGUF to ``outfile`` (if given; the series' upstream-style model class) and the vision GGUF to
    ``mmproj`` (if given; :class:`MllamaVisionSource`)."""
    if outfile is None and mmproj is None:
        raise ConvertError("nothing to do: give an output file and/or --mmproj")
    reports = []
    if outfile is not None:
        from .upstream_source import UpstreamSource

        reports.append(write_gguf(UpstreamSource(model_dir, tokenizer_pre=tokenizer_pre), outfile, options,
                                  progress=progress))
    if mmproj is not None:
        reports.append(write_gguf(vision_source(model_dir), mmproj, mmproj_options or options, progress=progress))
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m convert.mllama",
        description="Convert a Llama 3.2 Vision (MllamaForConditionalGeneration) checkpoint to a text GGUF "
                    "(architecture mllama) and an mtmd vision GGUF (--mmproj).")
    p.add_argument("model", type=Path, help="HF checkpoint directory")
    p.add_argument("-o", "--outfile", type=Path, default=None, help="text model GGUF")
    p.add_argument("--mmproj", type=Path, default=None, help="also write the vision encoder + projector GGUF")
    p.add_argument("--type", dest="out_type", choices=OUT_TYPES, default="f16",
                   help="type of the big weight matrices (default: %(default)s)")
    p.add_argument("--mmproj-type", choices=OUT_TYPES, default=None,
                   help="type of the vision matrices (default: same as --type)")
    p.add_argument("--fallback-type", choices=FALLBACK_TYPES, default="q8_0",
                   help="type for matrices --type cannot hold (default: %(default)s)")
    p.add_argument("--centroid-rule", choices=("round", "trunc"), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-pre", default=None, help="llama.cpp pre-tokenizer name if it cannot be detected")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    s3d8 = S3D8Options(centroid_rule=args.centroid_rule, seed=args.seed)
    opts = ConversionOptions(out_type=args.out_type, fallback_type=args.fallback_type, s3d8=s3d8)
    mopts = ConversionOptions(out_type=args.mmproj_type or args.out_type, fallback_type=args.fallback_type, s3d8=s3d8)
    try:
        for rep in convert(args.model, args.outfile, opts, mmproj=args.mmproj, mmproj_options=mopts,
                           tokenizer_pre=args.tokenizer_pre, progress=not args.no_progress):
            print(rep.format_table())
        return 0
    except ConvertError as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

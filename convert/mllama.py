"""HF ``MllamaForConditionalGeneration`` (Llama 3.2 Vision) -> two GGUF files, both by the series' upstream-style
model classes (``ggml-patches/mllama/03-convert-add-mllama.patch``: ``conversion/mllama.py`` in the patched tree,
run in this process by ``convert/upstream_source.py``, like every other architecture):

* the **text model** (``MllamaTextModel``), GGUF architecture ``mllama``: a Llama 3.1 decoder in which the layers
  listed in ``cross_attention_layers`` are cross-attention blocks attending the projected image features;
* with ``--mmproj``, the **vision encoder + projector** (``MllamaVisionModel``, what ``convert_hf_to_gguf.py
  --mmproj`` writes) for llama.cpp's mtmd: a ``clip`` file with projector type ``mllama``.

What is specific to mllama (all in those classes; docs/mllama.md):

* **Three vocabulary sizes** (11B: tokenizer 128257 entries, ``embed_tokens`` 128264 rows, ``lm_head``
  128256 rows). The token list is the full tokenizer (``<|image|>`` = id 128256 keeps its learned
  embedding row), ``token_embd`` keeps all its rows and ``output`` its 128256 rows; ``mllama.vocab_size``
  records the number of output rows.
* **q/k permutation** only for the self-attention layers (RoPE); cross-attention and vision q/k are
  stored as they are (their q/k norms act per head-dimension element, there is no RoPE).
* **Gates** are stored raw (``tanh`` is applied at inference), as 1-D F32 tensors.
* Vision **tables** (position, tile-position, pre/post tile embeddings) are named without a ``.weight``
  suffix, which keeps them F32 under every ``--type``; the patch embedding is a convolution kernel: F16 (F32 with
  ``--type f32``), never S3D8/Q8_0.

Tensor names (``L`` = layer): text as Llama plus ``blk.L.cross_attn_{q,k,v,output}.weight``,
``blk.L.cross_attn_{q,k}_norm.weight``, ``blk.L.cross_attn_attn_gate``, ``blk.L.cross_attn_mlp_gate``;
vision ``v.patch_embd.weight``, ``v.class_embd``, ``v.position_embd``, ``v.position_gate``,
``v.tile_position_embd``, ``v.{pre,post}_tile_position_{embd,gate}``, ``v.{pre,post}_ln.*``,
``v.blk.L.*`` (local layers) and ``v.global.blk.L.*`` (+ ``gate_attn``, ``gate_ffn``), ``mm.0.*``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

if __name__ == "__main__" and not __package__:
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))
    from convert.mllama import main as _main

    raise SystemExit(_main())

from .common import ConversionOptions, ConversionReport, write_gguf
from .encoders import add_arguments as add_encoder_arguments
from .errors import ConvertError
from .tensor_types import FALLBACK_TYPES, OUT_TYPES, S3D8Options
from .upstream_source import UpstreamSource

HF_ARCH = "MllamaForConditionalGeneration"


def vision_source(model_dir: Path) -> UpstreamSource:
    """The mmproj (vision encoder + projector) GGUF of an mllama checkpoint: the series' upstream-style
    ``MllamaVisionModel`` (``conversion/mllama.py``), what ``convert_hf_to_gguf.py --mmproj`` writes."""
    return UpstreamSource(model_dir, mmproj=True)


def is_mllama(model_dir: Path) -> bool:
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and (cfg.get("architectures") or [None])[0] == HF_ARCH


def convert(model_dir: Path, outfile: Path | None, options: ConversionOptions, *,
            mmproj: Path | None = None, mmproj_options: ConversionOptions | None = None,
            tokenizer_pre: str | None = None, progress: bool = True) -> list[ConversionReport]:
    """Write the text GGUF to ``outfile`` and the vision GGUF to ``mmproj`` (each if given; both by the series'
    upstream-style model classes, ``conversion/mllama.py``)."""
    if outfile is None and mmproj is None:
        raise ConvertError("nothing to do: give an output file and/or --mmproj")
    reports = []
    if outfile is not None:
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
    add_encoder_arguments(p)
    p.add_argument("--tokenizer-pre", default=None, help="llama.cpp pre-tokenizer name if it cannot be detected")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    s3d8 = S3D8Options(centroid_rule=args.centroid_rule, seed=args.seed)
    opts = ConversionOptions(out_type=args.out_type, fallback_type=args.fallback_type, s3d8=s3d8,
                             backend=args.backend, threads=args.threads)
    mopts = ConversionOptions(out_type=args.mmproj_type or args.out_type, fallback_type=args.fallback_type, s3d8=s3d8,
                              backend=args.backend, threads=args.threads)
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

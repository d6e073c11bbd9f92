"""``--qat-checkpoint``: write a QAT student (``qat.train``) instead of the HF weights, bit-exactly.

The HF directory still provides the configuration and tokenizer; every tensor the checkpoint holds replaces the
HF one (fp32 master weights, laid out for llama.cpp by upstream's ``modify_tensors``; mllama: the text file and the
vision file each take the weights their model class holds), and every S3D8 matrix is
encoded with the codebook frozen in the checkpoint (``gguf_s3d8.quantize_s3d8_with_codebook``; with the frozen
scales of a student started from GPTQ, ``gguf_s3d8.importance.quantize_s3d8_with_scales``), so the file's
dequantised weights equal the student's fake-quantised weights bit for bit. The checkpoint records the type
each weight was trained for; a conversion that would store a tensor differently (another ``--fallback-type``,
another ``--type``) is refused.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from .common import ConversionOptions, planned_types
from .errors import ConvertError


def read_qat_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint's master weights and weight specs (raises ConvertError for anything else)."""
    from qat.checkpoint import load_checkpoint
    from qat.errors import TrainError

    try:
        ck = load_checkpoint(path)
    except TrainError as e:
        raise ConvertError(str(e)) from e
    if "model" not in ck or "specs" not in ck:
        raise ConvertError(f"{path}: QAT checkpoint without weights or weight specs")
    if ck.get("weight_format") is not None:
        raise ConvertError(f"{path}: a simulation student (qat.train --format {ck['weight_format']}); that format has "
                           "no GGUF form - only the S3D8 student trained without --format can be exported")
    return ck


def apply_qat_checkpoint(source: Any, path: Path, options: ConversionOptions) -> tuple[Any, ConversionOptions]:
    """A source whose tensors come from the checkpoint, and options carrying its frozen S3D8 codebooks."""
    ck = read_qat_checkpoint(path)
    if hasattr(source, "replace_weights"):
        return _apply_to_upstream_source(source, ck, path, options)
    raise ConvertError("--qat-checkpoint needs an HF checkpoint directory of the teacher as MODEL")


def _apply_to_upstream_source(source: Any, ck: dict[str, Any], path: Path,
                              options: ConversionOptions) -> tuple[Any, ConversionOptions]:
    """An upstream-driven source (``convert.upstream_source.UpstreamSource``): the trained weights replace the
    checkpoint's by HF name *before* upstream's ``modify_tensors``, which lays them out as it does the originals."""
    shapes = source.hf_tensor_shapes()
    weights: dict[str, Any] = {}
    for hf_name, w in ck["model"].items():
        name = source.canonical_name(hf_name)
        if name is None or name not in shapes:
            continue  # another file's tensor (mllama's vision tower), or the tied lm_head.weight the checkpoint lacks
        if tuple(w.shape) != shapes[name]:
            raise ConvertError(f"{path}: tensor {hf_name} has shape {tuple(w.shape)}, the model has {shapes[name]}")
        weights[name] = w.detach().float()
    source.replace_weights(weights, path.name)
    types = planned_types(source, options)
    codebooks: dict[str, np.ndarray] = {}
    scales: dict[str, np.ndarray] = {}
    for spec in ck["specs"].values():
        if source.canonical_name(spec["hf_name"]) is None:
            continue  # a weight of another output file (mllama: the vision GGUF)
        name = spec["gguf_name"]
        if name not in types:
            raise ConvertError(f"{path}: trained weight {name} has no place in the model")
        planned = types[name].name.lower()
        if planned != spec["qtype"]:
            raise ConvertError(f"{path}: {name} was trained as {spec['qtype'].upper()} but this conversion "
                               f"writes {planned.upper()} (check --type / --fallback-type)")
        if spec["codebook"] is not None:
            codebooks[name] = spec["codebook"].numpy()
        if spec.get("scales") is not None:  # a student started from GPTQ / iw1: frozen scales
            scales[name] = spec["scales"].numpy().astype(np.uint16)
    return source, replace(options, s3d8=replace(options.s3d8, codebooks=codebooks, scales=scales, encoder="reference"))

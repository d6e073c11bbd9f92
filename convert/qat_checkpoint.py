"""``--qat-checkpoint``: write a QAT student exported by ``python -m qat.export``, bit-exactly.

The file is an S3D8 tensor file (:mod:`gguf_s3d8.tensor_file`, producer ``qat-export``): the student's S3D8
weights as finished containers (encoded with the codebooks and scales frozen in training), its fp32 master
weights as plain tensors by HF name, and in ``info`` the type each weight was trained for and the teacher's
``config.json``. The HF directory MODEL still provides the configuration and tokenizer; every plain tensor replaces
the HF one (laid out for llama.cpp by upstream's ``modify_tensors``; mllama: the text file and the vision file each
take the weights their model class holds), and every container is written verbatim after the check that it was
made from exactly that laid-out weight (``convert.tensor_types``: the fingerprint), so the file's dequantised
weights equal the student's fake-quantised weights bit for bit. A conversion that would store a trained weight
differently (another ``--fallback-type``, another ``--type``), or a MODEL other than the teacher, is refused.

This module imports nothing of ``qat``: a ``qat.train`` checkpoint itself is refused with the command that
exports it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from .common import ConversionOptions, planned_types
from .errors import ConvertError
from .gptq_checkpoint import check_containers, read_gptq_file

#: ``producer`` of the files ``python -m qat.export`` writes
QAT_EXPORT_PRODUCER = "qat-export"


def export_command(path: Path) -> str:
    """The one command that makes the file ``--qat-checkpoint`` reads from a ``qat.train`` checkpoint."""
    return f"python -m qat.export {path} -o {path.with_suffix('.s3d8.safetensors')}"


def read_qat_export(path: Path) -> Any:
    """The ``qat.export`` file at ``path`` (a ``gguf_s3d8.tensor_file.S3D8TensorFile``); ConvertError for a
    ``qat.train`` checkpoint (naming the export command), a GPTQ file, or anything unreadable."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ConvertError(f"{path}: cannot read ({e.strerror or e})") from e
    if magic == b"PK\x03\x04" or magic[:1] == b"\x80":  # torch.save's zip archive, or a plain pickle
        raise ConvertError(f"{path}: a qat.train checkpoint; the converter reads its export - run "
                           f"`{export_command(path)}` and pass that file to --qat-checkpoint")
    tensors: Any = read_gptq_file(path)
    if tensors.producer != QAT_EXPORT_PRODUCER or "weights" not in tensors.info:
        raise ConvertError(f"{path}: an S3D8 tensor file of {tensors.producer or 'an unknown producer'}, not a QAT "
                           "export (python -m qat.export); GPTQ's containers go to --gptq-checkpoint")
    return tensors


def check_teacher(model: Path, tensors: Any, path: Path) -> None:
    """MODEL must be the teacher the student was trained from: ConvertError naming the config.json settings that
    differ (MODEL a .gguf file: refused, the export replaces HF tensors)."""
    if not model.is_dir():
        raise ConvertError("--qat-checkpoint needs an HF checkpoint directory of the teacher as MODEL")
    want = tensors.info.get("teacher_config")
    if want is None:
        return
    try:
        have = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConvertError(f"{model}: cannot read config.json ({e})") from e
    ignored = {"_name_or_path", "transformers_version", "torch_dtype", "dtype"}
    differ = sorted(k for k in set(want) | set(have) if k not in ignored and want.get(k) != have.get(k))
    if differ:
        shown = ", ".join(f"{k} ({want.get(k)!r} in the teacher, {have.get(k)!r} here)" for k in differ[:3])
        raise ConvertError(f"{path}: the student was trained from another model than {model}: config.json differs in "
                           f"{shown}{', ...' if len(differ) > 3 else ''}")


def apply_qat_export(source: Any, tensors: Any, path: Path, options: ConversionOptions) -> tuple[Any, ConversionOptions]:
    """``source`` with the export's fp32 weights in place of its tensors, and options writing its containers;
    checks every trained weight of this output against the conversion's type plan."""
    if not hasattr(source, "replace_weights"):
        raise ConvertError("--qat-checkpoint needs an HF checkpoint directory of the teacher as MODEL")
    import torch  # heavy; upstream's conversion (the only caller) has it loaded already

    shapes = source.hf_tensor_shapes()
    weights: dict[str, Any] = {}
    for hf_name, w in tensors.plain.items():
        name = source.canonical_name(hf_name)
        if name is None or name not in shapes:
            continue  # another file's tensor (mllama's vision tower), or the tied lm_head.weight the checkpoint lacks
        if tuple(w.shape) != shapes[name]:
            raise ConvertError(f"{path}: tensor {hf_name} has shape {tuple(w.shape)}, the model has {shapes[name]}")
        weights[name] = torch.from_numpy(w)
    source.replace_weights(weights, path.name)
    types = planned_types(source, options)
    for name, trained in tensors.info["weights"].items():
        if source.canonical_name(trained["hf_name"]) is None:
            continue  # a weight of another output file (mllama: the vision GGUF)
        if name not in types:
            raise ConvertError(f"{path}: trained weight {name} has no place in the model")
        planned = types[name].name.lower()
        if planned != trained["qtype"]:
            raise ConvertError(f"{path}: {name} was trained as {trained['qtype'].upper()} but this conversion "
                               f"writes {planned.upper()} (check --type / --fallback-type)")
    check_containers(types, set(tensors.containers), path, what="QAT export")
    # S3D8 tensors the student did not train (none today) get the reference encoder, as QAT's fake quantiser
    return source, replace(options, s3d8=replace(options.s3d8, precomputed=tensors, encoder="reference"))

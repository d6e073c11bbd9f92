"""Export a QAT student for the converter: ``python -m qat.export CHECKPOINT [-o FILE]``.

Reads a ``qat.train`` checkpoint (:mod:`qat.checkpoint`) and writes an S3D8 tensor file
(:mod:`gguf_s3d8.tensor_file`, producer ``qat-export``, version 2) that ``convert/to_gguf.py --qat-checkpoint
FILE`` turns into the GGUF(s), without importing anything of ``qat``:

* every S3D8 weight of the student as a finished container, encoded here in llama.cpp's row order with the
  codebook frozen in the checkpoint (``gguf_s3d8.quantize_s3d8_with_codebook``), or with its frozen scales too
  (a student started from GPTQ / iw1: ``gguf_s3d8.importance.quantize_s3d8_with_scales``) - the bytes the
  converter computed from the checkpoint before this file existed, so the GGUF is unchanged;
* every fp32 master weight of the checkpoint as a plain tensor (HF name, the checkpoint's layout), which the
  converter lays out through upstream's ``modify_tensors`` as it does the teacher's;
* in ``info``: the type each weight was trained for (``weights``: GGUF name -> HF name and type; the converter
  refuses a conversion that would store one differently), the teacher's ``config.json`` (the converter names the
  settings in which its MODEL differs), the run's ``--fallback-type`` / ``--vision-type`` and step.

Before writing, the checkpoint is checked against the teacher's current type plan (``convert.upstream_source``;
the teacher folder the checkpoint names, or ``--teacher``): a checkpoint of another model, or one the converter
would lay out differently, is refused naming the weight and what differs. Exit status 0, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

import gguf_s3d8
from convert.errors import ConvertError
from convert.upstream_source import UpstreamSource, checkpoint_placements
from gguf_s3d8.importance import quantize_s3d8_with_scales
from gguf_s3d8.tensor_file import S3D8TensorFile, weight_fingerprint, write_s3d8_tensors
from qat.checkpoint import load_checkpoint
from qat.errors import TrainError, cli_error

PRODUCER = "qat-export"


class ExportError(ValueError):
    """The checkpoint cannot be exported (the message names the file and what differs)."""


def default_outfile(checkpoint: Path) -> Path:
    """``run/checkpoint.pt`` -> ``run/checkpoint.s3d8.safetensors``."""
    return checkpoint.with_suffix(".s3d8.safetensors")


def _teacher_config(teacher: Path) -> dict[str, Any]:
    try:
        return json.loads((teacher / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{teacher}: cannot read the teacher's config.json ({e})") from e


def check_plan(ck: dict[str, Any], teacher: Path, config: dict[str, Any], path: Path) -> None:
    """Every weight spec of the checkpoint where the converter puts that weight of ``teacher`` today (GGUF name,
    type, shape), else ExportError naming the weight and what differs."""
    args = ck.get("args", {})
    fallback = args.get("fallback_type", "q8_0")
    vision = args.get("vision_type", "s3d8") if config.get("model_type") == "mllama" else None  # as build_student
    try:
        place = checkpoint_placements(teacher, fallback_type=fallback, vision_type=vision)
        sources = [UpstreamSource(teacher)] + ([UpstreamSource(teacher, mmproj=True)] if vision is not None else [])
        for source in sources:  # the teacher's tensors, each in the checkpoint (a smaller student is another model)
            held = {source.canonical_name(name) for name in ck["model"]}
            lacking = sorted(set(source.hf_tensor_shapes()) - held)
            if lacking:
                raise ExportError(f"{path}: the teacher {teacher} has {len(lacking)} tensor(s) the checkpoint lacks "
                                  f"({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}): a checkpoint of "
                                  "another model?")
    except ConvertError as e:
        raise ExportError(f"{path}: teacher {teacher}: {e}") from e
    for spec in ck["specs"].values():
        p = place(spec["hf_name"])
        if p is None:
            raise ExportError(f"{path}: weight {spec['hf_name']} has no place in the teacher {teacher} (a checkpoint "
                              "of another model?)")
        qtype = p.qtype.name.lower()
        if (p.gguf_name, qtype) != (spec["gguf_name"], spec["qtype"]):
            raise ExportError(f"{path}: weight {spec['hf_name']} was trained as {spec['gguf_name']} "
                              f"{spec['qtype'].upper()}, the teacher {teacher} converts it to {p.gguf_name} "
                              f"{qtype.upper()} (a checkpoint of another model, or of another converter?)")
        w = ck["model"].get(spec["hf_name"])
        if w is not None and qtype != "f32" and tuple(w.shape) != tuple(p.shape):
            raise ExportError(f"{path}: weight {spec['hf_name']} has shape {tuple(w.shape)}, the teacher {teacher} "
                              f"has {tuple(p.shape)} (a checkpoint of another model?)")


def container(w_gguf: np.ndarray, spec: dict[str, Any]) -> np.ndarray:
    """The S3D8 container of the fp32 weight ``w_gguf`` (llama.cpp's row order) with the spec's frozen codebook,
    and its frozen scales where it has them - what the student's fake quantiser computes."""
    name, codebook = spec["gguf_name"], spec["codebook"].numpy()
    if spec.get("scales") is not None:  # a student started from GPTQ / iw1
        return quantize_s3d8_with_scales(w_gguf, codebook, spec["scales"].numpy().astype(np.uint16), name=name)
    return gguf_s3d8.quantize_s3d8_with_codebook(w_gguf, codebook, name=name)


def export(checkpoint: Path, *, teacher: Path | None = None) -> S3D8TensorFile:
    """The tensor file of the student in ``checkpoint`` (module docstring); ExportError for bad input."""
    try:
        ck = load_checkpoint(checkpoint)
    except TrainError as e:
        raise ExportError(str(e)) from e
    if "model" not in ck or "specs" not in ck:
        raise ExportError(f"{checkpoint}: QAT checkpoint without weights or weight specs")
    if ck.get("weight_format") is not None:
        raise ExportError(f"{checkpoint}: a simulation student (qat.train --format {ck['weight_format']}); that format "
                          "has no GGUF form - only the S3D8 student trained without --format can be exported")
    teacher = Path(teacher if teacher is not None else ck["teacher"])
    config = _teacher_config(teacher)
    check_plan(ck, teacher, config, checkpoint)
    containers: dict[str, np.ndarray] = {}
    fingerprints: dict[str, str] = {}
    weights: dict[str, dict[str, str]] = {}
    for spec in ck["specs"].values():
        weights[spec["gguf_name"]] = {"hf_name": spec["hf_name"], "qtype": spec["qtype"]}
        if spec["qtype"] != "s3d8" or spec["codebook"] is None:
            continue  # the converter encodes it (Q8_0 / F16 / F32; an S3D8 weight without codebook: reference)
        w = ck["model"][spec["hf_name"]].detach().float()
        w_gguf = np.ascontiguousarray((w if spec["perm"] is None else w[spec["perm"]]).numpy())
        containers[spec["gguf_name"]] = container(w_gguf, spec)
        fingerprints[spec["gguf_name"]] = weight_fingerprint(w_gguf)
    plain = {name: np.ascontiguousarray(w.detach().float().numpy()) for name, w in ck["model"].items()}
    args = ck.get("args", {})
    info = {"checkpoint": checkpoint.name, "step": ck.get("step"), "teacher": str(teacher), "teacher_config": config,
            "fallback_type": args.get("fallback_type", "q8_0"), "vision_type": args.get("vision_type"),
            "weights": weights}
    return S3D8TensorFile(containers, fingerprints, PRODUCER, info, plain)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qat.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT", help="a qat.train checkpoint (RUN/checkpoint.pt)")
    p.add_argument("-o", "--out", type=Path, default=None, metavar="FILE",
                   help="the tensor file to write (default: CHECKPOINT with suffix .s3d8.safetensors)")
    p.add_argument("--teacher", type=Path, default=None, metavar="DIR",
                   help="the teacher's HF folder (default: the one the checkpoint names)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = args.out if args.out is not None else default_outfile(args.checkpoint)
    try:
        tensors = export(args.checkpoint, teacher=args.teacher)
        write_s3d8_tensors(out, tensors)
    except ExportError as e:
        return cli_error(str(e))
    except OSError as e:
        return cli_error(f"{out}: cannot write ({e.strerror or e})")
    print(f"{out}: {len(tensors.containers)} S3D8 containers, {len(tensors.plain)} fp32 tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())

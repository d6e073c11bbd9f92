"""``--gptq-checkpoint`` / ``--calibration``: write S3D8 containers made by GPTQ (``qat.gptq_s3d8``) verbatim.

The file (:mod:`gguf_s3d8.tensor_file`) holds finished containers by GGUF name, each with the fingerprint of the
weight it was computed from; the converter writes a container instead of encoding the tensor only if the tensor
is S3D8 in this conversion's type plan and its weights are exactly those (else a clear error). S3D8 tensors of
the plan that the file lacks are encoded as usual (``--encoder``), with a warning.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from .common import ConversionOptions, ModelSource, planned_types
from .errors import ConvertError


def add_calibration_options(p: argparse.ArgumentParser, *, when: str = "") -> None:
    """The calibration options of GPTQ, shared by ``python -m qat.gptq_s3d8`` and ``convert/to_gguf.py
    --calibration`` (``when``: a prefix of the help texts, e.g. "with --calibration: "); torch-free, so the
    converter's start-up does not import torch."""
    p.add_argument("--calibration-tokens", type=int, default=32768, metavar="N",
                   help=f"{when}calibration tokens, at most (default %(default)s)")
    p.add_argument("--calibration-seq-len", type=int, default=512, metavar="L",
                   help=f"{when}tokens per calibration sequence (default %(default)s)")
    p.add_argument("--gptq-damp", type=float, default=0.05, metavar="D",
                   help=f"{when}GPTQ damping, fraction of mean(diag H) (default %(default)s, the reference's)")


def read_gptq_file(path: Path) -> object:
    """The S3D8 tensor file at ``path`` (ConvertError if unreadable or damaged)."""
    from gguf_s3d8.tensor_file import S3D8TensorFileError, read_s3d8_tensors

    try:
        return read_s3d8_tensors(path)
    except S3D8TensorFileError as e:
        raise ConvertError(str(e)) from e


def apply_gptq_file(sources: list[tuple[ModelSource, ConversionOptions]], tensors: object,
                    path: Path) -> list[ConversionOptions]:
    """Options for each (source, options) output that write the file's containers; checks the type plans."""
    from gguf import GGMLQuantizationType as QT

    held = set(tensors.containers)  # type: ignore[attr-defined]
    placed: set[str] = set()
    out = []
    for source, options in sources:
        types = planned_types(source, options)
        s3d8 = {name for name, qtype in types.items() if qtype == getattr(QT, "S3D8", None)}
        names = set(types)
        wrong = sorted((held & names) - s3d8)
        if wrong:
            raise ConvertError(f"{path}: {', '.join(wrong[:5])} {'are' if len(wrong) > 1 else 'is'} not S3D8 in this "
                               "conversion (check --type / --fallback-type / --mmproj-type against the GPTQ run)")
        missing = sorted(s3d8 - held)
        if missing:
            print(f"warning: {path.name} has no GPTQ container for {len(missing)} S3D8 tensor(s) "
                  f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): encoded with --encoder "
                  f"{options.s3d8.encoder}", file=sys.stderr)
        placed |= held & s3d8
        out.append(replace(options, s3d8=replace(options.s3d8, precomputed=tensors)))
    unused = sorted(held - placed)
    if unused:
        raise ConvertError(f"{path}: containers for {', '.join(unused[:5])} have no place in this model")
    return out

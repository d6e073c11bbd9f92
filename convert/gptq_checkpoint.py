"""``--gptq-checkpoint``: write S3D8 containers made by GPTQ (``python -m qat.gptq_s3d8 ... -o FILE``) verbatim.

GPTQ needs torch and calibration data; it runs as its own first command, and this module imports nothing of
``qat``. The file (:mod:`gguf_s3d8.tensor_file`) holds finished containers by GGUF name, each with the fingerprint of the
weight it was computed from; the converter writes a container instead of encoding the tensor only if the tensor
is S3D8 in this conversion's type plan and its weights are exactly those (else a clear error). S3D8 tensors of
the plan that the file lacks are encoded as usual (``--encoder``), with a warning.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping

from .common import ConversionOptions, ModelSource, planned_types
from .errors import ConvertError


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
    if tensors.plain:  # type: ignore[attr-defined]
        raise ConvertError(f"{path}: a QAT export (python -m qat.export), not GPTQ's containers: use --qat-checkpoint")
    held = set(tensors.containers)  # type: ignore[attr-defined]
    placed: set[str] = set()
    out = []
    for source, options in sources:
        types = planned_types(source, options)
        s3d8 = check_containers(types, held, path, what="GPTQ run")
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


def check_containers(types: Mapping[str, Any], held: set[str], path: Path, *, what: str) -> set[str]:
    """The S3D8 tensors of a type plan (GGUF name -> type); ConvertError if the file holds a container for a tensor
    the plan stores otherwise (``what`` made it: "GPTQ run", "QAT export")."""
    from gguf import GGMLQuantizationType as QT

    s3d8 = {name for name, qtype in types.items() if qtype == getattr(QT, "S3D8", None)}
    wrong = sorted((held & set(types)) - s3d8)
    if wrong:
        raise ConvertError(f"{path}: {', '.join(wrong[:5])} {'are' if len(wrong) > 1 else 'is'} not S3D8 in this "
                           f"conversion (check --type / --fallback-type / --mmproj-type against the {what})")
    return s3d8

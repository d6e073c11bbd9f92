"""A file of finished S3D8 containers by GGUF tensor name, and optionally plain fp32 weights by HF name: what
``qat.gptq_s3d8`` (containers) and ``qat.export`` (a QAT student: containers and its fp32 masters) write and the
converter reads (``--gptq-checkpoint``, ``--qat-checkpoint``). Neither side imports the other.

Layout: a safetensors file whose tensors are the containers (uint8, ``(n, 43k/128)`` or ``(E, n, 43k/128)``,
exactly the bytes a GGUF stores) under their GGUF names, and whose metadata holds ``format`` (``s3d8-tensors``),
``version``, ``producer`` (e.g. ``gptq-iw1``, ``qat-export``), a free-form JSON ``info`` object (calibration,
settings, trained types) and, per container, the SHA-256 of the fp32 source weight the container was computed
from (GGUF row order, C order), so a converter can refuse to put a container into a model with other weights.

Version 2 adds ``plain``: the JSON list of the file's fp32 tensors that are not containers (HF names, the
checkpoint's layout: a QAT student's master weights). A file without plain tensors is written as version 1, the
bytes GPTQ wrote before; both versions are read.

Every container is validated on reading (:func:`gguf_s3d8.container.read_container`), so a damaged file gives an
error naming the tensor, never a broken GGUF.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import numpy.typing as npt

from .container import read_container
from .errors import S3D8Error
from .fsio import atomic_write

FILE_FORMAT = "s3d8-tensors"
FILE_VERSION = 2
#: versions this code reads (1: containers only)
READ_VERSIONS = (1, 2)


class S3D8TensorFileError(ValueError):
    """The file is unreadable, not an S3D8 tensor file, or holds an invalid container (the message says which)."""


def weight_fingerprint(w: npt.ArrayLike) -> str:
    """SHA-256 (hex) of a weight as fp32, C order - the identity of the values a container was made from."""
    return hashlib.sha256(np.ascontiguousarray(w, dtype=np.float32).tobytes()).hexdigest()


@dataclass
class S3D8TensorFile:
    """Containers (GGUF name -> uint8 array), the fingerprint of each one's source weight, provenance, and plain
    fp32 tensors (HF name -> array; version 2)."""

    containers: dict[str, npt.NDArray[np.uint8]]
    fingerprints: dict[str, str]
    producer: str
    info: dict[str, Any] = field(default_factory=dict)
    plain: dict[str, npt.NDArray[np.float32]] = field(default_factory=dict)


def write_s3d8_tensors(path: str | os.PathLike[str], tensors: S3D8TensorFile) -> None:
    """Write ``tensors`` to ``path`` atomically (temporary file in the same folder, fsync, rename)."""
    from safetensors.numpy import save

    if set(tensors.containers) != set(tensors.fingerprints):
        raise ValueError("every container needs the fingerprint of its source weight")
    both = sorted(set(tensors.containers) & set(tensors.plain))
    if both:
        raise ValueError(f"{both[0]}: both a container and a plain tensor")
    meta = {"format": FILE_FORMAT, "version": str(FILE_VERSION if tensors.plain else 1), "producer": tensors.producer,
            "info": json.dumps(tensors.info, sort_keys=True), "fingerprints": json.dumps(tensors.fingerprints, sort_keys=True)}
    arrays = {k: np.ascontiguousarray(v, dtype=np.uint8) for k, v in tensors.containers.items()}
    if tensors.plain:
        meta["plain"] = json.dumps(sorted(tensors.plain))
        arrays.update({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.plain.items()})
    blob = save(arrays, metadata=meta)
    atomic_write(path, blob)


def read_s3d8_tensors(path: str | os.PathLike[str]) -> S3D8TensorFile:
    """Read and validate a file written by :func:`write_s3d8_tensors` (raises S3D8TensorFileError)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    p = Path(path)
    try:
        blob = p.read_bytes()
    except OSError as e:
        raise S3D8TensorFileError(f"{p}: cannot read ({e.strerror or e})") from e
    try:
        arrays = load(blob)
        meta = _metadata(blob)
    except (SafetensorError, ValueError, KeyError) as e:
        raise S3D8TensorFileError(f"{p}: not a safetensors file ({e})") from e
    if meta.get("format") != FILE_FORMAT:
        raise S3D8TensorFileError(f"{p}: not an S3D8 tensor file (format {meta.get('format')!r}, expected {FILE_FORMAT!r})")
    if meta.get("version") not in [str(v) for v in READ_VERSIONS]:
        raise S3D8TensorFileError(f"{p}: S3D8 tensor file version {meta.get('version')!r} (this code reads "
                                  f"{' and '.join(str(v) for v in READ_VERSIONS)})")
    try:
        info = json.loads(meta.get("info", "{}"))
        fingerprints = json.loads(meta["fingerprints"])
        plain_names = json.loads(meta.get("plain", "[]"))
    except (KeyError, ValueError) as e:
        raise S3D8TensorFileError(f"{p}: damaged metadata ({e})") from e
    if not isinstance(plain_names, list) or not set(plain_names) <= set(arrays):
        raise S3D8TensorFileError(f"{p}: the list of plain tensors does not match the tensors")
    plain = {name: arrays.pop(name) for name in plain_names}
    for name, a in plain.items():
        if a.dtype != np.float32:
            raise S3D8TensorFileError(f"{p}: plain tensor {name} is {a.dtype}, not float32")
    if not isinstance(fingerprints, dict) or set(fingerprints) != set(arrays):
        raise S3D8TensorFileError(f"{p}: the fingerprints do not match the tensors")
    for name, a in arrays.items():
        if a.dtype != np.uint8 or a.ndim not in (2, 3):
            raise S3D8TensorFileError(f"{p}: tensor {name} is {a.dtype} {a.shape}, not a uint8 S3D8 container")
        for i, piece in enumerate(a if a.ndim == 3 else [a]):
            try:
                read_container(piece, name=name if a.ndim == 2 else f"{name}[{i}]")
            except S3D8Error as err:
                raise S3D8TensorFileError(f"{p}: {err}") from err
    return S3D8TensorFile(dict(arrays), dict(fingerprints), str(meta.get("producer", "")), info, plain)


def _metadata(blob: bytes) -> Mapping[str, str]:
    """The ``__metadata__`` of a safetensors blob (its JSON header)."""
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    return header.get("__metadata__", {}) or {}

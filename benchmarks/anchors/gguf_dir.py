"""The GGUF files' tensor directories, read with the patch series' gguf-py (``gguf.GGUFReader``), each type
named and sized per project (ik_llama.cpp's own ids included), and the layout checks built on them."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from anchors.model import Model  # type: ignore[import-not-found]

# ------------------------------------------------------------------------------------------------ GGUF reading

#: ik_llama.cpp's own types (ids, names and sizes from its ggml.h / ggml-common.h / ggml.c):
#: id -> (name, block size, bytes per block, bytes per row before the blocks)
IK_TYPES_TABLE: dict[int, tuple[str, int, int, int]] = {
    137: ("IQ2_K", 256, 76, 0),
    145: ("IQ2_KS", 256, 70, 2),
    157: ("IQ2_KL", 256, 86, 2),
}
#: ids below this are ggml's original types, the same in both projects
SHARED_TYPE_IDS = 31


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int
    type_name: str
    offset: int  #: from the start of the data section
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    tensors: tuple[TensorInfo, ...]
    data_start: int

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}


def type_table(project: str) -> dict[int, tuple[str, int, int, int]]:
    """id -> (name, block, bytes per block, row bytes) of a project's types (mainline: the series' gguf-py)."""
    from gguf_s3d8 import series_gguf

    g = series_gguf()
    table = {}
    for t in g.GGMLQuantizationType:
        if project != "ik" or int(t) < SHARED_TYPE_IDS:
            block, size = g.GGML_QUANT_SIZES[t]
            table[int(t)] = (t.name, block, size, 0)
    if project == "ik":
        table.update(IK_TYPES_TABLE)
    return table


def _directory(path: Path) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int, int]:
    """``([(name, shape, type id, offset)], alignment, data start)`` of a GGUF file, read by the series' gguf-py
    (``gguf.GGUFReader``, which parses the header and the tensor infos). Its own tensor step maps each type id to
    its ``GGMLQuantizationType``, which ik_llama.cpp's ids are not, so the directory is taken before that step."""
    from gguf_s3d8 import series_gguf

    class DirectoryReader(series_gguf().GGUFReader):  # type: ignore[misc]
        raw: list[tuple[str, tuple[int, ...], int, int]] = []

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            # each tensor info field: name length, name, n_dims, dims, type id, offset
            self.raw = [(bytes(f.parts[1]).decode("utf-8"), tuple(int(d) for d in f.parts[3].tolist()),
                         int(f.parts[4][0]), int(f.parts[5][0])) for f in fields]

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
    reader = DirectoryReader(path)
    return reader.raw, int(reader.alignment), int(reader.data_offset)


def read_gguf(path: Path, project: str) -> GGUFFile:
    """The tensor directory of a GGUF file: names, shapes, types (named per ``project``: ik_llama.cpp's ids differ
    from mainline's above the shared ones) and byte sizes. Sizes come from the type table and are checked against
    the offsets (each tensor starts at the aligned end of the one before): a wrong table cannot go unnoticed."""
    table = type_table(project)
    raw, alignment, data_start = _directory(path)
    file_size = path.stat().st_size
    ends = sorted(off for *_, off in raw)[1:] + [file_size - data_start]
    next_start = dict(zip(sorted(off for *_, off in raw), ends))
    tensors = []
    for name, shape, tid, off in raw:
        span = next_start[off] - off
        if tid in table:
            tname, block, size, row = table[tid]
            n = math.prod(shape)
            nbytes = n // block * size + (n // shape[0]) * row
            if not (span - alignment < nbytes <= span):
                raise ValueError(f"{path}: {name} ({tname}) takes {span} bytes, {nbytes} expected from its type")
        else:
            tname, nbytes = f"type{tid}", span
        tensors.append(TensorInfo(name, shape, tid, tname, off, nbytes))
    return GGUFFile(path, tuple(tensors), data_start)


def tensor_digest(gf: GGUFFile, t: TensorInfo) -> str:
    with open(gf.path, "rb") as f:
        f.seek(gf.data_start + t.offset)
        h = hashlib.sha256()
        left = t.nbytes
        while left:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                raise ValueError(f"{gf.path}: {t.name} is truncated")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


@dataclass
class Layout:
    """What a file holds: the variant tensors' types, their bits per weight, the whole file's size and bits."""

    variant_types: dict[str, int]
    variant_bpw: float
    file_mib: float
    file_bpw: float
    n_variant: int
    outside_types: dict[str, int]


def layout(gf: GGUFFile, model: Model) -> Layout:
    var = [t for t in gf.tensors if model.is_variant(t.name)]
    out = [t for t in gf.tensors if not model.is_variant(t.name)]
    count = lambda ts: dict(sorted({n: sum(t.type_name == n for t in ts) for n in {t.type_name for t in ts}}.items()))  # noqa: E731
    n_all = sum(t.n_elements for t in gf.tensors)
    return Layout(variant_types=count(var),
                  variant_bpw=8 * sum(t.nbytes for t in var) / max(1, sum(t.n_elements for t in var)),
                  file_mib=gf.path.stat().st_size / 2**20,
                  file_bpw=8 * sum(t.nbytes for t in gf.tensors) / max(1, n_all),
                  n_variant=len(var), outside_types=count(out))


def check_layout(gf: GGUFFile, model: Model, expected: dict[str, str] | None, reference: GGUFFile) -> list[str]:
    """Problems with a file: a variant tensor not of its expected type (``expected``: name -> type name; None:
    any), a tensor set that differs from ``reference``'s, or a tensor outside the variant set whose type is not
    the reference's (2-D weights: Q8_0)."""
    problems = []
    got, ref = gf.by_name(), reference.by_name()
    if set(got) != set(ref):
        problems.append(f"tensor set differs from {reference.path.name}: "
                        f"{sorted(set(got) ^ set(ref))[:5]}")
    for name, t in got.items():
        if model.is_variant(name):
            if expected is not None and t.type_name != expected.get(name):
                problems.append(f"{name} is {t.type_name}, expected {expected.get(name)}")
        elif name in ref and t.type_name != ref[name].type_name:
            problems.append(f"{name} is {t.type_name} outside the variant set, {ref[name].type_name} in "
                            f"{reference.path.name}")
    if not any(model.is_variant(n) for n in got):
        problems.append("no variant tensor")
    return problems


def outside_digests(gf: GGUFFile, model: Model) -> dict[str, str]:
    return {t.name: tensor_digest(gf, t) for t in gf.tensors if not model.is_variant(t.name)}


def content_digest(gf: GGUFFile) -> str:
    """sha256 of what a model computes with: the tensor directory (names, shapes, type ids, offsets) and the whole
    data section, not the metadata (``llama-quantize`` writes the imatrix file's name there, so two files made from
    byte-identical imatrices under two names differ only in it)."""
    h = hashlib.sha256()
    for t in gf.tensors:
        h.update(f"{t.name}|{t.shape}|{t.type_id}|{t.offset}\n".encode())
    with open(gf.path, "rb") as f:
        f.seek(gf.data_start)
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()

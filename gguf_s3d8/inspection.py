"""Inspect a GGUF file: per-tensor type, shape, bits per weight and S3D8 codebook summary, and full
validation of every S3D8 container (the logic behind ``python -m gguf_s3d8 inspect``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from .constants import S3D8_TYPE_NAME
from .container import read_container
from .errors import S3D8Error
from .gguf_py import series_gguf


@dataclass(frozen=True)
class CodebookSummary:
    """Centroid norms ``|C_l|`` (min / max / mean) and distinct-centroid counts over a tensor's slices."""

    norm_min: float
    norm_max: float
    norm_mean: float
    distinct_min: int
    distinct_max: int
    slices: int

    def describe(self) -> str:
        distinct = (f"{self.distinct_min}" if self.distinct_min == self.distinct_max
                    else f"{self.distinct_min}..{self.distinct_max}")
        per = f" over {self.slices} slices" if self.slices > 1 else ""
        return (f"|C| min {self.norm_min:.1f} max {self.norm_max:.1f} mean {self.norm_mean:.1f}, "
                f"{distinct}/32 distinct{per}")


@dataclass(frozen=True)
class TensorReport:
    name: str
    type_name: str
    shape: tuple[int, ...]          # numpy order: (..., rows n, columns k)
    n_elements: int
    n_bytes: int
    codebook: CodebookSummary | None = None
    errors: tuple[str, ...] = field(default=())

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.n_bytes / self.n_elements if self.n_elements else float("nan")


@dataclass(frozen=True)
class FileReport:
    path: str
    tensors: tuple[TensorReport, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def total_elements(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def s3d8_elements(self) -> int:
        return sum(t.n_elements for t in self.tensors if t.type_name == S3D8_TYPE_NAME)

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(e for t in self.tensors for e in t.errors)


def summarize_codebooks(codebooks: list[np.ndarray]) -> CodebookSummary:
    """Norm and distinct-count summary of one or more (32, 3) codebooks."""
    norms = np.concatenate([np.sqrt((cb.astype(np.float64) ** 2).sum(axis=1)) for cb in codebooks])
    distinct = [len(np.unique(cb, axis=0)) for cb in codebooks]
    return CodebookSummary(float(norms.min()), float(norms.max()), float(norms.mean()),
                           min(distinct), max(distinct), len(codebooks))


def _s3d8_slices(data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    if data.ndim <= 2:
        return [("", data)]
    flat = data.reshape(-1, *data.shape[-2:])
    idx = list(np.ndindex(*data.shape[:-2]))
    return [("[" + ",".join(map(str, i)) + "]", s) for i, s in zip(idx, flat)]


def inspect_tensor(tensor: Any) -> TensorReport:
    """Report on one ``gguf.ReaderTensor``; S3D8 slices are validated (errors are collected, not raised)."""
    type_name = tensor.tensor_type.name
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    codebook = None
    errors: list[str] = []
    if type_name == S3D8_TYPE_NAME:
        codebooks = []
        for suffix, data in _s3d8_slices(np.asarray(tensor.data)):
            try:
                c = read_container(data, name=f"{tensor.name}{suffix}")
            except S3D8Error as e:
                errors.append(str(e))
                continue
            if (c.n, c.k) != shape[-2:]:
                errors.append(f"S3D8 tensor {tensor.name + suffix!r}: header n={c.n}, k={c.k} disagrees "
                              f"with the GGUF shape {shape}")
                continue
            codebooks.append(np.asarray(c.codebook))
        if codebooks:
            codebook = summarize_codebooks(codebooks)
    return TensorReport(tensor.name, type_name, shape, int(tensor.n_elements), int(tensor.n_bytes),
                        codebook, tuple(errors))


def inspect_gguf(path: str | Path) -> FileReport:
    """Read a GGUF file with the series' gguf-py (which defines S3D8) and report on every tensor."""
    reader = series_gguf().GGUFReader(str(path), "r")
    return FileReport(str(path), tuple(inspect_tensor(t) for t in reader.tensors))


def print_report(report: FileReport, out: TextIO) -> None:
    """Human-readable table plus one summary line."""
    width = max([len(t.name) for t in report.tensors] + [6])
    print(f"{report.path}: {len(report.tensors)} tensors", file=out)
    print(f"  {'tensor':<{width}}  {'type':<7} {'shape (rows x cols)':<22} {'bits/w':>7}  codebook", file=out)
    for t in report.tensors:
        dims = " x ".join(str(d) for d in t.shape)
        cb = t.codebook.describe() if t.codebook else ""
        status = "  CORRUPT" if t.errors else ""
        print(f"  {t.name:<{width}}  {t.type_name:<7} {dims:<22} {t.bits_per_weight:7.4f}  {cb}{status}", file=out)
    total_e = report.total_elements
    share = 100.0 * report.s3d8_elements / total_e if total_e else 0.0
    bpw = 8.0 * report.total_bytes / total_e if total_e else float("nan")
    n_s3d8 = sum(1 for t in report.tensors if t.type_name == S3D8_TYPE_NAME)
    print(f"summary: {report.total_bytes} bytes of tensor data, {total_e} weights; S3D8: {n_s3d8} tensors "
          f"holding {share:.2f}% of the weights; overall {bpw:.4f} bits per weight", file=out)

"""The X^T X file of ``llama-imatrix --save-xtx`` (read by ``llama-quantize --hessian``), format version 2.

The one Python reader and writer of that file (``docs/hessian-format.md``): tests, benchmarks and research read
and write it through this module. A matrix is stored as its lower triangle packed row by row -- ``(0,0), (1,0),
(1,1), (2,0), ...``, ``k(k+1)/2`` float32 values in a 1-D tensor named ``<first weight>.xtx`` -- with ``k`` in
``xtx.dims``. Version 1 (the full ``k x k`` square) is refused, naming the version, as ``llama-quantize`` does.

:class:`XtxFile` keeps the packed triangles (half the memory of the squares); :func:`unpack` gives the symmetric
``k x k`` matrix, :func:`hessian` the ``H = 2 X^T X / N`` that ``llama-quantize`` forms (float64 product rounded to
float32). :func:`subset` keeps some weights (e.g. the last block's: the ``--xtx-last-layer`` file out of a full
one) and :func:`perturbed` multiplies every stored entry by ``1 +- rel`` (the rounding variant of the robustness
studies; the triangle is stored once, so the perturbed matrix stays exactly symmetric).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from .fsio import atomic_path

__all__ = ["XTX_VERSION", "XtxFormatError", "XtxFile", "packed_size", "pack_lower", "unpack", "read_xtx",
           "write_xtx", "hessian", "subset", "perturbed"]

#: the format version this module (and ``llama-quantize --hessian``) reads and writes
XTX_VERSION = 2


class XtxFormatError(ValueError):
    """The file is not a version-2 X^T X file, or it is inconsistent."""


def packed_size(k: int) -> int:
    """The number of values in the packed lower triangle of a k x k matrix (also the offset of row k in one)."""
    return k * (k + 1) // 2


def pack_lower(full: np.ndarray) -> np.ndarray:
    """The lower triangle of a square matrix, row by row, as float32."""
    if full.ndim != 2 or full.shape[0] != full.shape[1]:
        raise ValueError(f"pack_lower: a square matrix is needed, got shape {full.shape}")
    rows, cols = np.tril_indices(full.shape[0])
    return np.ascontiguousarray(full[rows, cols], dtype=np.float32)


def unpack(packed: np.ndarray, k: int) -> np.ndarray:
    """The symmetric k x k float32 matrix of a packed lower triangle (both triangles exactly equal)."""
    if packed.shape != (packed_size(k),):
        raise ValueError(f"unpack: {packed.shape[0] if packed.ndim == 1 else packed.shape} values are not the packed "
                         f"lower triangle of a {k} x {k} matrix ({packed_size(k)} values)")
    full = np.zeros((k, k), dtype=np.float32)
    rows, cols = np.tril_indices(k)
    full[rows, cols] = packed
    full[cols, rows] = packed
    return full


@dataclass(frozen=True)
class XtxFile:
    """The content of an X^T X file: per matrix its packed triangle, width and token count; per weight its matrix
    and fingerprint (``""`` when unknown)."""

    matrices: dict[str, np.ndarray]            # matrix tensor name -> packed lower triangle (float32)
    dims: dict[str, int]                       # matrix -> k
    tokens: dict[str, int]                     # matrix -> N, the input rows summed
    weights: dict[str, tuple[str, str]]        # weight name -> (matrix, fingerprint)
    datasets: list[str] = field(default_factory=list)
    model: str = ""

    def matrix(self, weight: str) -> np.ndarray:
        """The weight's X^T X as a symmetric k x k float32 matrix."""
        m = self.weights[weight][0]
        return unpack(self.matrices[m], self.dims[m])


def _field(reader: Any, name: str, path: Path) -> Any:
    fields = reader.fields
    if name not in fields:
        raise XtxFormatError(f"{path}: missing key {name}")
    return fields[name].contents()


def read_xtx(path: str | os.PathLike[str]) -> XtxFile:
    """Read a version-2 X^T X file (the tensors are copied out of the memory map)."""
    import gguf  # the series' gguf-py (gguf_s3d8.gguf_py makes it importable)

    p = Path(path)
    try:
        r = gguf.GGUFReader(p)
    except (ValueError, OSError) as e:
        raise XtxFormatError(f"{p}: cannot read it as a GGUF file ({e})") from e
    if "general.type" not in r.fields or r.fields["general.type"].contents() != "xtx":
        raise XtxFormatError(f"{p}: not an X^T X file (general.type is not \"xtx\")")
    version = _field(r, "xtx.version", p)
    if version != XTX_VERSION:
        raise XtxFormatError(f"{p}: X^T X format version {version}, this reader reads version {XTX_VERSION} only "
                             "(write the file again with this build's llama-imatrix --save-xtx)")
    mats = list(_field(r, "xtx.matrices", p))
    tokens = [int(t) for t in _field(r, "xtx.tokens", p)]
    dims = [int(d) for d in _field(r, "xtx.dims", p)]
    weights = list(_field(r, "xtx.weights", p))
    wm = [int(i) for i in _field(r, "xtx.weight_matrix", p)]
    fps = list(_field(r, "xtx.weight_fingerprints", p)) if "xtx.weight_fingerprints" in r.fields else [""] * len(weights)
    if len(tokens) != len(mats) or len(dims) != len(mats) or len(wm) != len(weights) or len(fps) != len(weights):
        raise XtxFormatError(f"{p}: inconsistent array lengths")
    if any(i >= len(mats) for i in wm):
        raise XtxFormatError(f"{p}: a weight refers to a matrix that is not in the file")
    data = {t.name: t for t in r.tensors}
    matrices: dict[str, np.ndarray] = {}
    for m, k in zip(mats, dims):
        t = data.get(m)
        if t is None or t.data.size != packed_size(k):
            raise XtxFormatError(f"{p}: matrix {m} is missing or not the packed lower triangle of a {k} x {k} matrix")
        matrices[m] = np.array(t.data, dtype=np.float32).reshape(-1)
    ds = _field(r, "xtx.datasets", p) if "xtx.datasets" in r.fields else []
    model = str(r.fields["xtx.model"].contents()) if "xtx.model" in r.fields else ""
    return XtxFile(matrices=matrices, dims=dict(zip(mats, dims)), tokens=dict(zip(mats, tokens)),
                   weights={w: (mats[i], fp) for w, i, fp in zip(weights, wm, fps)},
                   datasets=[str(d) for d in ds], model=model)


def write_xtx(path: str | os.PathLike[str], xf: XtxFile) -> None:
    """Write ``xf`` as a version-2 file, atomically (a temporary file renamed into place)."""
    import gguf

    mats = list(xf.matrices)
    for m in mats:
        if xf.matrices[m].shape != (packed_size(xf.dims[m]),):
            raise ValueError(f"write_xtx: matrix {m} holds {xf.matrices[m].shape} values, not the packed lower "
                             f"triangle of a {xf.dims[m]} x {xf.dims[m]} matrix")
    arr, vt = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, "xtx")
        w.add_string("general.type", "xtx")
        w.add_uint32("xtx.version", XTX_VERSION)
        if xf.datasets:  # gguf-py writes no empty array; a missing key reads as no dataset
            w.add_key_value("xtx.datasets", list(xf.datasets), arr, sub_type=vt.STRING)
        w.add_string("xtx.model", xf.model)
        w.add_key_value("xtx.matrices", mats, arr, sub_type=vt.STRING)
        w.add_key_value("xtx.tokens", [xf.tokens[m] for m in mats], arr, sub_type=vt.UINT64)
        w.add_key_value("xtx.dims", [xf.dims[m] for m in mats], arr, sub_type=vt.UINT32)
        names = list(xf.weights)
        w.add_key_value("xtx.weights", names, arr, sub_type=vt.STRING)
        w.add_key_value("xtx.weight_matrix", [mats.index(xf.weights[n][0]) for n in names], arr, sub_type=vt.UINT32)
        w.add_key_value("xtx.weight_fingerprints", [xf.weights[n][1] for n in names], arr, sub_type=vt.STRING)
        for m in mats:
            w.add_tensor(m, np.ascontiguousarray(xf.matrices[m], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def hessian(xf: XtxFile, weight: str) -> np.ndarray:
    """``H = 2 X^T X / N`` as ``llama-quantize --hessian`` forms it: float64 product, rounded to float32."""
    m = xf.weights[weight][0]
    return (xf.matrix(weight).astype(np.float64) * (2.0 / xf.tokens[m])).astype(np.float32)


def subset(xf: XtxFile, keep: Callable[[str], bool]) -> XtxFile:
    """The weights for which ``keep(name)`` holds, and only their matrices."""
    weights = {w: v for w, v in xf.weights.items() if keep(w)}
    used = {m for m, _ in weights.values()}
    if not weights:
        raise ValueError("subset: no weight is kept")
    return replace(xf, weights=weights, matrices={m: a for m, a in xf.matrices.items() if m in used},
                   dims={m: k for m, k in xf.dims.items() if m in used},
                   tokens={m: n for m, n in xf.tokens.items() if m in used})


def perturbed(xf: XtxFile, rng: np.random.Generator, rel: float = 1e-6) -> XtxFile:
    """Every stored entry times ``1 + rel`` or ``1 - rel`` (a random sign each), computed in float64 and rounded
    to float32. Each matrix is stored once as its triangle, so the perturbed matrix is exactly symmetric."""
    out = {}
    for m, a in xf.matrices.items():
        signs = rng.integers(0, 2, size=a.shape) * 2 - 1
        out[m] = (a.astype(np.float64) * (1.0 + rel * signs)).astype(np.float32)
    return replace(xf, matrices=out)

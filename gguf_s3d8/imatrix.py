"""Importance matrices as ``llama-imatrix`` writes them, read the way ``llama-quantize`` reads them.

Two file formats exist (both are read by the pinned llama.cpp's ``common_imatrix_load``):

* **GGUF** (the default of current ``llama-imatrix``): for every tensor ``NAME`` two F32 tensors,
  ``NAME.in_sum2`` (ne0 x n_expert sums of squared activations) and ``NAME.counts`` (n_expert token
  counts). The importance is ``in_sum2 / count`` per expert, computed in fp32; an expert with count 0
  gets importance 1 everywhere.
* **legacy** ``.dat``: ``int32 n_entries``, then per entry ``int32 len, name[len], int32 ncall,
  int32 nval, float32 values[nval]`` (values = mean squares x ncall); optionally ``int32 chunk_count,
  int32 len, dataset[len]``. The importance is ``values / ncall`` in fp32 (the raw values when
  ``ncall == 0``).

The values obtained are exactly the float32 arrays ``llama-quantize`` hands to ``quantize_s3d8`` (the same
fp32 divisions), so the converter and ``llama-quantize`` encode from identical inputs. Anything malformed
is an :class:`ImatrixError` naming the file, and the entry where it applies.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]

_GGUF_MAGIC = b"GGUF"
_SUM_SUFFIX = ".in_sum2"
_COUNT_SUFFIX = ".counts"


class ImatrixError(ValueError):
    """An importance-matrix file or entry is unusable (the message names the file and the tensor)."""


@dataclass
class Imatrix:
    """Per-tensor importance (float32, ne0 x n_expert values, expert-major) read from ``path``."""

    path: Path
    entries: dict[str, F32] = field(default_factory=dict)
    legacy: bool = False
    chunk_count: int = 0
    datasets: list[str] = field(default_factory=list)

    def for_tensor(self, name: str, k: int, n_expert: int = 1) -> F32 | None:
        """The importance of tensor ``name`` (k columns, ``n_expert`` 2-D slices), shape (n_expert, k).

        ``None`` when the file has no entry for the tensor: the caller falls back to uniform importance,
        as ``llama-quantize`` does ("did not find weights for ..."). An entry of the wrong size, or with a
        non-finite or negative value, raises :class:`ImatrixError` naming the tensor.
        """
        values = self.entries.get(name)
        if values is None:
            return None
        if values.size != k * n_expert:
            raise ImatrixError(f"{self.path}: importance of {name!r} has {values.size} values, the tensor needs "
                               f"{k * n_expert} ({k} columns x {n_expert} slice(s)): the imatrix does not match "
                               f"this model")
        bad = ~np.isfinite(values)
        if bad.any():
            j = int(np.flatnonzero(bad)[0])
            raise ImatrixError(f"{self.path}: importance of {name!r} has a non-finite value {values[j]} at index {j}")
        neg = values < 0
        if neg.any():
            j = int(np.flatnonzero(neg)[0])
            raise ImatrixError(f"{self.path}: importance of {name!r} has a negative value {values[j]} at index {j} "
                               f"(importances are mean squared activations)")
        return values.reshape(n_expert, k)


def read_imatrix(path: str | Path) -> Imatrix:
    """Read a GGUF or legacy ``.dat`` importance matrix (format detected from the magic)."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            magic = fh.read(4)
    except OSError as e:
        raise ImatrixError(f"{p}: cannot read the importance matrix: {e.strerror or e}") from e
    return _read_gguf(p) if magic == _GGUF_MAGIC else _read_legacy(p)


def _read_gguf(path: Path) -> Imatrix:
    import gguf  # only needed for this format

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf-py raises ValueError/struct.error/... on a corrupt file
        raise ImatrixError(f"{path}: not a readable GGUF importance matrix: {e}") from e
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ImatrixError(f"{path}: tensor {t.name!r} is {t.tensor_type.name}, an imatrix holds F32 tensors")
        if t.name.endswith(_SUM_SUFFIX):
            sums[t.name[: -len(_SUM_SUFFIX)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
        elif t.name.endswith(_COUNT_SUFFIX):
            counts[t.name[: -len(_COUNT_SUFFIX)]] = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if not sums:
        raise ImatrixError(f"{path}: no '*{_SUM_SUFFIX}' tensors: not an importance matrix")
    out = Imatrix(path, legacy=False)
    for name, s in sorted(sums.items()):
        c = counts.get(name)
        if c is None:
            raise ImatrixError(f"{path}: {name!r} has {_SUM_SUFFIX} but no {_COUNT_SUFFIX}")
        if c.size == 0 or s.size % c.size:
            raise ImatrixError(f"{path}: {name!r}: {s.size} sums do not split into {c.size} expert(s)")
        per = s.reshape(c.size, -1)
        with np.errstate(divide="ignore", invalid="ignore"):
            val = np.where(c[:, None] > 0, per / np.where(c > 0, c, np.float32(1))[:, None], np.float32(1))
        out.entries[name] = np.ascontiguousarray(val.astype(np.float32).reshape(-1))
    field_ = reader.fields.get("imatrix.chunk_count")
    if field_ is not None:
        out.chunk_count = int(field_.parts[-1][0])
    ds = reader.fields.get("imatrix.datasets")
    if ds is not None:
        out.datasets = [bytes(ds.parts[i]).decode("utf-8", "replace") for i in ds.data]
    return out


def _read_legacy(path: Path) -> Imatrix:
    data = path.read_bytes()
    pos = 0

    def take(fmt: str, what: str) -> tuple:
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise ImatrixError(f"{path}: truncated legacy imatrix while reading {what} (offset {pos})")
        vals = struct.unpack_from(fmt, data, pos)
        pos += size
        return vals

    (n_entries,) = take("<i", "the entry count")
    if n_entries < 1:
        raise ImatrixError(f"{path}: neither a GGUF nor a legacy imatrix (entry count {n_entries})")
    out = Imatrix(path, legacy=True)
    for i in range(n_entries):
        (length,) = take("<i", f"the name length of entry {i + 1}")
        if length < 0 or pos + length > len(data):
            raise ImatrixError(f"{path}: entry {i + 1}: bad name length {length}")
        name = data[pos:pos + length].decode("utf-8", "replace")
        pos += length
        ncall, nval = take("<ii", f"the sizes of {name!r}")
        if nval < 1:
            raise ImatrixError(f"{path}: {name!r}: {nval} values")
        if pos + 4 * nval > len(data):
            raise ImatrixError(f"{path}: truncated legacy imatrix in the values of {name!r}")
        vals = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += 4 * nval
        out.entries[name] = vals / np.float32(ncall) if ncall > 0 else vals.copy()
    if pos + 4 <= len(data):
        (out.chunk_count,) = take("<i", "the chunk count")
        if pos + 4 <= len(data):
            (length,) = take("<i", "the dataset name length")
            if 0 < length and pos + length <= len(data):
                out.datasets = [data[pos:pos + length].decode("utf-8", "replace")]
    return out


def write_legacy_imatrix(path: str | Path, entries: dict[str, F32], *, ncall: int = 1, chunk_count: int = 0,
                         dataset: str = "") -> None:
    """Write ``entries`` (importance per tensor) as a legacy ``.dat`` file (values stored x ``ncall``).

    For tests and for users who need the old format; ``llama-quantize`` reads it back to the same fp32
    values when ``ncall`` is a power of two (the multiplication and division are then exact)."""
    parts = [struct.pack("<i", len(entries))]
    for name, v in entries.items():
        raw = name.encode()
        vals = np.asarray(v, dtype=np.float32).reshape(-1) * np.float32(ncall)
        parts += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, vals.size), vals.astype("<f4").tobytes()]
    ds = dataset.encode()
    parts += [struct.pack("<ii", chunk_count, len(ds)), ds]
    Path(path).write_bytes(b"".join(parts))

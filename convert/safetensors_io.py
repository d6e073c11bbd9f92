"""A small lazy reader for HF safetensors checkpoints that needs neither torch nor a whole-file load.

Why not ``safetensors.numpy``: numpy has no bfloat16, and most checkpoints are bf16. The format is simple
(8-byte little-endian header length, a JSON header of ``name -> {dtype, shape, data_offsets}``, then the
raw buffer), so each tensor is read straight from its byte range and widened to float32 exactly
(bf16 -> f32 is a 16-bit left shift, f16 -> f32 is exact).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .errors import ConvertError

_NUMPY_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}
_ITEMSIZE = {"BF16": 2, **{k: v.itemsize for k, v in _NUMPY_DTYPES.items()}}


@dataclass(frozen=True)
class TensorRecord:
    """Where one tensor lives: file, dtype tag, shape and absolute byte range."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    def load_f32(self) -> np.ndarray:
        """The tensor as a C-contiguous float32 array (floating dtypes only)."""
        n = int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1
        with open(self.path, "rb") as f:
            f.seek(self.start)
            raw = f.read(self.end - self.start)
        if len(raw) != self.end - self.start:
            raise ConvertError(f"{self.path}: tensor {self.name} is truncated (file too short)")
        if self.dtype == "BF16":
            bits = np.frombuffer(raw, dtype="<u2", count=n).astype(np.uint32) << 16
            out = bits.view(np.float32)
        elif self.dtype in ("F64", "F32", "F16"):
            out = np.frombuffer(raw, dtype=_NUMPY_DTYPES[self.dtype], count=n).astype(np.float32)
        else:
            raise ConvertError(f"tensor {self.name} has dtype {self.dtype}, expected a floating-point weight")
        return out.reshape(self.shape)


def read_header(path: Path) -> list[TensorRecord]:
    """Parse one ``.safetensors`` file's header (in file order) and validate every byte range."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ConvertError(f"{path}: not a safetensors file (too short)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > size - 8 or hlen > 100 << 20:
                raise ConvertError(f"{path}: not a safetensors file (bad header length)")
            header = json.loads(f.read(hlen))
    except OSError as e:
        raise ConvertError(f"cannot read {path}: {e.strerror or e}") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: not a safetensors file (header is not JSON)") from e
    if not isinstance(header, dict):
        raise ConvertError(f"{path}: not a safetensors file (header is not a JSON object)")
    base = 8 + hlen
    recs: list[TensorRecord] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ConvertError(f"{path}: malformed header entry for tensor {name!r}") from e
        if dtype not in _ITEMSIZE:
            raise ConvertError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if b - a != n * _ITEMSIZE[dtype] or a < 0 or base + b > size:
            raise ConvertError(f"{path}: tensor {name} has an inconsistent byte range (file truncated or corrupt)")
        recs.append(TensorRecord(name, path, dtype, shape, base + a, base + b))
    # safetensors writers sort names; keep that order (it is also what upstream's converter follows)
    return recs


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors parts of an HF checkpoint, in the order upstream's converter visits them."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ConvertError(f"{index}: unreadable or has no weight_map") from e
        parts = sorted(set(weight_map.values()))
        missing = [p for p in parts if not (model_dir / p).is_file()]
        if missing:
            raise ConvertError(f"{model_dir}: checkpoint part(s) listed in the index are missing: {', '.join(missing)}")
        return [model_dir / p for p in parts]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    parts_found = sorted(model_dir.glob("model-*.safetensors"))
    if parts_found:
        return parts_found
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pth")):
        raise ConvertError(f"{model_dir}: only PyTorch pickle weights found; convert them to safetensors first "
                           "(loading pickles can execute code)")
    raise ConvertError(f"{model_dir}: no model.safetensors (or model-*.safetensors parts) found")


def iter_checkpoint(model_dir: Path) -> Iterator[TensorRecord]:
    """Every tensor of the checkpoint, part by part, each in header order; duplicates are an error."""
    seen: set[str] = set()
    for part in checkpoint_files(model_dir):
        for rec in read_header(part):
            if rec.name in seen:
                raise ConvertError(f"{model_dir}: tensor {rec.name} appears in more than one checkpoint part")
            seen.add(rec.name)
            yield rec

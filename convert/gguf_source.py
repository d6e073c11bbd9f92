"""An existing GGUF (e.g. the SmolLM2 Q4_1 file) as the converter's input.

The tensors are already named and laid out for llama.cpp (q/k rows included), so they are only
dequantised to float32 (gguf-py's ``gguf.quants.dequantize``; S3D8 through the project's codec) and
re-encoded. All metadata is copied unchanged except ``general.file_type`` (rewritten for the new type)
and ``general.quantization_version``; values are copied with their original GGUF value types and string
bytes, so e.g. float32 hyper-parameters round-trip exactly.

Note that re-encoding a quantised file does not recover the original weights: converting Q4_1 to F16
stores the Q4_1 grid exactly, converting it to S3D8 quantises those (already noisy) values again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

import gguf
from gguf import GGUFValueType as VT

from .common import ConversionOptions, TensorJob
from .errors import ConvertError
from .tensor_types import file_type_of

#: GGUF architectures this path accepts (only those whose tensors ``choose_type`` classifies correctly
#: and that llama.cpp loads with any per-tensor type).
SUPPORTED_ARCHS = ("llama",)

def _field_value(field: Any) -> tuple[Any, VT, VT | None]:
    """(value, type, array sub-type) of a reader field, with strings kept as raw bytes."""
    main = VT(field.types[0])
    if main == VT.ARRAY:
        sub = VT(field.types[-1])
        if len(field.types) != 2:
            raise ConvertError(f"metadata key {field.name}: nested arrays are not supported")
        if sub == VT.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return [v for i in field.data for v in field.parts[i].tolist()], main, sub
    if main == VT.STRING:
        return bytes(field.parts[-1]), main, None
    return field.parts[-1].tolist()[0], main, None


class GgufSource:
    """Re-encode the tensors of an existing GGUF file (see module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except (ValueError, OSError) as e:
            raise ConvertError(f"{path}: not a readable GGUF file ({e})") from e
        arch_field = self.reader.fields.get("general.architecture")
        arch = arch_field.contents() if arch_field is not None else None
        if arch not in SUPPORTED_ARCHS:
            raise ConvertError(f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
        self.arch = str(arch)

    def _loader(self, t: Any) -> Callable[[], np.ndarray]:
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))

        def load() -> np.ndarray:
            if getattr(gguf.GGMLQuantizationType, "S3D8", None) == qtype:
                from .tensor_types import s3d8_codec

                data = s3d8_codec().dequantize_s3d8(np.asarray(t.data), name=t.name)
            else:
                try:
                    data = gguf.quants.dequantize(np.asarray(t.data), qtype)
                except NotImplementedError as e:
                    raise ConvertError(f"{self.path}: tensor {t.name} has type {qtype.name}, "
                                       "which gguf-py cannot dequantise") from e
            return np.asarray(data, dtype=np.float32).reshape(shape)

        return load

    def tensor_jobs(self) -> list[TensorJob]:
        return [TensorJob(t.name, tuple(int(s) for s in reversed(t.shape.tolist())), self._loader(t), t.name)
                for t in self.reader.tensors]

    def add_metadata(self, writer: gguf.GGUFWriter, options: ConversionOptions) -> None:
        wrote_ftype = wrote_qv = False
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            if key == "general.file_type":
                writer.add_file_type(file_type_of(options.out_type))
                wrote_ftype = True
                continue
            if key == "general.quantization_version":
                writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
                wrote_qv = True
                continue
            val, vtype, sub = _field_value(field)
            if vtype == VT.ARRAY and not val:
                continue  # gguf-py cannot write empty arrays; they carry no information
            writer.add_key_value(key, val, vtype, sub_type=sub)
        if not wrote_ftype:
            writer.add_file_type(file_type_of(options.out_type))
        if not wrote_qv:
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

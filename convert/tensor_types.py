"""Which ggml type each tensor gets, why, and the exact encodings.

Rules (the same as upstream's ``convert_hf_to_gguf.py`` for the types it shares, so an f16/bf16/q8_0
conversion is byte-identical to upstream's):

* 1-D tensors, ``*_norm.weight`` and tensors that are not ``.weight`` (biases, generated
  ``rope_freqs``) are always F32.
* Every other weight (2-D matrices: attention q/k/v/o, ffn gate/up/down, token_embd, output; 3-D expert
  stacks) gets the requested ``--type``.
* A matrix the requested type cannot hold gets a fallback, with the reason recorded:
  S3D8 needs ``k % 128 == 0`` and enough slack for its header (``gguf_s3d8.s3d8_ineligibility``) and
  falls back to ``--fallback-type`` (Q8_0 by default); Q8_0 needs ``k % 32 == 0`` and falls back to F16
  (what upstream does on ``QuantError``).

Encodings: F32/F16 are numpy casts; S3D8 (the iw1 encoder), BF16 and Q8_0 run in C when the converter writes with
the C library (``convert.encoders``: ggml's own quantisers, in parallel), else BF16 and Q8_0 go through
``gguf.quants.quantize`` (bit-exact with ggml's reference code) and S3D8 through the project's numpy codec
``gguf_s3d8`` (imported only when needed): the same bytes either way.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Final, Mapping, Sequence

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from .encoders import active
from .errors import ConvertError

#: Output types a user can ask for with ``--type``.
OUT_TYPES: Final[tuple[str, ...]] = ("f32", "f16", "bf16", "q8_0", "s3d8")
#: Types usable as ``--fallback-type`` (any type that holds every shape, or falls back itself).
FALLBACK_TYPES: Final[tuple[str, ...]] = ("f32", "f16", "bf16", "q8_0")

#: The ``general.file_type`` value written for each ``--type``.
_FILE_TYPES: Final[dict[str, int]] = {
    "f32": int(gguf.LlamaFileType.ALL_F32),
    "f16": int(gguf.LlamaFileType.MOSTLY_F16),
    "bf16": int(gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": int(gguf.LlamaFileType.MOSTLY_Q8_0),
}

def s3d8_codec() -> ModuleType:
    """Import the S3D8 codec or explain why it is unavailable (the type itself is the series' gguf-py's)."""
    try:
        import gguf_s3d8  # noqa: F401
    except ImportError as e:
        raise ConvertError(f"--type s3d8 needs the project's codec package gguf_s3d8, which failed to import: {e}") from e
    if not hasattr(QT, "S3D8"):
        raise ConvertError(f"the gguf package in use ({Path(gguf.__file__).parent}) does not define S3D8: the "
                           "converter needs the patch series' gguf-py (python ci/patches.py apply)")
    return gguf_s3d8


def qtype_of(type_name: str) -> QT:
    """The ggml type for a ``--type`` / ``--fallback-type`` name."""
    if type_name == "s3d8":
        s3d8_codec()
        return QT.S3D8
    return {"f32": QT.F32, "f16": QT.F16, "bf16": QT.BF16, "q8_0": QT.Q8_0}[type_name]


def file_type_of(type_name: str) -> int:
    """``general.file_type`` for a requested ``--type`` (the type of most big matrices)."""
    if type_name == "s3d8":
        s3d8_codec()
        return int(gguf.LlamaFileType.MOSTLY_S3D8)
    return _FILE_TYPES[type_name]


@dataclass(frozen=True)
class TypeChoice:
    """The type a tensor is written with; ``reason`` is set when it is a fallback."""

    qtype: QT
    reason: str | None = None

    @property
    def is_fallback(self) -> bool:
        return self.reason is not None


def is_quantisable_weight(gguf_name: str, shape: Sequence[int]) -> bool:
    """True for the tensors ``--type`` applies to (matrices and expert stacks named ``*.weight``)."""
    return len(shape) >= 2 and gguf_name.endswith(".weight") and not gguf_name.endswith("_norm.weight")


def _q8_0_reason(k: int) -> str | None:
    return None if k % 32 == 0 else f"k={k} is not a multiple of 32 (Q8_0 block)"


def choose_type(gguf_name: str, shape: Sequence[int], requested: str, fallback: str = "q8_0") -> TypeChoice:
    """Pick the output type of one tensor (numpy shape, last axis = k = ggml ne0).

    Never raises for shape reasons: an ineligible matrix gets the fallback and the reason why.
    """
    if not is_quantisable_weight(gguf_name, shape):
        return TypeChoice(QT.F32)
    k = int(shape[-1])
    n = int(shape[-2])
    if requested == "s3d8":
        codec = s3d8_codec()
        why = codec.s3d8_ineligibility(n, k)
        if why is None:
            return TypeChoice(qtype_of("s3d8"))
        if fallback == "q8_0" and (q8 := _q8_0_reason(k)) is not None:
            return TypeChoice(QT.F16, f"S3D8: {why}; Q8_0: {q8}")
        return TypeChoice(qtype_of(fallback), f"S3D8: {why}")
    if requested == "q8_0":
        q8 = _q8_0_reason(k)
        return TypeChoice(QT.Q8_0) if q8 is None else TypeChoice(QT.F16, f"Q8_0: {q8}")
    return TypeChoice(qtype_of(requested))


def byte_shape(shape: Sequence[int], qtype: QT) -> tuple[int, ...]:
    """Shape of the encoded array (uint8 for block types), as ``GGUFWriter.add_tensor_info`` expects."""
    if qtype in (QT.F32, QT.F16):
        return tuple(int(s) for s in shape)
    return gguf.quant_shape_to_byte_shape(tuple(int(s) for s in shape), qtype)


def encoded_nbytes(shape: Sequence[int], qtype: QT) -> int:
    """Bytes the tensor occupies in the file (before alignment padding)."""
    bs = byte_shape(shape, qtype)
    itemsize = {QT.F32: 4, QT.F16: 2}.get(qtype, 1)
    return math.prod(bs) * itemsize


def encoded_dtype(qtype: QT) -> np.dtype:
    dtypes: dict[QT, np.dtype] = {QT.F32: np.dtype(np.float32), QT.F16: np.dtype(np.float16)}
    return dtypes.get(qtype, np.dtype(np.uint8))


#: S3D8 encoders a user can choose with ``--encoder``.
S3D8_ENCODERS: Final[tuple[str, ...]] = ("iw1", "reference")


@dataclass(frozen=True)
class S3D8Options:
    """Codec options for ``--type s3d8`` (None = the codec's default).

    ``encoder``: ``iw1`` (gguf_s3d8.importance, what llama-quantize runs; uses ``imatrix`` when given, the
    column-maximum weights otherwise) or ``reference`` (format §1's reference encoder: absmax scales, plain MSE fit).
    ``codebooks``: frozen per-tensor codebooks (GGUF name -> (32, 3) uint8, from a QAT checkpoint) used instead
    of fitting, with the reference encoder's absmax scales (what QAT's fake quantiser computes) - or, where
    ``scales`` (GGUF name -> (n,) bf16 bits) has the tensor too, with those frozen scales and the weight-space
    rule (``gguf_s3d8.importance.quantize_s3d8_with_scales``; QAT started from GPTQ / iw1).
    ``precomputed``: finished containers (``gguf_s3d8.tensor_file.S3D8TensorFile``, e.g. GPTQ's) written verbatim
    for the tensors it holds, after checking that they were made from the very weights being converted."""

    centroid_rule: str | None = None
    seed: int = 0
    codebooks: Mapping[str, np.ndarray] | None = None
    scales: Mapping[str, np.ndarray] | None = None
    encoder: str = "iw1"
    imatrix: object | None = None   # gguf_s3d8.imatrix.Imatrix (typed loosely: the codec is imported lazily)
    precomputed: object | None = None  # gguf_s3d8.tensor_file.S3D8TensorFile


def encode(data: np.ndarray, qtype: QT, *, name: str = "", s3d8: S3D8Options = S3D8Options()) -> Any:
    """Encode a float32 tensor as ``qtype`` (the array handed to the GGUF writer).

    While a file is written with the C encoders (``convert.encoders.active()``), S3D8 (iw1), Q8_0 and BF16 are
    queued on its worker threads and a ``convert.encoders.Pending`` is returned instead (the writer waits for it);
    elsewhere, and for the other encodings, the numpy encoders run here."""
    if qtype == QT.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    enc = active()
    if enc is not None and enc.native is not None and qtype in (QT.BF16, QT.Q8_0):
        w = np.ascontiguousarray(data, dtype=np.float32)
        flat = w.reshape(-1, w.shape[-1])
        return enc.submit([_native_job(enc.native, flat, qtype.name.lower(), name)],
                          lambda parts: parts[0].reshape(*w.shape[:-1], parts[0].shape[-1]))
    if qtype in (QT.F16, QT.BF16, QT.Q8_0):
        return gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qtype)
    if hasattr(QT, "S3D8") and qtype == QT.S3D8:
        codec = s3d8_codec()
        from gguf_s3d8.imatrix import ImatrixError

        w = np.ascontiguousarray(data, dtype=np.float32)
        try:
            if enc is not None and enc.native is not None and _native_s3d8(name, s3d8):
                return _submit_s3d8(enc, w, name, s3d8)
            return _encode_s3d8(w, name, s3d8, codec)
        except ImatrixError as e:
            raise ConvertError(str(e)) from e
        except codec.S3D8Error as e:
            raise ConvertError(f"tensor {name}: S3D8 encoding failed: {e}") from e
    raise ConvertError(f"tensor {name}: no encoder for ggml type {qtype.name}")


def _native_s3d8(name: str, s3d8: S3D8Options) -> bool:
    """Whether the C library encodes this S3D8 tensor: the iw1 encoder (llama-quantize's); frozen codebooks or scales,
    finished containers and the reference encoder stay in numpy."""
    pre = s3d8.precomputed
    return (s3d8.encoder == "iw1" and not (pre is not None and name in pre.containers)  # type: ignore[attr-defined]
            and not (s3d8.codebooks is not None and name in s3d8.codebooks))


def _native_job(native: Any, w: np.ndarray, type_name: str, name: str, **kw: Any) -> Callable[[int], np.ndarray]:
    """One C encoding (run on a worker thread), its errors as ConvertError naming the tensor."""
    def job(threads: int) -> np.ndarray:
        try:
            return native.quantize(w, type_name, threads=threads, name=name, **kw)
        except ValueError as e:  # S3D8InputError
            raise ConvertError(f"tensor {name}: {type_name.upper()} encoding failed: {e}") from e
    return job


def _submit_s3d8(enc: Any, w: np.ndarray, name: str, s3d8: S3D8Options) -> Any:
    """iw1 in C: one job per 2-D slice (expert), each with its own importance row, as llama-quantize."""
    n_slices = w.shape[0] if w.ndim == 3 else 1
    slices = list(w) if w.ndim == 3 else [w]
    imp = _importance(w, name, s3d8, n_slices)
    jobs = [_native_job(enc.native, a, "s3d8", f"{name}[{e}]" if w.ndim == 3 else name,
                        importance=None if imp is None else imp[e], centroid_rule=s3d8.centroid_rule, seed=s3d8.seed)
            for e, a in enumerate(slices)]
    return enc.submit(jobs, (lambda parts: np.stack(parts)) if w.ndim == 3 else (lambda parts: parts[0]))


def _importance(w: np.ndarray, name: str, s3d8: S3D8Options, n_slices: int) -> Any:
    """The imatrix rows of ``name`` (one per slice), or None (no imatrix, or no entry: a warning, as llama-quantize)."""
    imp = None if s3d8.imatrix is None else s3d8.imatrix.for_tensor(name, w.shape[-1], n_slices)  # type: ignore[attr-defined]
    if s3d8.imatrix is not None and imp is None:
        print(f"warning: the imatrix has no entry for {name}: S3D8 with the column-maximum weights (as llama-quantize)",
              file=sys.stderr)
    return imp


def _encode_s3d8(w: np.ndarray, name: str, s3d8: S3D8Options, codec: ModuleType) -> np.ndarray:
    """One S3D8 tensor (2-D, or a 3-D stack of expert slices: one container and codebook per slice)."""
    rule = {"centroid_rule": s3d8.centroid_rule} if s3d8.centroid_rule is not None else {}
    n_slices = w.shape[0] if w.ndim == 3 else 1
    slices = list(w) if w.ndim == 3 else [w]
    label = (lambda e: f"{name}[{e}]") if w.ndim == 3 else (lambda e: name)
    pre = s3d8.precomputed
    if pre is not None and name in pre.containers:  # type: ignore[attr-defined]
        return _precomputed_container(w, name, pre)
    if s3d8.codebooks is not None and name in s3d8.codebooks:
        cb = s3d8.codebooks[name]
        if s3d8.scales is not None and name in s3d8.scales:
            from gguf_s3d8.importance import quantize_s3d8_with_scales

            if w.ndim == 3:
                raise ConvertError(f"tensor {name}: frozen S3D8 scales for a 3-D expert stack are not supported")
            return quantize_s3d8_with_scales(w, cb, s3d8.scales[name], name=name)
        out = [codec.quantize_s3d8_with_codebook(a, cb, name=label(e)) for e, a in enumerate(slices)]
    elif s3d8.encoder == "reference":
        out = [codec.quantize_s3d8(a, name=label(e), seed=s3d8.seed, **rule) for e, a in enumerate(slices)]
    elif s3d8.encoder == "iw1":
        from gguf_s3d8.importance import quantize_s3d8_importance

        imp = _importance(w, name, s3d8, n_slices)
        out = [quantize_s3d8_importance(a, None if imp is None else imp[e], name=label(e), seed=s3d8.seed, **rule)
               for e, a in enumerate(slices)]
    else:
        raise ConvertError(f"unknown S3D8 encoder {s3d8.encoder!r} (known: {', '.join(S3D8_ENCODERS)})")
    return np.stack(out) if w.ndim == 3 else out[0]


def _precomputed_container(w: np.ndarray, name: str, pre: object) -> np.ndarray:
    """The finished container of ``name`` (GPTQ), if it was made from exactly these weights and fits the shape."""
    from gguf_s3d8.tensor_file import weight_fingerprint

    c = pre.containers[name]  # type: ignore[attr-defined]
    if weight_fingerprint(w) != pre.fingerprints[name]:  # type: ignore[attr-defined]
        raise ConvertError(f"tensor {name}: the S3D8 tensor file was computed from other weights than this model's "
                           "(fingerprint mismatch) - convert the checkpoint it was made from (after "
                           "qat.gptq_s3d8 --weights-dtype f16, the f16 GGUF of that checkpoint)")
    want = byte_shape(w.shape, QT.S3D8)
    if tuple(c.shape) != tuple(want):
        raise ConvertError(f"tensor {name}: the S3D8 tensor file holds a container of shape {tuple(c.shape)}, "
                           f"this tensor needs {tuple(want)}")
    return c

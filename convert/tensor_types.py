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

Every type, its geometry, eligibility, fallback and numpy encoder is defined once, in :mod:`gguf_s3d8.ggml_types`; this
module dispatches through that table (no per-type branches). Encodings: F32/F16 are numpy casts; the types marked
``native`` there (S3D8 with the iw1 encoder, BF16, Q8_0) run in C when the converter writes with the C library
(``convert.encoders``: ggml's own quantisers, in parallel), else in numpy (BF16 and Q8_0 through
``gguf.quants.quantize``, bit-exact with ggml's reference code; S3D8 through the project's codec): the same bytes
either way.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Final, Mapping, Sequence

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from gguf_s3d8 import ggml_types
from gguf_s3d8.ggml_types import S3D8_ENCODERS, WEIGHT_TYPES, GgmlType

from .encoders import active
from .errors import ConvertError

#: Output types a user can ask for with ``--type``: the weight types of the registry.
OUT_TYPES: Final[tuple[str, ...]] = tuple(t.name for t in WEIGHT_TYPES)
#: Types usable as ``--fallback-type`` (any type that holds every shape, or falls back itself).
FALLBACK_TYPES: Final[tuple[str, ...]] = tuple(t.name for t in WEIGHT_TYPES if t.holds_or_falls_back)


def s3d8_codec() -> ModuleType:
    """Import the S3D8 codec or explain why it is unavailable (the type itself is the series' gguf-py's)."""
    try:
        import gguf_s3d8  # noqa: F401
    except ImportError as e:
        raise ConvertError(f"--type s3d8 needs the project's codec package gguf_s3d8, which failed to import: {e}") from e
    if not hasattr(QT, "S3D8"):
        from gguf_s3d8.gguf_py import install_hint

        raise ConvertError(f"the gguf package in use ({Path(gguf.__file__).parent}) does not define S3D8: the "
                           f"converter needs the patch series' gguf-py: {install_hint()}")
    return gguf_s3d8


def weight_type(t: str | QT) -> GgmlType:
    """The registry's type for a ``--type`` name or a gguf-py type (KeyError for anything the converter cannot write:
    the callers pass choices argparse checked, or types this module chose)."""
    try:
        found = ggml_types.ggml_type(t)
    except ValueError as e:
        raise KeyError(t) from e
    if found.kind != "weight":
        raise KeyError(t)
    return found


def qtype_of(type_name: str) -> QT:
    """The ggml type for a ``--type`` / ``--fallback-type`` name."""
    t = weight_type(type_name)
    if not hasattr(QT, t.gguf_name):
        s3d8_codec()  # the one type stock gguf-py lacks: says which gguf-py the converter needs
    return QT(t.type_id)


def upstream_type(type_name: str) -> str:
    """The ``--outtype`` upstream's ``convert_hf_to_gguf`` plans a ``--type`` with: the type itself where upstream
    defines it, else F16, which the converter then recodes (S3D8)."""
    return type_name if weight_type(type_name).upstream else "f16"


def file_type_of(type_name: str) -> int:
    """``general.file_type`` for a requested ``--type`` (the type of most big matrices)."""
    qtype_of(type_name)
    file_type = weight_type(type_name).file_type
    assert file_type is not None
    return file_type


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


def choose_type(gguf_name: str, shape: Sequence[int], requested: str, fallback: str = "q8_0") -> TypeChoice:
    """Pick the output type of one tensor (numpy shape, last axis = k = ggml ne0).

    Never raises for shape reasons: an ineligible matrix gets the fallback and the reason why.
    """
    if not is_quantisable_weight(gguf_name, shape):
        return TypeChoice(QT.F32)
    k = int(shape[-1])
    n = int(shape[-2])
    t = weight_type(requested)
    qtype_of(requested)
    reasons: list[str] = []
    while (why := t.ineligibility(n, k)) is not None:
        reasons.append(f"{t.gguf_name}: {why}")
        nxt = weight_type(t.fallback or fallback)
        if nxt is t or len(reasons) > len(WEIGHT_TYPES):
            raise ConvertError(f"tensor {gguf_name}: no type holds it ({'; '.join(reasons)})")
        t = nxt
    return TypeChoice(qtype_of(t.name), "; ".join(reasons) if reasons else None)


def byte_shape(shape: Sequence[int], qtype: QT) -> tuple[int, ...]:
    """Shape of the encoded array (uint8 for block types), as ``GGUFWriter.add_tensor_info`` expects."""
    return weight_type(qtype).byte_shape(shape)


def encoded_nbytes(shape: Sequence[int], qtype: QT) -> int:
    """Bytes the tensor occupies in the file (before alignment padding)."""
    return weight_type(qtype).encoded_nbytes(shape)


def encoded_dtype(qtype: QT) -> np.dtype:
    return weight_type(qtype).dtype


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

    While a file is written with the C encoders (``convert.encoders.active()``), the registry's ``native`` types (S3D8
    with the iw1 encoder, Q8_0, BF16) are queued on its worker threads and a ``convert.encoders.Pending`` is returned
    instead (the writer waits for it); elsewhere, and for the other encodings, the type's numpy encoder runs here.
    ``s3d8`` holds the options of the slice-quantized type (S3D8)."""
    t = weight_type(qtype)
    w = np.ascontiguousarray(data, dtype=np.float32)
    if not t.slice_quantized:
        enc = active()
        if enc is not None and enc.native is not None and t.native:
            flat = w.reshape(-1, w.shape[-1])
            return enc.submit([_native_job(enc.native, flat, t.name, name)],
                              lambda parts: parts[0].reshape(*w.shape[:-1], parts[0].shape[-1]))
        return t.encode(w, name=name)
    codec = s3d8_codec()
    from gguf_s3d8.imatrix import ImatrixError

    try:
        return _encode_slices(t, w, name, s3d8)
    except ImatrixError as e:
        raise ConvertError(str(e)) from e
    except codec.S3D8Error as e:
        raise ConvertError(f"tensor {name}: {t.gguf_name} encoding failed: {e}") from e


def _encode_slices(t: GgmlType, w: np.ndarray, name: str, s3d8: S3D8Options) -> Any:
    """A slice-quantized tensor (2-D, or a 3-D stack of expert slices: one container and codebook per slice): a
    finished container, frozen codebook (and scales), or an encoder's fit - iw1 in C while a writer has the library."""
    pre = s3d8.precomputed
    if pre is not None and name in pre.containers:  # type: ignore[attr-defined]
        return _precomputed_container(w, name, pre)
    rule = {"centroid_rule": s3d8.centroid_rule} if s3d8.centroid_rule is not None else {}
    n_slices = w.shape[0] if w.ndim == 3 else 1
    if s3d8.codebooks is not None and name in s3d8.codebooks:
        scales = s3d8.scales[name] if s3d8.scales is not None and name in s3d8.scales else None
        if scales is not None and w.ndim == 3:
            raise ConvertError(f"tensor {name}: frozen S3D8 scales for a 3-D expert stack are not supported")
        return t.encode(w, name=name, codebook=s3d8.codebooks[name], scales=scales)
    if s3d8.encoder not in S3D8_ENCODERS:
        raise ConvertError(f"unknown S3D8 encoder {s3d8.encoder!r} (known: {', '.join(S3D8_ENCODERS)})")
    if s3d8.encoder == "reference":
        return t.encode(w, name=name, encoder="reference", seed=s3d8.seed, **rule)
    imp = _importance(w, name, s3d8, n_slices)
    enc = active()
    if enc is not None and enc.native is not None and t.native:
        slices = list(w) if w.ndim == 3 else [w]
        jobs = [_native_job(enc.native, a, t.name, f"{name}[{e}]" if w.ndim == 3 else name,
                            importance=None if imp is None else imp[e], centroid_rule=s3d8.centroid_rule,
                            seed=s3d8.seed)
                for e, a in enumerate(slices)]
        return enc.submit(jobs, (lambda parts: np.stack(parts)) if w.ndim == 3 else (lambda parts: parts[0]))
    return t.encode(w, name=name, encoder="iw1", importance=imp, seed=s3d8.seed, **rule)


def _native_job(native: Any, w: np.ndarray, type_name: str, name: str, **kw: Any) -> Callable[[int], np.ndarray]:
    """One C encoding (run on a worker thread), its errors as ConvertError naming the tensor."""
    def job(threads: int) -> np.ndarray:
        try:
            return native.quantize(w, type_name, threads=threads, name=name, **kw)
        except ValueError as e:  # S3D8InputError
            raise ConvertError(f"tensor {name}: {type_name.upper()} encoding failed: {e}") from e
    return job


def _importance(w: np.ndarray, name: str, s3d8: S3D8Options, n_slices: int) -> Any:
    """The imatrix rows of ``name`` (one per slice), or None (no imatrix, or no entry: a warning, as llama-quantize)."""
    imp = None if s3d8.imatrix is None else s3d8.imatrix.for_tensor(name, w.shape[-1], n_slices)  # type: ignore[attr-defined]
    if s3d8.imatrix is not None and imp is None:
        print(f"warning: the imatrix has no entry for {name}: S3D8 with the column-maximum weights (as llama-quantize)",
              file=sys.stderr)
    return imp


def _precomputed_container(w: np.ndarray, name: str, pre: object) -> np.ndarray:
    """The finished container of ``name`` (GPTQ), if it was made from exactly these weights and fits the shape."""
    from gguf_s3d8.tensor_file import weight_fingerprint

    c = pre.containers[name]  # type: ignore[attr-defined]
    if weight_fingerprint(w) != pre.fingerprints[name]:  # type: ignore[attr-defined]
        raise ConvertError(f"tensor {name}: the S3D8 tensor file was computed from other weights than this model's "
                           "(fingerprint mismatch) - convert the checkpoint it was made from (after "
                           "qat.gptq_s3d8 --weights-dtype f16, the f16 GGUF of that checkpoint)")
    want = ggml_types.S3D8.byte_shape(w.shape)
    if tuple(c.shape) != tuple(want):
        raise ConvertError(f"tensor {name}: the S3D8 tensor file holds a container of shape {tuple(c.shape)}, "
                           f"this tensor needs {tuple(want)}")
    return c

"""One home per type: every ggml type the project writes or reads in Python, in one table (the way gguf-py's
``quants.py`` keeps one class per type).

The weight types the converter writes (F32, F16, BF16, Q8_0 - upstream's, encoded as ggml does - and S3D8) and
the KV-cache types of the series (Q4_HQQ, Q4_HQQ_128, TQ3_0) are each one object here, with

* geometry: ``type_id`` (ggml.h), ``block_size`` and ``type_size`` (``GGML_QUANT_SIZES``), ``row_nbytes(k)``,
  ``byte_shape(shape)`` and the numpy ``dtype`` of the array a GGUF writer takes;
* ``file_type``: ``general.file_type`` of a model whose big matrices have the type (weights only);
* eligibility and fallback: ``ineligibility(n, k)`` (why an n x k matrix cannot take the type, or None) and
  ``fallback`` (the type such a matrix gets instead; None: the caller's choice, the converter's
  ``--fallback-type``);
* ``encode(w, ...)`` and ``decode(data, ...)`` in numpy (the bytes ggml's reference quantisers write: gguf-py's
  ``quants`` for the stock types, this package's codecs for S3D8 and the KV types);
* ``upstream``: upstream llama.cpp defines the type (its ``convert_hf_to_gguf.py`` writes the weight types), or
  the patch series does (S3D8, the KV types);
* ``native``: ``libs3d8-native`` (:mod:`gguf_s3d8.native`, ggml's own quantisers) encodes it;
  ``slice_quantized``: whole 2-D slices, not rows, are the unit (ggml's ``ggml_is_slice_quantized``);
* ``torch_twin``: ``"module:name"`` of its torch fake-quantiser in QAT, where one exists - a reference only
  (``qat.formats.torch_twin`` resolves it): this package imports neither torch nor qat. ``torch_activations``:
  likewise, the fake-quantiser of the activations that ggml's CPU matmul pairs with a weight of the type (its
  ``vec_dot_type``), and ``absmax_scale``: the dynamic ``amax / 127`` scale of the type ("block": one per block,
  "row": one per row) whose gradient QAT's straight-through estimator adds; ``lossless``: a weight of the type
  holds its fp32 value itself (F32), so QAT has nothing to simulate.

The converter (``convert.tensor_types``, ``convert.common``), the native binding (:mod:`gguf_s3d8.native`), QAT
(``qat.formats``, ``qat.student``, ``qat.gptq_s3d8``) and the tests dispatch through :data:`TYPES` /
:func:`ggml_type`, which hands the KV types to their codecs in :mod:`gguf_s3d8.kv_types` and S3D8 to this package's
codec; the ids are checked against ggml.h, llama.h and the series' gguf-py by ``tests/python/test_type_ids.py``.
Importing this module imports neither gguf nor anything with an effect on the process: gguf-py is imported where a
stock type is encoded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final, Sequence

import numpy as np
import numpy.typing as npt

from .constants import BLOCK_SIZE, LLAMA_FTYPE_MOSTLY_S3D8, S3D8_TYPE_ID, TYPE_SIZE
from .errors import S3D8InputError
from .kv_types import dequantize_hqq, dequantize_tq3_0, quantize_hqq, quantize_tq3_0

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class GgmlType:
    """A ggml type: geometry, eligibility, fallback and its numpy encoder/decoder (subclasses)."""

    name: str                       #: lower case: the converter's ``--type``, llama.cpp's ``-ctk`` spelling
    type_id: int                    #: ggml_type
    block_size: int                 #: values per block
    type_size: int                  #: bytes per block
    kind: str = "weight"            #: "weight" (a GGUF weight the converter writes) or "kv" (a KV-cache type)
    file_type: int | None = None    #: LLAMA_FTYPE of a model mostly of this type (weights)
    fallback: str | None = None     #: the type an ineligible matrix gets (None: the caller's --fallback-type)
    native: bool = False            #: libs3d8-native encodes it
    slice_quantized: bool = False   #: the unit of encoding is a whole 2-D slice (S3D8), not a row
    torch_twin: str | None = None   #: "module:name" of the QAT torch fake-quantiser of the type
    upstream: bool = True           #: upstream llama.cpp defines it (False: the patch series' own type)
    torch_activations: str | None = None  #: "module:name" of QAT's fake-quantiser of the matmul's activations
    absmax_scale: str | None = None  #: QAT: the type's dynamic amax/127 scale, one per "block" or per "row"

    @property
    def gguf_name(self) -> str:
        """The member name in gguf-py's ``GGMLQuantizationType`` (and ggml's type name, upper case)."""
        return self.name.upper()

    @property
    def dtype(self) -> np.dtype:
        """dtype of the array a GGUF writer takes (uint8 bytes for block types)."""
        return np.dtype(np.uint8)

    @property
    def lossless(self) -> bool:
        """A tensor of this type holds the fp32 values themselves (F32): nothing rounded, any layout."""
        return self.dtype == np.float32

    def scale_block(self, k: int) -> int | None:
        """Elements of a row of length ``k`` per dynamic scale (:attr:`absmax_scale`; None: no such scale)."""
        return {"block": self.block_size, "row": k}.get(self.absmax_scale or "")

    def row_nbytes(self, k: int) -> int:
        """ggml_row_size(type, k)."""
        return k // self.block_size * self.type_size

    def byte_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of the encoded array (``gguf.quant_shape_to_byte_shape``; float types keep their shape)."""
        s = tuple(int(d) for d in shape)
        if self.dtype != np.uint8:
            return s
        if s[-1] % self.block_size:
            raise ValueError(f"Quantized tensor row size ({s[-1]}) is not a multiple of {self.gguf_name} block size "
                             f"({self.block_size})")
        return (*s[:-1], self.row_nbytes(s[-1]))

    def encoded_nbytes(self, shape: Sequence[int]) -> int:
        """Bytes a tensor of this shape occupies in a GGUF (before alignment padding)."""
        return math.prod(self.byte_shape(shape)) * self.dtype.itemsize

    def ineligibility(self, n: int, k: int) -> str | None:
        """Why an n x k matrix (k = row length, ne0) cannot take this type, or None (row types: whole blocks)."""
        if k % self.block_size:
            return f"k={k} is not a multiple of {self.block_size} ({self.gguf_name} block)"
        return None

    @property
    def holds_or_falls_back(self) -> bool:
        """Usable as a fallback type: it holds every shape, or names its own fallback."""
        return self.fallback is not None or (self.block_size == 1 and not self.slice_quantized)

    def encode(self, w: npt.ArrayLike, **options: Any) -> np.ndarray:
        raise NotImplementedError(f"{self.gguf_name}: no numpy encoder")

    def decode(self, data: npt.ArrayLike, **options: Any) -> FloatArray:
        raise NotImplementedError(f"{self.gguf_name}: no numpy decoder")


@dataclass(frozen=True)
class FloatType(GgmlType):
    """F32 / F16: numpy arrays of that dtype (F32 as is; F16 a cast, as gguf-py's ``quants``)."""

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32 if self.type_size == 4 else np.float16)

    def encode(self, w: npt.ArrayLike, **options: Any) -> np.ndarray:
        a = np.ascontiguousarray(w, dtype=np.float32)
        if self.dtype == np.float32:
            return a
        return _gguf_quants().quantize(a, _gguf_qtype(self))

    def decode(self, data: npt.ArrayLike, **options: Any) -> FloatArray:
        return np.asarray(data, dtype=self.dtype).astype(np.float32)


@dataclass(frozen=True)
class GgufPyType(GgmlType):
    """A stock block type encoded by gguf-py's ``quants`` (bit-exact with ggml's reference quantisers)."""

    def encode(self, w: npt.ArrayLike, **options: Any) -> np.ndarray:
        return _gguf_quants().quantize(np.ascontiguousarray(w, dtype=np.float32), _gguf_qtype(self))

    def decode(self, data: npt.ArrayLike, **options: Any) -> FloatArray:
        return _gguf_quants().dequantize(np.asarray(data), _gguf_qtype(self))


@dataclass(frozen=True)
class S3D8Type(GgmlType):
    """S3D8: one container per 2-D slice (format page, docs/s3d8-format.md); the codec of this package."""

    def ineligibility(self, n: int, k: int) -> str | None:
        from .eligibility import s3d8_ineligibility

        return s3d8_ineligibility(n, k)

    def encode(self, w: npt.ArrayLike, *, name: str = "", encoder: str = "iw1", importance: Any = None,
               codebook: npt.ArrayLike | None = None, scales: npt.ArrayLike | None = None,
               centroid_rule: str | None = None, seed: int = 0, **options: Any) -> np.ndarray:
        """The container(s) of a 2-D matrix or a 3-D stack of slices (one container and codebook each).

        ``codebook``: a frozen codebook instead of a fit (with ``scales``, frozen bf16 scales too: the weight-space
        rule; 2-D only); else ``encoder`` ``iw1`` (``importance``: one row per slice, or None) or ``reference``."""
        from . import importance as iw1
        from .quantize import quantize_s3d8, quantize_s3d8_with_codebook

        a = np.ascontiguousarray(w, dtype=np.float32)
        rule = {"centroid_rule": centroid_rule} if centroid_rule is not None else {}
        slices = list(a) if a.ndim == 3 else [a]
        label = (lambda e: f"{name}[{e}]") if a.ndim == 3 else (lambda e: name)
        if codebook is not None and scales is not None:
            if a.ndim == 3:
                raise S3D8InputError(name, "frozen S3D8 scales for a 3-D expert stack are not supported")
            return iw1.quantize_s3d8_with_scales(a, codebook, scales, name=name)
        if codebook is not None:
            out = [quantize_s3d8_with_codebook(s, codebook, name=label(e)) for e, s in enumerate(slices)]
        elif encoder == "reference":
            out = [quantize_s3d8(s, name=label(e), seed=seed, **rule) for e, s in enumerate(slices)]
        elif encoder == "iw1":
            out = [iw1.quantize_s3d8_importance(s, None if importance is None else importance[e], name=label(e),
                                                seed=seed, **rule) for e, s in enumerate(slices)]
        else:
            raise S3D8InputError(name, f"unknown S3D8 encoder {encoder!r} (known: {', '.join(S3D8_ENCODERS)})")
        return np.stack(out) if a.ndim == 3 else out[0]

    def decode(self, data: npt.ArrayLike, *, name: str = "", **options: Any) -> FloatArray:
        from .quantize import dequantize_s3d8

        return dequantize_s3d8(data, name=name)


@dataclass(frozen=True)
class HqqKvType(GgmlType):
    """Q4_HQQ / Q4_HQQ_128 (ggml-kvq.h): Q4_1's layout with HQQ's zero point, blocks of ``block_size`` values;
    flat float arrays <-> bytes (:mod:`gguf_s3d8.kv_types`)."""

    def encode(self, w: npt.ArrayLike, **options: Any) -> np.ndarray:
        return np.frombuffer(quantize_hqq(w, self.block_size), dtype=np.uint8)

    def decode(self, data: npt.ArrayLike, **options: Any) -> FloatArray:
        return dequantize_hqq(np.ascontiguousarray(data, dtype=np.uint8).tobytes(), self.block_size)


@dataclass(frozen=True)
class Tq3KvType(GgmlType):
    """TQ3_0 (ggml-kvq.h): the 8-level Lloyd-Max code of the rotated cache (:mod:`gguf_s3d8.kv_types`)."""

    def encode(self, w: npt.ArrayLike, **options: Any) -> np.ndarray:
        return np.frombuffer(quantize_tq3_0(w), dtype=np.uint8)

    def decode(self, data: npt.ArrayLike, **options: Any) -> FloatArray:
        return dequantize_tq3_0(np.ascontiguousarray(data, dtype=np.uint8).tobytes())


def _gguf_quants() -> Any:
    from .gguf_py import series_gguf

    return series_gguf().quants


def _gguf_qtype(t: GgmlType) -> Any:
    from .gguf_py import series_gguf

    return series_gguf().GGMLQuantizationType(t.type_id)


#: S3D8 encoders (``S3D8Type.encode(encoder=...)``, the converter's ``--encoder``).
S3D8_ENCODERS: Final[tuple[str, ...]] = ("iw1", "reference")

F32: Final = FloatType("f32", 0, 1, 4, file_type=0)
F16: Final = FloatType("f16", 1, 1, 2, file_type=1, torch_twin="qat.numerics:f16_round",
                      torch_activations="qat.numerics:f16_round")
BF16: Final = GgufPyType("bf16", 30, 1, 2, file_type=32, native=True, torch_twin="qat.numerics:bf16_rne",
                         torch_activations="qat.numerics:bf16_rne")
Q8_0: Final = GgufPyType("q8_0", 8, 32, 34, file_type=7, fallback="f16", native=True,
                         torch_twin="qat.ggml_torch:q8_0_dequantised",
                         torch_activations="qat.ggml_torch:q8_0_activations", absmax_scale="block")
S3D8: Final = S3D8Type("s3d8", S3D8_TYPE_ID, BLOCK_SIZE, TYPE_SIZE, file_type=LLAMA_FTYPE_MOSTLY_S3D8, native=True,
                       slice_quantized=True, torch_twin="qat.formats:S3D8Format", upstream=False,
                       torch_activations="qat.s3d8_torch:fake_quant_activations", absmax_scale="row")
# the KV types' ids follow S3D8's (96), far from upstream's end of the enum
Q4_HQQ: Final = HqqKvType("q4_hqq", 97, 32, 20, kind="kv", upstream=False)
Q4_HQQ_128: Final = HqqKvType("q4_hqq_128", 98, 128, 68, kind="kv", upstream=False)
TQ3_0: Final = Tq3KvType("tq3_0", 99, 32, 14, kind="kv", upstream=False)

#: The one table: every type by name, weights in the converter's ``--type`` order, then the KV types.
TYPES: Final[dict[str, GgmlType]] = {t.name: t for t in (F32, F16, BF16, Q8_0, S3D8, Q4_HQQ, Q4_HQQ_128, TQ3_0)}
WEIGHT_TYPES: Final[tuple[GgmlType, ...]] = tuple(t for t in TYPES.values() if t.kind == "weight")
KV_TYPES: Final[tuple[GgmlType, ...]] = tuple(t for t in TYPES.values() if t.kind == "kv")
_BY_ID: Final[dict[int, GgmlType]] = {t.type_id: t for t in TYPES.values()}


def ggml_type(t: str | int | Any) -> GgmlType:
    """The type named ``t``: a name (any case), a ggml type id, or a gguf-py ``GGMLQuantizationType`` member."""
    found = TYPES.get(t.lower()) if isinstance(t, str) else _BY_ID.get(int(t))
    if found is None:
        raise ValueError(f"unknown ggml type {t!r} (known: {', '.join(TYPES)})")
    return found

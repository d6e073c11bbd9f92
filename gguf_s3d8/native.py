"""ctypes binding of ``libs3d8-native``: the patched ggml's own quantisers (S3D8's iw1, Q8_0, BF16), as
``llama-quantize`` runs them, for the converter.

The library is built by the project's CMake (``tools/s3d8-native``, ``bash ci/build.sh host``) into
``build/host/lib/libs3d8-native.so``; it links the static ggml-base of the patched tree, so it encodes with the very
code (and gives the very bytes) of ``llama-quantize`` - which are also the bytes of this package's numpy encoders, the
tested reference (tests/python/test_native.py). Where it is looked for: ``$S3D8_NATIVE_LIB`` (a file), else
``$S3D8_BIN_DIR/../lib/``, else ``<repo>/build/host/lib/``.

A library from another build of the series is refused with :class:`NativeLibraryError` naming what differs (its ABI
version, the S3D8 type id, a type's name or row size) rather than trusted to write other bytes.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt

from .constants import CENTROID_RULES, DEFAULT_CENTROID_RULE, S3D8_TYPE_ID
from .errors import S3D8InputError
from .ggml_types import WEIGHT_TYPES

#: The ABI this module speaks (``S3D8_NATIVE_ABI`` of tools/s3d8-native/s3d8-native.c).
ABI_VERSION: Final = 1
LIBRARY_NAME: Final = "libs3d8-native.so"
#: ggml type ids of the types this module encodes (``native`` in :mod:`gguf_s3d8.ggml_types`; checked against the
#: library's names and row sizes).
TYPE_IDS: Final[dict[str, int]] = {t.name: t.type_id for t in WEIGHT_TYPES if t.native}
#: enum ggml_s3d8_centroid_rule
_RULE_IDS: Final[dict[str, int]] = {"round": 0, "trunc": 1}

_REPO = Path(__file__).resolve().parents[1]


class NativeLibraryError(RuntimeError):
    """The library is missing, cannot be loaded, or was built from another version of the series."""


def library_path() -> Path:
    """Where the library is looked for (the first candidate that exists, else the default build location)."""
    env = os.environ.get("S3D8_NATIVE_LIB")
    if env:
        return Path(env)
    candidates = []
    bin_dir = os.environ.get("S3D8_BIN_DIR")
    if bin_dir:
        candidates.append(Path(bin_dir).parent / "lib" / LIBRARY_NAME)
    candidates.append(_REPO / "build" / "host" / "lib" / LIBRARY_NAME)
    return next((c for c in candidates if c.is_file()), candidates[-1])


class NativeCodec:
    """One loaded, checked library. Thread-safe: calls run concurrently (each with its own OpenMP team)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise NativeLibraryError(f"{path}: cannot load it: {e}") from e
        try:
            lib.s3d8_native_abi.restype = ctypes.c_int
            lib.s3d8_native_type_s3d8.restype = ctypes.c_int
            lib.s3d8_native_openmp.restype = ctypes.c_int
            lib.s3d8_native_type_name.restype = ctypes.c_char_p
            lib.s3d8_native_type_name.argtypes = [ctypes.c_int]
            lib.s3d8_native_row_size.restype = ctypes.c_size_t
            lib.s3d8_native_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
            q = lib.s3d8_native_quantize
        except AttributeError as e:
            raise NativeLibraryError(f"{path}: not a libs3d8-native library ({e})") from e
        q.restype = ctypes.c_int
        q.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_int, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        self._lib = lib
        self._check()
        self.openmp = bool(lib.s3d8_native_openmp())

    def _check(self) -> None:
        """The library must speak this ABI and agree with gguf-py on every type it is used for."""
        rebuild = "rebuild it (`bash ci/build.sh host`) or convert with --backend numpy"
        abi = int(self._lib.s3d8_native_abi())
        if abi != ABI_VERSION:
            raise NativeLibraryError(f"{self.path}: ABI version {abi}, this checkout needs {ABI_VERSION}: {rebuild}")
        s3d8 = int(self._lib.s3d8_native_type_s3d8())
        if s3d8 != S3D8_TYPE_ID:
            raise NativeLibraryError(f"{self.path}: GGML_TYPE_S3D8 is {s3d8} in the library, {S3D8_TYPE_ID} in this "
                                     f"checkout (another version of the patch series): {rebuild}")
        from .gguf_py import series_gguf

        gguf = series_gguf()
        for name, tid in TYPE_IDS.items():
            got = self._lib.s3d8_native_type_name(tid)
            got_name = got.decode() if got else None
            if got_name != name:
                raise NativeLibraryError(f"{self.path}: ggml type {tid} is {got_name!r} in the library, {name!r} in this "
                                         f"checkout: {rebuild}")
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(tid)]
            k = 4608  # a multiple of every block size (S3D8 128, Q8_0 32)
            want = k // block * size
            have = int(self._lib.s3d8_native_row_size(tid, k))
            if have != want:
                raise NativeLibraryError(f"{self.path}: a row of {k} {name} values is {have} bytes in the library, "
                                         f"{want} in gguf-py: {rebuild}")

    def row_nbytes(self, type_name: str, k: int) -> int:
        return int(self._lib.s3d8_native_row_size(TYPE_IDS[type_name], k))

    def quantize(self, w: npt.ArrayLike, type_name: str, *, importance: npt.ArrayLike | None = None,
                 centroid_rule: str | None = None, seed: int = 0, threads: int = 1,
                 name: str = "") -> npt.NDArray[np.uint8]:
        """Encode one float32 matrix (n, k) as ``type_name`` (``s3d8``: one container, the iw1 encoder with the given
        importance - None: the column-maximum weights -, centroid rule and seed; ``q8_0`` / ``bf16``: rows).
        Returns the encoded matrix as uint8 (n, row bytes). ``threads``: OpenMP threads of this call; the bytes do not
        depend on it. Unusable input raises :class:`S3D8InputError` naming ``name``; the GIL is released meanwhile."""
        if type_name not in TYPE_IDS:
            raise ValueError(f"no native encoder for {type_name!r} (known: {', '.join(TYPE_IDS)})")
        a = np.ascontiguousarray(w, dtype=np.float32)
        if a.ndim != 2:
            raise S3D8InputError(name, f"expected a 2-D matrix, got shape {a.shape}")
        n, k = (int(s) for s in a.shape)
        imp = None
        if importance is not None:
            imp = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1)
            if imp.size != k:
                raise S3D8InputError(name, f"importance has {imp.size} values, the matrix has {k} columns")
        rule = -1
        if centroid_rule is not None and centroid_rule not in CENTROID_RULES:
            raise S3D8InputError(name, f"unknown centroid rule {centroid_rule!r} (known: {', '.join(CENTROID_RULES)})")
        if centroid_rule is not None and (centroid_rule != DEFAULT_CENTROID_RULE or seed != 0):
            rule = _RULE_IDS[centroid_rule]
        if not 0 <= seed < 2**64:
            raise S3D8InputError(name, f"seed {seed} is not a 64-bit unsigned integer")
        row = self.row_nbytes(type_name, k)
        out = np.empty((n, row), dtype=np.uint8)
        err = ctypes.create_string_buffer(512)
        rc = self._lib.s3d8_native_quantize(TYPE_IDS[type_name], a.ctypes.data, out.ctypes.data, n, k,
                                            None if imp is None else imp.ctypes.data, rule, seed, max(1, int(threads)),
                                            err, len(err))
        if rc != 0:
            raise S3D8InputError(name, f"{type_name}: {err.value.decode(errors='replace')}")
        return out


_lock = threading.Lock()
_loaded: dict[Path, NativeCodec | NativeLibraryError] = {}


def load_native(path: Path | None = None) -> NativeCodec:
    """The library at ``path`` (default :func:`library_path`), loaded and checked once per process; raises
    :class:`NativeLibraryError` (missing, unloadable, or from another build of the series)."""
    p = Path(path) if path is not None else library_path()
    with _lock:
        if p not in _loaded:
            try:
                if not p.is_file():
                    raise NativeLibraryError(f"{p} is not built (`bash ci/build.sh host` builds it)")
                _loaded[p] = NativeCodec(p)
            except NativeLibraryError as e:
                _loaded[p] = e
        got = _loaded[p]
    if isinstance(got, NativeLibraryError):
        raise got
    return got

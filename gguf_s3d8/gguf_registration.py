"""Teach the installed gguf-py package (PyPI ``gguf``) about GGML_TYPE_S3D8.

gguf-py knows quantisation types through two tables only: the IntEnum ``GGMLQuantizationType`` (the
reader calls ``GGMLQuantizationType(raw_type)`` on every tensor, the dump script prints ``.name``) and
``GGML_QUANT_SIZES`` (block size, type size), from which GGUFWriter derives the logical shape of a raw
byte tensor and GGUFReader the byte size and (n, 43k/128) uint8 shape of a stored one. Adding S3D8 to
both is all that writing, reading and gguf-dump need; S3D8 stays out of ``gguf.quants`` (its row-wise
quantize/dequantize interface cannot express a matrix-level type).

The enum gets a real member, built the way ``enum`` builds members at class creation, so
``GGMLQuantizationType(96)``, ``GGMLQuantizationType.S3D8``, ``["S3D8"]`` and iteration all work.
Registration is idempotent and refuses to overwrite a different type that already uses id 96.
"""

from __future__ import annotations

import enum
from typing import Any

from .constants import BLOCK_SIZE, LLAMA_FTYPE_MOSTLY_S3D8, S3D8_TYPE_ID, S3D8_TYPE_NAME, TYPE_SIZE


class S3D8RegistrationError(RuntimeError):
    """The installed gguf package already uses S3D8's id or name for something else."""


def _add_enum_member(enum_cls: Any, name: str, value: int) -> Any:
    proto = getattr(enum, "_proto_member", None)
    if proto is not None:  # Python >= 3.11: the same path class creation takes
        type.__setattr__(enum_cls, name, proto(value))
        enum_cls.__dict__[name].__set_name__(enum_cls, name)
    else:  # Python 3.10
        member = int.__new__(enum_cls, value)
        member._name_ = name
        member._value_ = value
        member.__objclass__ = enum_cls
        enum_cls._member_names_.append(name)
        enum_cls._member_map_[name] = member
        enum_cls._value2member_map_[value] = member
        type.__setattr__(enum_cls, name, member)
    return enum_cls(value)


def register_with_gguf() -> Any:
    """Register S3D8 with gguf-py (idempotent); returns the ``GGMLQuantizationType.S3D8`` member."""
    from gguf import constants  # imported lazily: the codec itself needs only numpy

    qtype = constants.GGMLQuantizationType
    by_value = qtype._value2member_map_.get(S3D8_TYPE_ID)
    by_name = qtype._member_map_.get(S3D8_TYPE_NAME)
    if by_value is not None and by_value._name_ != S3D8_TYPE_NAME:
        raise S3D8RegistrationError(
            f"gguf-py already uses type id {S3D8_TYPE_ID} for {by_value._name_}; S3D8 needs a new id "
            "(change S3D8_TYPE_ID here and in ggml-patches/)")
    if by_name is not None and int(by_name) != S3D8_TYPE_ID:
        raise S3D8RegistrationError(
            f"gguf-py already defines {S3D8_TYPE_NAME} with id {int(by_name)}, not {S3D8_TYPE_ID}")
    member = by_value if by_value is not None else _add_enum_member(qtype, S3D8_TYPE_NAME, S3D8_TYPE_ID)
    sizes = constants.GGML_QUANT_SIZES
    existing = sizes.get(member)
    if existing is not None and tuple(existing) != (BLOCK_SIZE, TYPE_SIZE):
        raise S3D8RegistrationError(f"gguf-py has sizes {existing} for S3D8, expected {(BLOCK_SIZE, TYPE_SIZE)}")
    sizes[member] = (BLOCK_SIZE, TYPE_SIZE)
    _register_file_type(constants.LlamaFileType)
    return member


def _register_file_type(ftype: Any) -> None:
    """``gguf.LlamaFileType.MOSTLY_S3D8`` = llama.cpp's LLAMA_FTYPE_MOSTLY_S3D8 (idempotent)."""
    name = "MOSTLY_S3D8"
    by_value = ftype._value2member_map_.get(LLAMA_FTYPE_MOSTLY_S3D8)
    if by_value is not None and by_value._name_ != name:
        raise S3D8RegistrationError(
            f"gguf-py already uses file type {LLAMA_FTYPE_MOSTLY_S3D8} for {by_value._name_}")
    if by_value is None:
        _add_enum_member(ftype, name, LLAMA_FTYPE_MOSTLY_S3D8)


def s3d8_gguf_type() -> Any:
    """``gguf.GGMLQuantizationType.S3D8`` (registering it first if needed)."""
    return register_with_gguf()

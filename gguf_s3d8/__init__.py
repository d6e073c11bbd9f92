"""S3D8: 2.7-bit vector-quantised weights (three rows per byte) for GGUF / llama.cpp, in numpy.

This package is the reference implementation of docs/s3d8-format.md: the C type and kernels and the torch
QAT fake-quantiser must agree with it bit for bit. Importing it has no effect on the process: the ``gguf`` it
writes and reads GGUF files with is the environment's, which must be the patch series' gguf-py (it defines the
S3D8 type, id 96; ``ci/setup.sh`` installs it from the applied tree, ``gguf_s3d8.gguf_py``).

Typical use::

    import gguf, gguf_s3d8
    container = gguf_s3d8.quantize_s3d8(w, name="blk.0.attn_q.weight")    # w: fp32 (n, k)
    writer.add_tensor("blk.0.attn_q.weight", container, raw_dtype=gguf.GGMLQuantizationType.S3D8)
"""

from __future__ import annotations

from .activations import quantize_activations
from .assignment import centroid_distances, nearest_centroid
from .bf16 import bf16_bits_to_fp32, bf16_round, fp32_to_bf16_bits
from .codebook import apply_centroid_rule, fit_codebook
from .constants import (
    BLOCK_SIZE,
    CENTROID_RULES,
    DEFAULT_CENTROID_RULE,
    MAGIC,
    N_CENTROIDS,
    S3D8_TYPE_ID,
    S3D8_TYPE_NAME,
    TYPE_SIZE,
    VERSION,
)
from .container import S3D8Container, read_container, write_container
from .eligibility import body_offset, container_nbytes, is_s3d8_eligible, row_nbytes, s3d8_ineligibility
from .errors import S3D8Error, S3D8FormatError, S3D8IneligibleError, S3D8InputError
from .gguf_py import S3D8GgufError, s3d8_gguf_type, series_gguf
from .packing import decode_bytes, decode_tables, pack_bytes, sign_bits, unpack_bytes
from .quantize import (
    decode_int8,
    dequantize_s3d8,
    quantize_s3d8,
    quantize_s3d8_with_codebook,
)
from .reference import reference_matmul
from .scales import absmax_scale_bf16, normalise

__all__ = [
    "BLOCK_SIZE", "CENTROID_RULES", "DEFAULT_CENTROID_RULE", "MAGIC", "N_CENTROIDS", "S3D8_TYPE_ID",
    "S3D8_TYPE_NAME", "TYPE_SIZE", "VERSION",
    "S3D8Container", "S3D8Error", "S3D8FormatError", "S3D8GgufError", "S3D8IneligibleError", "S3D8InputError",
    "absmax_scale_bf16", "apply_centroid_rule", "bf16_bits_to_fp32", "bf16_round", "body_offset",
    "centroid_distances", "container_nbytes", "decode_bytes", "decode_int8", "decode_tables",
    "dequantize_s3d8", "fit_codebook", "fp32_to_bf16_bits", "is_s3d8_eligible", "nearest_centroid",
    "normalise", "pack_bytes", "quantize_activations", "quantize_s3d8", "quantize_s3d8_with_codebook",
    "read_container", "reference_matmul", "row_nbytes", "s3d8_gguf_type", "s3d8_ineligibility", "series_gguf",
    "sign_bits", "unpack_bytes", "write_container",
]

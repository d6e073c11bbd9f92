"""Numbers fixed by the S3D8 format (docs/s3d8-format.md); every other module imports them from here.

Nothing in this module may change without changing the normative format page and the C patch with it:
the C implementation (ggml type + kernels) and the torch QAT fake-quantiser use the same values.
"""

from __future__ import annotations

from typing import Final, Literal

#: ggml type id of GGML_TYPE_S3D8. Deliberately far from upstream's enum (which ends at 41/42 when this
#: was written) so that upstream adding types never collides with files written before; the C patch in
#: ggml-patches/ uses the same number and CI fails if upstream ever claims it.
S3D8_TYPE_ID: Final = 96
# llama.cpp's LLAMA_FTYPE_MOSTLY_S3D8 (general.file_type of a model whose big matrices are S3D8); the
# ggml patch picks the same number as the type id, for the same reason (far from upstream's growth).
LLAMA_FTYPE_MOSTLY_S3D8: int = 96
#: Name of the type in ggml / gguf-py.
S3D8_TYPE_NAME: Final = "S3D8"

#: ggml type traits: ggml_row_size(S3D8, k) = TYPE_SIZE * k / BLOCK_SIZE = 43 k / 128 bytes.
BLOCK_SIZE: Final = 128
TYPE_SIZE: Final = 43

#: Vector quantiser geometry: 3 rows share one byte, 32 centroids (5-bit index), components 0..127.
VECTOR_DIM: Final = 3
N_CENTROIDS: Final = 32
INDEX_BITS: Final = 5
CENTROID_MAX: Final = 127
#: Divisor of the absmax scale (weights and activations alike): the element range is [-127, 127].
SCALE_DIVISOR: Final = 127
#: Activation integers are clamped to [-ACT_QMAX, ACT_QMAX] (not -128).
ACT_QMAX: Final = 127

# --- container header (section 4), all little endian ---------------------------------------------------
MAGIC: Final = b"S3D8"
VERSION: Final = 1
OFF_MAGIC: Final = 0
OFF_VERSION: Final = 4
OFF_RESERVED: Final = 5          # 3 zero bytes (reserved flags)
RESERVED_SIZE: Final = 3
OFF_K: Final = 8                 # u32
OFF_N: Final = 12                # u32
OFF_CODEBOOK: Final = 16         # C[l][d] at OFF_CODEBOOK + 3 l + d
CODEBOOK_SIZE: Final = N_CENTROIDS * VECTOR_DIM   # 96
OFF_CODEBOOK_PAD: Final = OFF_CODEBOOK + CODEBOOK_SIZE  # 112, 16 zero bytes
OFF_SCALES: Final = 128          # n bf16 scales
HEADER_SIZE: Final = OFF_SCALES
#: The packed body starts at the first multiple of BODY_ALIGN at or after the scales.
BODY_ALIGN: Final = 64

# --- codebook fitting (section 1) ----------------------------------------------------------------------
CentroidRule = Literal["round", "trunc"]
CENTROID_RULES: Final[tuple[str, ...]] = ("round", "trunc")
#: Centroid rule used when the caller does not choose one. "round" is what the paper describes; the
#: authors' code truncates. Truncation reconstructs the real SmolLM2 weights slightly but consistently
#: better (docs/quality.md: +0.006 dB per matrix, same sign for three seeds), so it is the default, in
#: llama-quantize's C fitter too (ggml_s3d8_fit_default_params).
DEFAULT_CENTROID_RULE: CentroidRule = "trunc"
#: Fitting uses a seeded random subsample of this many 3-vectors when the matrix has more.
FIT_SUBSAMPLE_VECTORS: Final = 1 << 20
#: Lloyd stops once at most this fraction of the (training) assignments changed in an iteration.
FIT_CHANGE_THRESHOLD: Final = 1e-3
#: Safety cap on Lloyd iterations (the threshold is normally met long before).
FIT_MAX_ITERATIONS: Final = 300

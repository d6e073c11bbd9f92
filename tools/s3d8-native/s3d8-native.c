// libs3d8-native: the converter's way into the patched ggml's own quantisers (gguf_s3d8/native.py loads it with
// ctypes). One call encodes one matrix exactly as llama-quantize does: ggml_quantize_chunk, with its checks turned
// into an error message instead of an abort, and the number of OpenMP threads of this call chosen by the caller
// (the converter runs several calls at once, one per tensor).
#include "ggml.h"
#include "ggml-s3d8.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef _OPENMP
#include <omp.h>
#endif

// bumped whenever a signature or a meaning below changes; gguf_s3d8/native.py refuses any other value
#define S3D8_NATIVE_ABI 1

#define S3D8_NATIVE_API __attribute__((visibility("default")))

S3D8_NATIVE_API int s3d8_native_abi(void);
S3D8_NATIVE_API int s3d8_native_type_s3d8(void);
S3D8_NATIVE_API const char * s3d8_native_type_name(int type);
S3D8_NATIVE_API size_t s3d8_native_row_size(int type, int64_t k);
S3D8_NATIVE_API int s3d8_native_openmp(void);
S3D8_NATIVE_API int s3d8_native_quantize(int type, const float * src, void * dst, int64_t n, int64_t k,
        const float * imatrix, int centroid_rule, uint64_t seed, int n_threads, char * err, size_t err_size);

int s3d8_native_abi(void) {
    return S3D8_NATIVE_ABI;
}

// GGML_TYPE_S3D8 of the tree this library was built from (the converter checks it against gguf-py's)
int s3d8_native_type_s3d8(void) {
    return (int) GGML_TYPE_S3D8;
}

const char * s3d8_native_type_name(int type) {
    return type >= 0 && type < GGML_TYPE_COUNT ? ggml_type_name((enum ggml_type) type) : NULL;
}

size_t s3d8_native_row_size(int type, int64_t k) {
    return type >= 0 && type < GGML_TYPE_COUNT ? ggml_row_size((enum ggml_type) type, k) : 0;
}

// whether the calls below run on OpenMP threads (n_threads > 1 has an effect)
int s3d8_native_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static int fail(char * err, size_t err_size, const char * fmt, ...) {
    if (err && err_size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_size, fmt, ap);
        va_end(ap);
    }
    return 1;
}

// Quantises the n x k float matrix src (row-major, n rows of k) as `type` into dst
// (s3d8_native_row_size(type, k) * n bytes). Returns 0, or 1 with the reason in err.
//  - GGML_TYPE_S3D8: one slice, the iw1 encoder; imatrix = the k importances or NULL (the column-maximum weights).
//    centroid_rule < 0 and seed == 0: ggml_quantize_chunk, llama-quantize's very call; otherwise
//    ggml_s3d8_quantize_iw with that centroid rule (enum ggml_s3d8_centroid_rule; < 0: the default) and k-means seed.
//  - a row type (Q8_0, BF16, ...): ggml_quantize_chunk over the n rows (imatrix as ggml takes it, may be NULL).
// n_threads: OpenMP threads of this call (the S3D8 encoder's parallel loops; the bytes do not depend on it).
int s3d8_native_quantize(int type, const float * src, void * dst, int64_t n, int64_t k,
        const float * imatrix, int centroid_rule, uint64_t seed, int n_threads, char * err, size_t err_size) {
    if (err && err_size) {
        err[0] = '\0';
    }
    if (type < 0 || type >= GGML_TYPE_COUNT || ggml_get_type_traits((enum ggml_type) type)->blck_size == 0) {
        return fail(err, err_size, "unknown ggml type %d", type);
    }
    const enum ggml_type t = (enum ggml_type) type;
    if (!src || !dst || n <= 0 || k <= 0) {
        return fail(err, err_size, "empty matrix (%" PRId64 " x %" PRId64 ")", n, k);
    }
    if (!ggml_slice_is_eligible(t, k, n)) {
        return fail(err, err_size, "a %" PRId64 " x %" PRId64 " matrix (n x k) cannot be stored as %s", n, k, ggml_type_name(t));
    }
    if (ggml_quantize_requires_imatrix(t) && !imatrix) {
        return fail(err, err_size, "%s needs an importance matrix", ggml_type_name(t));
    }
    if (imatrix && !ggml_slice_check_imatrix(t, imatrix, k, err, err_size)) {
        return 1;
    }
#ifdef _OPENMP
    omp_set_num_threads(n_threads > 0 ? n_threads : 1); // this thread's setting: its own parallel regions only
#else
    (void) n_threads;
#endif
    if (t == GGML_TYPE_S3D8) {
        if (!ggml_s3d8_check_weights(src, n, k, err, err_size)) {
            return 1;
        }
        if (centroid_rule >= 0 || seed != 0) {
            struct ggml_s3d8_fit_params params = ggml_s3d8_fit_default_params();
            if (centroid_rule > (int) GGML_S3D8_CENTROID_TRUNC) {
                return fail(err, err_size, "unknown centroid rule %d", centroid_rule);
            }
            if (centroid_rule >= 0) {
                params.rule = (enum ggml_s3d8_centroid_rule) centroid_rule;
            }
            params.seed = seed;
            ggml_s3d8_quantize_iw(src, n, k, imatrix, &params, dst);
            return 0;
        }
    }
    const size_t want = ggml_row_size(t, k) * (size_t) n;
    const size_t got  = ggml_quantize_chunk(t, src, dst, 0, n, k, imatrix);
    if (got != want) {
        return fail(err, err_size, "ggml_quantize_chunk wrote %zu bytes, expected %zu", got, want);
    }
    return 0;
}

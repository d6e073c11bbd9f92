// Fuzz target: the S3D8 container validator (ggml_validate_row_data / ggml_s3d8_validate) on arbitrary bytes,
// and the decoder on every container it accepts. Seeds: the golden vectors of tests/data/s3d8_golden.
#include "fuzz-common.h"

#include "ggml.h"
#include "ggml-s3d8.h"

#include <vector>

extern "C" int LLVMFuzzerInitialize(int * /*argc*/, char *** /*argv*/) {
    ggml_log_set(fuzz::log_callback, nullptr);
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    // the row-data entry point sees whole type_size multiples only (anything else is rejected before it)
    const size_t whole = size - size % ggml_type_size(GGML_TYPE_S3D8);
    const bool   valid = ggml_validate_row_data(GGML_TYPE_S3D8, data, whole);

    char err[256];
    if (!ggml_s3d8_validate(data, size, err, sizeof(err))) {
        fuzz::record_message(err);
        fuzz::reject();
        return 0;
    }
    fuzz::accept();
    // accepted: every slice must parse and decode (and ggml_validate_row_data must agree)
    if (!valid && whole == size) {
        fprintf(stderr, "ggml_s3d8_validate accepts what ggml_validate_row_data rejects\n");
        abort();
    }
    ggml_s3d8_view v;
    if (!ggml_s3d8_parse(data, size, true, &v, err, sizeof(err))) {
        fprintf(stderr, "a validated container does not parse: %s\n", err);
        abort();
    }
    const size_t slice = ggml_s3d8_slice_size(v.k, v.n);
    std::vector<float> out((size_t) v.k * (size_t) v.n);
    for (size_t ofs = 0; ofs + slice <= size; ofs += slice) {
        ggml_s3d8_view vs;
        if (!ggml_s3d8_parse(data + ofs, slice, true, &vs, err, sizeof(err)) || vs.k != v.k || vs.n != v.n) {
            fprintf(stderr, "slice %zu of a validated tensor does not parse\n", ofs/slice);
            abort();
        }
        ggml_s3d8_dequantize_rows(&vs, 0, vs.n, out.data());
    }
    return 0;
}

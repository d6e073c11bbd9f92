// S3D8 golden vectors (tests/data/s3d8_golden, written by the numpy codec: python -m gguf_s3d8.golden)
// against the C implementation, comparing bytes:
//  - ggml_validate_row_data accepts every container; quantizing the weights with the case's codebook
//    (ggml_s3d8_encode) reproduces the container byte for byte; non-finite weights are rejected
//    (ggml_s3d8_check_weights); ggml's dequantization agrees with an independent bit-level decoder
//  - activation quantization: int8 values and bf16 scales equal the golden xq / xs
//  - every kernel variant compiled into this build (gemv for one token, gemm for m tokens) gives
//    the golden outputs bit for bit
//  - MUL_MAT on the CPU backend (1, 2 and 3 threads) gives the golden outputs bit for bit
//
// usage: test-s3d8-golden <golden dir>
#include "s3d8-test-common.h"

#include "ggml-s3d8.h"
#include "s3d8.h"

#include <map>
#include <sstream>

using namespace s3d8t;

struct golden_case {
    std::string name;
    int64_t n = 0, k = 0, m = 0;
    std::string file_w, file_codebook, file_container, file_x, file_y, file_xq, file_xs;
};

static std::vector<golden_case> read_manifest(const std::string & dir) {
    std::vector<golden_case> cases;
    FILE * f = fopen((dir + "/manifest.txt").c_str(), "r");
    if (!f) {
        fprintf(stderr, "cannot open %s/manifest.txt\n", dir.c_str());
        exit(1);
    }
    char line[4096];
    while (fgets(line, sizeof(line), f)) {
        if (line[0] == '#' || line[0] == '\n') {
            continue;
        }
        std::istringstream is(line);
        golden_case c;
        is >> c.name >> c.n >> c.k >> c.m >> c.file_w >> c.file_codebook >> c.file_container >> c.file_x >> c.file_y >> c.file_xq >> c.file_xs;
        if (!is) {
            fprintf(stderr, "bad manifest line: %s", line);
            exit(1);
        }
        cases.push_back(c);
    }
    fclose(f);
    return cases;
}

static std::vector<float> as_f32(const std::vector<uint8_t> & b) {
    std::vector<float> v(b.size() / 4);
    memcpy(v.data(), b.data(), v.size() * 4);
    return v;
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s <golden dir>\n", argv[0]);
        return 2;
    }
    const std::string dir = argv[1];
    const auto cases = read_manifest(dir);

    int n_kernels = 0;
    const ggml_s3d8_kernels * kernels = ggml_s3d8_get_kernels(&n_kernels);
    printf("kernel variants:");
    for (int i = 0; i < n_kernels; ++i) {
        printf(" %s", kernels[i].name);
    }
    printf("\n");

    std::map<std::string, bool> encoded; // container files already checked against the encoder
    bool acts_checked = false;
    int n_ok_cases = 0;

    for (const auto & c : cases) {
        const int fail0 = g_failures;
        const auto codebook = read_file(dir + "/" + c.file_codebook);
        S3D8T_CHECK(codebook.size() == 96, "%s: codebook size %zu", c.name.c_str(), codebook.size());

        if (c.file_container == "-") {
            // non-finite weights: the quantized data must not validate
            const auto w = as_f32(read_file(dir + "/" + c.file_w));
            S3D8T_CHECK((int64_t) w.size() == c.n * c.k, "%s: weight size", c.name.c_str());
            char err[256] = "";
            S3D8T_CHECK(!ggml_s3d8_check_weights(w.data(), c.n, c.k, err, sizeof(err)) && strstr(err, "non-finite"),
                    "%s: non-finite weights not rejected (%s)", c.name.c_str(), err);
            if (g_failures == fail0) {
                n_ok_cases++;
            }
            continue;
        }

        const auto container = read_file(dir + "/" + c.file_container);
        S3D8T_CHECK(container.size() == slice_size(c.k, c.n), "%s: container size %zu", c.name.c_str(), container.size());
        S3D8T_CHECK(ggml_validate_row_data(GGML_TYPE_S3D8, container.data(), container.size()), "%s: container does not validate", c.name.c_str());

        ggml_s3d8_view v;
        char err[256];
        if (!ggml_s3d8_parse(container.data(), container.size(), true, &v, err, sizeof(err))) {
            S3D8T_CHECK(false, "%s: %s", c.name.c_str(), err);
            continue;
        }
        S3D8T_CHECK(v.k == c.k && v.n == c.n, "%s: header shape", c.name.c_str());

        // quantizer: W (or the dequantized container) with the case's codebook -> the same bytes
        if (!encoded[c.file_container]) {
            encoded[c.file_container] = true;
            std::vector<float> w;
            if (c.file_w == "-") {
                w.resize((size_t) c.n * c.k);
                ggml_s3d8_dequantize_rows(&v, 0, c.n, w.data());
            } else {
                w = as_f32(read_file(dir + "/" + c.file_w));
            }
            S3D8T_CHECK(ggml_s3d8_check_weights(w.data(), c.n, c.k, err, sizeof(err)), "%s: weights rejected: %s", c.name.c_str(), err);
            std::vector<uint8_t> out(container.size(), 0xAA);
            ggml_s3d8_encode(w.data(), c.n, c.k, codebook.data(), out.data());
            size_t first_diff = out.size();
            for (size_t i = 0; i < out.size(); ++i) {
                if (out[i] != container[i]) {
                    first_diff = i;
                    break;
                }
            }
            S3D8T_CHECK(first_diff == out.size(), "%s: encoder output differs from %s at byte %zu (got %02x, want %02x)",
                    c.name.c_str(), c.file_container.c_str(), first_diff, out[first_diff], container[first_diff]);

            // the independent decoder agrees with ggml's dequantization
            const decoded d = decode(container.data(), c.k, c.n);
            std::vector<float> deq((size_t) c.n * c.k);
            ggml_s3d8_dequantize_rows(&v, 0, c.n, deq.data());
            int64_t bad = 0;
            for (size_t i = 0; i < deq.size(); ++i) {
                const float want = d.alpha[i / c.k] * (float) d.w[i];
                bad += f32_bits(deq[i]) != f32_bits(want);
            }
            S3D8T_CHECK(bad == 0, "%s: %lld dequantized values differ", c.name.c_str(), (long long) bad);
        }

        const auto x  = as_f32(read_file(dir + "/" + c.file_x));
        const auto xq = read_file(dir + "/" + c.file_xq);
        const auto xs = read_file(dir + "/" + c.file_xs);
        const auto y  = as_f32(read_file(dir + "/" + c.file_y));
        const int64_t rows = (int64_t) x.size() / c.k;
        S3D8T_CHECK(rows >= c.m && (int64_t) xq.size() == rows * c.k && (int64_t) xs.size() == 2 * rows &&
                    (int64_t) y.size() >= c.m * c.n, "%s: activation/output file sizes", c.name.c_str());

        // activation quantization
        std::vector<int8_t>  q((size_t) c.m * c.k);
        std::vector<float>   s(c.m);
        std::vector<int32_t> qsum(c.m);
        for (int64_t t = 0; t < c.m; ++t) {
            ggml_s3d8_quantize_act(x.data() + t * c.k, c.k, q.data() + t * c.k, &s[t], &qsum[t]);
        }
        if (!acts_checked) {
            acts_checked = true;
            std::vector<int8_t> qa((size_t) rows * c.k);
            for (int64_t t = 0; t < rows; ++t) {
                float st;
                int32_t sum;
                ggml_s3d8_quantize_act(x.data() + t * c.k, c.k, qa.data() + t * c.k, &st, &sum);
                const uint16_t want_s = (uint16_t) (xs[2 * t] | (xs[2 * t + 1] << 8));
                S3D8T_CHECK(f32_bits(st) == ((uint32_t) want_s << 16), "row %lld: activation scale 0x%08x, want bf16 0x%04x",
                        (long long) t, f32_bits(st), want_s);
                int32_t want_sum = 0;
                for (int64_t j = 0; j < c.k; ++j) {
                    want_sum += (int8_t) xq[t * c.k + j];
                }
                S3D8T_CHECK(sum == want_sum, "row %lld: activation sum", (long long) t);
            }
            S3D8T_CHECK(memcmp(qa.data(), xq.data(), qa.size()) == 0, "quantized activations differ from %s", c.file_xq.c_str());
        }

        // every kernel variant, through its own entry points
        ggml_s3d8_tables tab;
        ggml_s3d8_tables_init(&tab, v.codebook);
        const int64_t np_total = (c.n + 2) / 3;
        std::vector<uint8_t> wtmp_raw(GGML_S3D8_WTMP_SIZE(c.k) + 64);
        void * wtmp = (void *) (((uintptr_t) wtmp_raw.data() + 63) & ~(uintptr_t) 63);
        for (int kv = 0; kv < n_kernels; ++kv) {
            const auto & kern = kernels[kv];
            for (int use_gemm = 0; use_gemm < 2; ++use_gemm) {
                std::vector<float>   out((size_t) c.m * c.n);
                std::vector<int32_t> acc((size_t) c.m * 3 * GGML_S3D8_GEMM_NP);
                for (int64_t p0 = 0; p0 < np_total; p0 += GGML_S3D8_GEMM_NP) {
                    const int64_t np = std::min<int64_t>(GGML_S3D8_GEMM_NP, np_total - p0);
                    const uint8_t * qb = v.body + p0 * c.k;
                    if (use_gemm) {
                        kern.gemm(c.k, np, qb, q.data(), qsum.data(), c.m, acc.data(), wtmp, &tab);
                    } else {
                        for (int64_t t = 0; t < c.m; ++t) {
                            kern.gemv(c.k, np, qb, q.data() + t * c.k, qsum[t], acc.data() + t * 3 * np, &tab);
                        }
                    }
                    for (int64_t t = 0; t < c.m; ++t) {
                        for (int64_t r = 0; r < 3 * np && 3 * p0 + r < c.n; ++r) {
                            const int64_t i = 3 * p0 + r;
                            out[(size_t) t * c.n + i] = ((float) acc[t * 3 * np + r] * s[t]) * bf16_f32(v.alpha[i]);
                        }
                    }
                }
                const std::string what = c.name + " " + kern.name + (use_gemm ? " gemm" : " gemv");
                const int64_t bad = compare_bits(out.data(), y.data(), c.m * c.n, what);
                S3D8T_CHECK(bad == 0, "%s: %lld outputs differ", what.c_str(), (long long) bad);
            }
        }

        // MUL_MAT on the CPU backend
        for (int n_threads : { 1, 2, 3 }) {
            cpu_op op;
            ggml_tensor * a = ggml_new_tensor_2d(op.ctx, GGML_TYPE_S3D8, c.k, c.n);
            ggml_tensor * b = ggml_new_tensor_2d(op.ctx, GGML_TYPE_F32, c.k, c.m);
            ggml_tensor * out = ggml_mul_mat(op.ctx, a, b);
            op.alloc();
            ggml_backend_tensor_set(a, container.data(), 0, container.size());
            ggml_backend_tensor_set(b, x.data(), 0, (size_t) c.m * c.k * sizeof(float));
            S3D8T_CHECK(op.supports(out), "%s: MUL_MAT not supported", c.name.c_str());
            S3D8T_CHECK(op.compute(out, n_threads), "%s: compute failed", c.name.c_str());
            std::vector<float> got((size_t) c.m * c.n);
            ggml_backend_tensor_get(out, got.data(), 0, got.size() * sizeof(float));
            const int64_t bad = compare_bits(got.data(), y.data(), c.m * c.n, c.name + " MUL_MAT");
            S3D8T_CHECK(bad == 0, "%s: MUL_MAT with %d threads: %lld outputs differ", c.name.c_str(), n_threads, (long long) bad);
        }

        if (g_failures == fail0) {
            n_ok_cases++;
        }
    }

    printf("%d/%zu golden cases passed\n", n_ok_cases, cases.size());
    return g_failures == 0 && !cases.empty() ? 0 : 1;
}

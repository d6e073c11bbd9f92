// Shared helpers of the S3D8 C tests: an independent reading of the format (docs/s3d8-format.md)
// used as the integer reference, and running single ops on the CPU backend.
#pragma once

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace s3d8t {

static int g_failures = 0;

#define S3D8T_CHECK(cond, ...)                                   \
    do {                                                         \
        if (!(cond)) {                                           \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                        \
            fprintf(stderr, "\n");                               \
            s3d8t::g_failures++;                                 \
        }                                                        \
    } while (0)

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float    bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// fp32 -> bf16, round to nearest even (format section 1)
static inline uint16_t bf16_rne(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t) ((u >> 16) | 0x40);
    }
    return (uint16_t) ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static inline float bf16_f32(uint16_t b) { return bits_f32((uint32_t) b << 16); }

static inline size_t slice_size(int64_t k, int64_t n) { return (size_t) n * (43 * (size_t) (k / 128)); }
static inline size_t body_offset(int64_t n) { return (128 + 2 * (size_t) n + 63) / 64 * 64; }

static inline bool eligible(int64_t k, int64_t n) {
    return k > 0 && n > 0 && k % 128 == 0 && body_offset(n) + (size_t) ((n + 2) / 3) * k <= slice_size(k, n);
}

// integer weights and scales of one container, decoded bit by bit (no tables)
struct decoded {
    int64_t k = 0, n = 0;
    std::vector<int8_t> w;     // n x k
    std::vector<float>  alpha; // n
};

static decoded decode(const uint8_t * c, int64_t k, int64_t n) {
    decoded d;
    d.k = k;
    d.n = n;
    d.w.resize((size_t) n * k);
    d.alpha.resize(n);
    const uint8_t * cb = c + 16;
    for (int64_t i = 0; i < n; ++i) {
        d.alpha[i] = bf16_f32((uint16_t) (c[128 + 2 * i] | (c[128 + 2 * i + 1] << 8)));
    }
    const uint8_t * body = c + body_offset(n);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t p = i / 3, dd = i % 3;
        for (int64_t j = 0; j < k; ++j) {
            const uint8_t b = body[p * k + j];
            const int q = (b >> 1) & 31;
            const int s0 = b & 1, s1 = (b >> 6) & 1, s2 = ((b >> 7) ^ b) & 1;
            const int s = dd == 0 ? s0 : dd == 1 ? s1 : s2;
            const int v = cb[3 * q + dd];
            d.w[(size_t) i * k + j] = (int8_t) (s ? -v : v);
        }
    }
    return d;
}

// activation quantization of one row (format section 3)
static void quantize_act(const float * x, int64_t k, int8_t * xq, float * s) {
    float amax = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
        amax = std::fmax(amax, std::fabs(x[j]));
    }
    const float sc  = bf16_f32(bf16_rne(amax / 127.0f));
    const float inv = sc == 0.0f ? 0.0f : 1.0f / sc;
    for (int64_t j = 0; j < k; ++j) {
        float v = std::nearbyint(x[j] * inv);
        if (std::isnan(v)) {
            v = 0.0f;
        }
        v = std::fmin(127.0f, std::fmax(-127.0f, v));
        xq[j] = (int8_t) v;
    }
    *s = sc;
}

// y (m x n) = integer reference matmul of m activation rows (m x k) with a decoded container
static std::vector<float> ref_matmul(const decoded & d, const float * x, int64_t m) {
    std::vector<float>  y((size_t) m * d.n);
    std::vector<int8_t> xq(d.k);
    for (int64_t t = 0; t < m; ++t) {
        float s;
        quantize_act(x + t * d.k, d.k, xq.data(), &s);
        for (int64_t i = 0; i < d.n; ++i) {
            const int8_t * w = d.w.data() + (size_t) i * d.k;
            int64_t acc = 0;
            for (int64_t j = 0; j < d.k; ++j) {
                acc += (int32_t) xq[j] * w[j];
            }
            if (acc < INT32_MIN || acc > INT32_MAX) {
                fprintf(stderr, "reference accumulator overflow\n");
                abort();
            }
            y[(size_t) t * d.n + i] = ((float) (int32_t) acc * s) * d.alpha[i];
        }
    }
    return y;
}

// number of float mismatches by bit pattern; prints the first few
static int64_t compare_bits(const float * got, const float * want, int64_t count, const std::string & what) {
    int64_t bad = 0;
    for (int64_t i = 0; i < count; ++i) {
        if (f32_bits(got[i]) != f32_bits(want[i])) {
            if (bad < 5) {
                fprintf(stderr, "  %s: element %lld: got %.9g (0x%08x), want %.9g (0x%08x)\n", what.c_str(), (long long) i,
                        got[i], f32_bits(got[i]), want[i], f32_bits(want[i]));
            }
            bad++;
        }
    }
    return bad;
}

static std::vector<uint8_t> read_file(const std::string & path) {
    std::vector<uint8_t> data;
    FILE * f = fopen(path.c_str(), "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path.c_str());
        exit(1);
    }
    uint8_t buf[65536];
    size_t r;
    while ((r = fread(buf, 1, sizeof(buf), f)) > 0) {
        data.insert(data.end(), buf, buf + r);
    }
    fclose(f);
    return data;
}

// count values drawn from N(0, 1)
static std::vector<float> random_normal(std::mt19937 & rng, size_t count) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> v(count);
    for (auto & x : v) {
        x = nd(rng);
    }
    return v;
}

// random weights with a few special rows (zeros, one outlier, negative zeros)
static std::vector<float> random_weights(std::mt19937 & rng, int64_t n, int64_t k) {
    std::vector<float> w = random_normal(rng, (size_t) n * k);
    if (n > 3) {
        std::fill(w.begin() + 1 * k, w.begin() + 2 * k, 0.0f);
        std::fill(w.begin() + 2 * k, w.begin() + 3 * k, -0.0f);
        w[3 * k + 5] = 40.0f;
    }
    return w;
}

static std::vector<float> random_acts(std::mt19937 & rng, int64_t m, int64_t k) {
    std::vector<float> x = random_normal(rng, (size_t) m * k);
    if (m > 1) {
        std::fill(x.begin() + k, x.begin() + 2 * k, 0.0f); // an all-zero token (s = 0)
    }
    return x;
}

// a CPU backend and the tensors of one op; build() creates the op from the leaf tensors
struct cpu_op {
    ggml_backend_t        backend = nullptr;
    ggml_context        * ctx     = nullptr;
    ggml_backend_buffer_t buf     = nullptr;

    explicit cpu_op(size_t n_tensors = 16) {
        backend = ggml_backend_cpu_init();
        ggml_init_params ip = { ggml_tensor_overhead() * n_tensors + ggml_graph_overhead(), nullptr, true };
        ctx = ggml_init(ip);
    }
    ~cpu_op() {
        if (buf) ggml_backend_buffer_free(buf);
        ggml_free(ctx);
        ggml_backend_free(backend);
    }
    void alloc() { buf = ggml_backend_alloc_ctx_tensors(ctx, backend); }
    bool compute(ggml_tensor * out, int n_threads) {
        ggml_backend_cpu_set_n_threads(backend, n_threads);
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, out);
        return ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS;
    }
    bool supports(const ggml_tensor * op) { return ggml_backend_supports_op(backend, op); }
    // the values of a computed F32 tensor
    std::vector<float> values(const ggml_tensor * out) {
        std::vector<float> y(ggml_nelements(out));
        ggml_backend_tensor_get(out, y.data(), 0, y.size() * sizeof(float));
        return y;
    }
    // out computed with n_threads, its values; an unsupported op or a failed computation is a failure
    std::vector<float> run(ggml_tensor * out, int n_threads, const char * what) {
        S3D8T_CHECK(supports(out), "%s not supported", what);
        S3D8T_CHECK(compute(out, n_threads), "compute failed");
        return values(out);
    }
};

} // namespace s3d8t

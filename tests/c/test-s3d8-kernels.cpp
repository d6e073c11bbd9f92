// S3D8 kernels: every variant compiled into this build (ggml_s3d8_get_kernels: NEON dotprod / i8mm,
// AVX2, AVX512-VBMI+VNNI, ... and the scalar generic one) against an independent reference (the
// weights decoded bit by bit from format section 2, no tables, then a plain int32 dot product),
// comparing the exact int32 accumulators bit for bit, on random bytes (all 256 byte values), random codebooks, random and
// extreme activations, every triple count 1..16, token counts around the kernels' tile sizes, and
// the longest supported k with the largest possible sums. Also the activation quantizer against an
// independent implementation, including round-half-to-even ties, zeros and non-finite values.
//
// usage: test-s3d8-kernels
#include "s3d8-test-common.h"

#include "ggml-s3d8.h"
#include "s3d8.h"

using namespace s3d8t;

struct aligned_buf {
    std::vector<uint8_t> raw;
    uint8_t * p = nullptr;
    explicit aligned_buf(size_t n) : raw(n + 64) { p = (uint8_t *) (((uintptr_t) raw.data() + 63) & ~(uintptr_t) 63); }
};

static void random_codebook(std::mt19937 & rng, uint8_t * cb, int mode) {
    for (int i = 0; i < 96; ++i) {
        cb[i] = mode == 1 ? 127 : (uint8_t) (rng() % 128);
    }
}

// acc[t*3*np + 3*p + d] = sum_j x[t*k + j] * w(3*p + d, j), the weights decoded bit by bit (format section 2:
// codebook index = bits 1..5, signs S0 = bit 0, S1 = bit 6, S2 = bit 7 xor bit 0), independently of the kernels' tables
static std::vector<int32_t> reference_acc(const uint8_t * cb, const uint8_t * q, const int8_t * x, int64_t k,
        int64_t np, int64_t nt) {
    std::vector<int32_t> acc((size_t) nt * 3 * np);
    std::vector<int8_t> w((size_t) 3 * k);
    for (int64_t p = 0; p < np; ++p) {
        for (int64_t j = 0; j < k; ++j) {
            const uint8_t b = q[p * k + j];
            const int idx = (b >> 1) & 31;
            const int sign[3] = { b & 1, (b >> 6) & 1, ((b >> 7) ^ b) & 1 };
            for (int d = 0; d < 3; ++d) {
                const int v = cb[3 * idx + d];
                w[(size_t) d * k + j] = (int8_t) (sign[d] ? -v : v);
            }
        }
        for (int64_t t = 0; t < nt; ++t) {
            for (int d = 0; d < 3; ++d) {
                int32_t s = 0;
                for (int64_t j = 0; j < k; ++j) {
                    s += (int32_t) x[t * k + j] * w[(size_t) d * k + j];
                }
                acc[(size_t) t * 3 * np + 3 * p + d] = s;
            }
        }
    }
    return acc;
}

// compares one kernel variant with the independent reference on one configuration
static void check_case(const ggml_s3d8_kernels & kern, std::mt19937 & rng,
        int64_t k, int64_t np, int64_t nt, int xmode, int cbmode, int64_t & n_cases) {
    uint8_t cb[96];
    random_codebook(rng, cb, cbmode);
    ggml_s3d8_tables tab;
    ggml_s3d8_tables_init(&tab, cb);

    // slack after the bytes and activations: kernels must not depend on it
    std::vector<uint8_t> q((size_t) np * k + 64);
    for (auto & b : q) {
        b = (uint8_t) rng();
    }
    if (cbmode == 1) {
        // all weights +127 or all -127 (signs all set: S0 = 1, S1 = 1, S0 ^ S2 = 0)
        const uint8_t b = (rng() & 1) ? 0x41 | (31 << 1) : (31 << 1);
        std::fill(q.begin(), q.end(), b);
    }
    std::vector<int8_t>  x((size_t) nt * k + 64);
    std::vector<int32_t> xsum(nt);
    for (int64_t t = 0; t < nt; ++t) {
        int32_t s = 0;
        for (int64_t j = 0; j < k; ++j) {
            int v;
            switch (xmode) {
                case 0:  v = (int) (rng() % 255) - 127; break;     // uniform
                case 1:  v = (rng() & 1) ? 127 : -127; break;        // extremes
                case 2:  v = 127; break;                             // constant extreme
                default: v = (int) (rng() % 7) - 3; break;           // small
            }
            x[t * k + j] = (int8_t) v;
            s += v;
        }
        xsum[t] = s;
    }

    aligned_buf wtmp(GGML_S3D8_WTMP_SIZE(k));
    const std::vector<int32_t> want = reference_acc(cb, q.data(), x.data(), k, np, nt);

    // gemv: one token at a time
    for (int64_t t = 0; t < std::min<int64_t>(nt, 3); ++t) {
        std::vector<int32_t> a(3 * np + 16, 0x5a5a5a5a);
        const int32_t * r = want.data() + t * 3 * np;
        kern.gemv(k, np, q.data(), x.data() + t * k, xsum[t], a.data(), &tab);
        int64_t bad = 0;
        for (int64_t i = 0; i < 3 * np; ++i) {
            bad += a[i] != r[i];
        }
        S3D8T_CHECK(bad == 0, "%s gemv k=%lld np=%lld xmode=%d cb=%d: %lld of %lld accumulators differ (first got %d want %d)",
                kern.name, (long long) k, (long long) np, xmode, cbmode, (long long) bad, (long long) (3 * np), a[0], r[0]);
        for (int64_t i = 3 * np; i < 3 * np + 16; ++i) {
            S3D8T_CHECK(a[i] == 0x5a5a5a5a, "%s gemv wrote past the accumulators", kern.name);
        }
    }

    // gemm: all tokens
    {
        std::vector<int32_t> a(nt * 3 * np + 16, 0x5a5a5a5a);
        const int32_t * r = want.data();
        kern.gemm(k, np, q.data(), x.data(), xsum.data(), nt, a.data(), wtmp.p, &tab);
        int64_t bad = 0;
        for (int64_t i = 0; i < nt * 3 * np; ++i) {
            bad += a[i] != r[i];
        }
        S3D8T_CHECK(bad == 0, "%s gemm k=%lld np=%lld nt=%lld xmode=%d cb=%d: %lld of %lld accumulators differ",
                kern.name, (long long) k, (long long) np, (long long) nt, xmode, cbmode, (long long) bad, (long long) (nt * 3 * np));
        for (int64_t i = nt * 3 * np; i < nt * 3 * np + 16; ++i) {
            S3D8T_CHECK(a[i] == 0x5a5a5a5a, "%s gemm wrote past the accumulators", kern.name);
        }
    }
    n_cases++;
}

static void test_quantize_act(std::mt19937 & rng) {
    printf("activation quantization\n");
    const int64_t k = 1024;
    std::vector<float>  x(k);
    std::vector<int8_t> q(k), qr(k);
    std::uniform_real_distribution<float> ud(-3.0f, 3.0f);
    int64_t bad = 0;
    for (int it = 0; it < 400; ++it) {
        for (auto & v : x) {
            v = ud(rng);
        }
        if (it % 4 == 1) {
            // exact halves after scaling: with amax = 127 the scale is 1 and x*inv = x
            for (int64_t j = 0; j < k; ++j) {
                x[j] = (float) ((int) (rng() % 254) - 127) + ((rng() & 1) ? 0.5f : -0.5f);
            }
            x[0] = 127.0f;
        } else if (it % 4 == 2) {
            std::fill(x.begin(), x.end(), 0.0f);
            if (it % 8 == 2) {
                x[k / 2] = -1e-30f; // tiny absmax
            }
        } else if (it == 3) {
            x[1] = INFINITY;      // inf: scale inf, inv 0, inf * 0 = NaN -> 0
        } else if (it == 7) {
            x[2] = NAN;
        } else if (it == 11) {
            std::fill(x.begin(), x.end(), 0.0f);
            x[0] = 1e-37f;        // 1/s overflows to inf: 0 * inf = NaN -> 0, x[0] * inf -> 127
        } else if (it == 15) {
            x[k - 1] = -INFINITY; // the absmax is taken over bit patterns: |-inf| is +inf's
        } else if (it == 19) {
            x[5] = std::copysign(NAN, -1.0f); // a NaN with the sign bit set is skipped like a positive one
            x[k - 2] = NAN;
        }
        float s, sr;
        int32_t sum;
        ggml_s3d8_quantize_act(x.data(), k, q.data(), &s, &sum);
        quantize_act(x.data(), k, qr.data(), &sr);
        int32_t sr_sum = 0;
        for (int64_t j = 0; j < k; ++j) {
            sr_sum += qr[j];
        }
        const bool ok = memcmp(q.data(), qr.data(), k) == 0 && f32_bits(s) == f32_bits(sr) && sum == sr_sum;
        if (!ok && bad < 3) {
            fprintf(stderr, "  iteration %d: quantized activations differ\n", it);
        }
        bad += !ok;
    }
    S3D8T_CHECK(bad == 0, "activation quantization: %lld of 400 rows differ", (long long) bad);
}

int main() {
    setvbuf(stdout, nullptr, _IONBF, 0);
    std::mt19937 rng(42);

    test_quantize_act(rng);

    int n = 0;
    const ggml_s3d8_kernels * kernels = ggml_s3d8_get_kernels(&n);
    S3D8T_CHECK(strcmp(kernels[n - 1].name, "generic") == 0, "the last kernel variant is %s, not generic",
            kernels[n - 1].name);
    printf("kernel variants:");
    for (int i = 0; i < n; ++i) {
        printf(" %s", kernels[i].name);
    }
    printf("\n");

    for (int v = 0; v < n; ++v) {
        const auto & kern = kernels[v];
        int64_t n_cases = 0;
        const int fail0 = g_failures;
        // every triple count, a few lengths
        for (int64_t np = 1; np <= GGML_S3D8_GEMM_NP; ++np) {
            for (int64_t k : { 128, 256, 640, 2048 }) {
                check_case(kern, rng, k, np, 1 + rng() % 5, (int) (rng() % 4), 0, n_cases);
            }
        }
        // token counts around the tile sizes
        for (int64_t nt : { 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 16, 17, 24, 31, 32, 33, 63, 64, 65, 128, 129 }) {
            check_case(kern, rng, 384, 1 + rng() % GGML_S3D8_GEMM_NP, nt, (int) (rng() % 4), 0, n_cases);
            check_case(kern, rng, 1024, GGML_S3D8_GEMM_NP, nt, 0, 0, n_cases);
        }
        // the longest k: sums close to the int32 limits (all weights and activations +-127)
        for (int xmode : { 1, 2 }) {
            check_case(kern, rng, GGML_S3D8_MAX_K, 2, 3, xmode, 1, n_cases);
        }
        printf("%-10s %lld cases %s\n", kern.name, (long long) n_cases, g_failures == fail0 ? "OK" : "FAILED");
    }

    printf("%s (%d failures)\n", g_failures ? "FAILED" : "OK", g_failures);
    return g_failures ? 1 : 0;
}

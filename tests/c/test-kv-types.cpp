// KV-cache types Q4_HQQ, Q4_HQQ_128 and TQ3_0 (issue 13; ggml-kvq.h, ggml-cpu/kvq.h):
//  - vec_dot(quant(x), q8_0(y)) of every kernel variant compiled into this build (generic, AVX2,
//    AVX512 / NEON) equals the dot product of the dequantized operands, computed in double, within
//    the fp32 bound below; rows with outlier channels and a non-zero mean (K-like), every block
//    count from 1 to 9 and long rows; the type traits use the first variant
//  - vec_mad (y += v*x, flash attention's V accumulation) of every variant equals y + v*x computed in
//    double on the dequantized x, per value within the fp32 bound below; flash attention uses the
//    first variant
//  - the quantizers: the CPU backend's from_float writes the reference bytes, the output validates,
//    the HQQ zero point beats Q4_1's min/max zero on Gaussian data, TQ3_0's mean error is that of a
//    3-bit Lloyd-Max code, degenerate blocks (constant, zero) dequantize exactly
//  - flash attention (CPU graph, one-row path and several threads) with quantized K, V or both,
//    grouped-query heads and a mask equals attention computed in double on the dequantized K and V
//    and the Q8_0-rounded Q (the K path converts Q with from_float of Q8_0), within a stated bound
//  - ggml_validate_row_data rejects a non-finite scale
//
// usage: test-kv-types
//        test-kv-types --dump <type> <n_per_row> <in.f32> <out.bin> <out.f32>
//            quantizes the rows of in.f32 with ggml_quantize_chunk and writes the bytes and their
//            dequantization (used by tests/python/test_kv_types.py to compare with the numpy reference)
#include "s3d8-test-common.h"

#include "ggml-cpu.h"
#include "ggml-kvq.h"
#include "kvq.h"

#include <algorithm>
#include <cinttypes>

using namespace s3d8t;

static const ggml_type kv_types[] = { GGML_TYPE_Q4_HQQ, GGML_TYPE_Q4_HQQ_128, GGML_TYPE_TQ3_0 };

static std::vector<uint8_t> quant(ggml_type t, const std::vector<float> & x) {
    std::vector<uint8_t> q(ggml_row_size(t, (int64_t) x.size()));
    ggml_get_type_traits_cpu(t)->from_float(x.data(), q.data(), (int64_t) x.size());
    return q;
}

static std::vector<float> dequant(ggml_type t, const std::vector<uint8_t> & q, int64_t n) {
    std::vector<float> x(n);
    ggml_get_type_traits(t)->to_float(q.data(), x.data(), n);
    return x;
}

// a K-like row: Gaussian channels with log-normal scales, a few outlier channels (x20..x60) and a
// per-channel offset
static std::vector<float> kv_row(std::mt19937 & rng, int64_t n, const std::vector<float> & scale, const std::vector<float> & offset) {
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) {
        x[i] = scale[i]*g(rng) + offset[i];
    }
    return x;
}

static void channel_profile(std::mt19937 & rng, int64_t n, std::vector<float> & scale, std::vector<float> & offset) {
    std::normal_distribution<float> g(0.0f, 1.0f);
    scale.assign(n, 0.0f);
    offset.assign(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
        scale[i]  = expf(0.5f*g(rng));
        offset[i] = 0.3f*scale[i]*g(rng);
    }
    for (int o = 0; o < 3; ++o) {
        const int64_t c = (int64_t) (rng() % n);
        scale[c]  *= 20.0f + 20.0f*o;
        offset[c] *= 20.0f;
    }
}

// the row lengths of the kernel cases: 1 to 9 blocks of type t (odd block counts reach the AVX512
// tails) and a long row
static std::vector<int64_t> row_lengths(ggml_type t) {
    std::vector<int64_t> lengths;
    for (int64_t nb = 1; nb <= 9; ++nb) {
        lengths.push_back(nb*ggml_blck_size(t));
    }
    lengths.push_back(4096);
    return lengths;
}

// every variant, type, row length and 4 repetitions: one case each (the callback counts its checks), then
// a line per variant
template <typename F>
static void for_each_case(const ggml_kvq_kernels * kernels, int nv, const char * what, F && check) {
    for (int v = 0; v < nv; ++v) {
        const int fail0 = g_failures;
        int64_t n_cases = 0;
        for (ggml_type t : kv_types) {
            for (int64_t n : row_lengths(t)) {
                for (int rep = 0; rep < 4; ++rep) {
                    check(kernels[v], t, n, rep, n_cases);
                }
            }
        }
        printf("%-8s %" PRId64 " %s cases %s\n", kernels[v].name, n_cases, what, g_failures == fail0 ? "OK" : "FAILED");
    }
}

// |d*q| + |m| of value i of a row xq of type t, xd its dequantization (x = d*q + m; m = 0 for TQ3_0):
// the magnitudes the fp32 roundings of a kernel are relative to. The HQQ types read m from the block.
static double abs_terms(ggml_type t, const std::vector<uint8_t> & xq, const std::vector<float> & xd, int64_t i) {
    if (t == GGML_TYPE_TQ3_0) {
        return fabs((double) xd[i]);
    }
    ggml_fp16_t m16;
    memcpy(&m16, xq.data() + (i/ggml_blck_size(t))*ggml_type_size(t) + 2, 2);
    const double m = ggml_fp16_to_fp32(m16);
    return fabs((double) xd[i] - m) + fabs(m);
}

// a row's blocks of bsz bytes rotated by one: every block where its neighbour was (the negative controls)
static std::vector<uint8_t> rotate_blocks(const std::vector<uint8_t> & row, size_t bsz) {
    std::vector<uint8_t> out(row.size());
    memcpy(out.data(), row.data() + bsz, row.size() - bsz);
    memcpy(out.data() + row.size() - bsz, row.data(), bsz);
    return out;
}

// ---- vec_dot ------------------------------------------------------------------------------------

static ggml_vec_dot_t kernel_of(const ggml_kvq_kernels & k, ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q4_HQQ:     return k.q4_hqq;
        case GGML_TYPE_Q4_HQQ_128: return k.q4_hqq_128;
        case GGML_TYPE_TQ3_0:      return k.tq3_0;
        default:                   return nullptr;
    }
}

// One case: x (type t) against y (Q8_0). The kernels compute each 32-block's integer sums exactly
// (|sum| < 2^24, so also exact in fp32) and combine them with fp32 products of at most three factors
// (d, dy, sum: 2 roundings) and a sum of at most 2*nb32 such terms in some order (sequential, tree or
// fused multiply-add; 4 more terms per 128-block for Q4_HQQ_128's two-level sum). The standard bound
// for such a sum is gamma_k * A with k = 2*nb32 + 8, gamma_k = k*u/(1 - k*u), u = 2^-24, and
// A = sum_i (|d*q_i| + |m|)*|dy*y_i| the sum of the absolute values of all products (for TQ3_0,
// m = 0). A wrong block, lane or stride in a kernel gives errors of the order of A itself.
static void check_vec_dot(const ggml_kvq_kernels & kern, ggml_type t, const std::vector<float> & x, const std::vector<float> & y, int64_t & n_cases) {
    const int64_t n = (int64_t) x.size();
    const std::vector<uint8_t> xq = quant(t, x);
    std::vector<uint8_t> yq(ggml_row_size(GGML_TYPE_Q8_0, n));
    ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float(y.data(), yq.data(), n);
    const std::vector<float> xd = dequant(t, xq, n);
    const std::vector<float> yd = dequant(GGML_TYPE_Q8_0, yq, n);

    double ref = 0.0, a = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        ref += (double) xd[i]*(double) yd[i];
        a += abs_terms(t, xq, xd, i)*fabs((double) yd[i]);
    }
    const double u = ldexp(1.0, -24);
    const double k = 2.0*(double) (n/32) + 8.0;
    const double bound = k*u/(1.0 - k*u)*a;

    float got = NAN;
    kernel_of(kern, t)((int) n, &got, 0, xq.data(), 0, yq.data(), 0, 1);
    n_cases++;
    S3D8T_CHECK(fabs((double) got - ref) <= bound, "%s %s n=%" PRId64 ": vec_dot %.9g, dequantized dot %.9g, |diff| %.3g > bound %.3g",
                kern.name, ggml_type_name(t), n, got, ref, fabs((double) got - ref), bound);
    // negative control: the bound is tight enough to see the write-up's kind of bug, a K.Q dot product
    // that pairs a block of x with the wrong block of y. With y = x the true value is sum x_i^2 ~ A,
    // the misaligned one (y's blocks rotated by one) is a sum of products of unrelated values, so the
    // two differ by about A, orders of magnitude above the bound (no near tie).
    if (n/32 >= 2) {
        std::vector<uint8_t> xx(yq.size());
        ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float(xd.data(), xx.data(), n);
        const std::vector<uint8_t> xs = rotate_blocks(xx, sizeof(block_q8_0));
        float good = NAN, bad = NAN;
        kernel_of(kern, t)((int) n, &good, 0, xq.data(), 0, xx.data(), 0, 1);
        kernel_of(kern, t)((int) n, &bad,  0, xq.data(), 0, xs.data(), 0, 1);
        S3D8T_CHECK(fabs((double) bad - good) > 1e3*k*u*fabs((double) good), "%s %s n=%" PRId64 ": a misaligned y gives %.6g, aligned %.6g",
                    kern.name, ggml_type_name(t), n, bad, good);
    }
}

static void test_vec_dot(std::mt19937 & rng) {
    int nv = 0;
    const ggml_kvq_kernels * kernels = ggml_kvq_get_kernels(&nv);
    S3D8T_CHECK(strcmp(kernels[nv - 1].name, "generic") == 0, "the last kernel variant is %s, not generic", kernels[nv - 1].name);
    printf("kernel variants:");
    for (int v = 0; v < nv; ++v) {
        printf(" %s", kernels[v].name);
    }
    printf("\n");

    for_each_case(kernels, nv, "vec_dot", [&](const ggml_kvq_kernels & kern, ggml_type t, int64_t n, int, int64_t & n_cases) {
        std::vector<float> sc, off, scy, offy;
        channel_profile(rng, n, sc, off);
        channel_profile(rng, n, scy, offy);
        check_vec_dot(kern, t, kv_row(rng, n, sc, off), kv_row(rng, n, scy, offy), n_cases);
    });

    // the type traits use the best variant
    for (ggml_type t : kv_types) {
        const int64_t n = 512;
        std::vector<float> sc, off;
        channel_profile(rng, n, sc, off);
        const std::vector<float> x = kv_row(rng, n, sc, off), y = kv_row(rng, n, sc, off);
        const std::vector<uint8_t> xq = quant(t, x);
        std::vector<uint8_t> yq(ggml_row_size(GGML_TYPE_Q8_0, n));
        ggml_get_type_traits_cpu(GGML_TYPE_Q8_0)->from_float(y.data(), yq.data(), n);
        float s0 = 0.0f, s1 = 1.0f;
        S3D8T_CHECK(ggml_get_type_traits_cpu(t)->vec_dot_type == GGML_TYPE_Q8_0, "%s: vec_dot_type is not Q8_0", ggml_type_name(t));
        ggml_get_type_traits_cpu(t)->vec_dot((int) n, &s0, 0, xq.data(), 0, yq.data(), 0, 1);
        kernel_of(kernels[0], t)((int) n, &s1, 0, xq.data(), 0, yq.data(), 0, 1);
        S3D8T_CHECK(f32_bits(s0) == f32_bits(s1), "%s: the type traits' vec_dot is not the %s variant", ggml_type_name(t), kernels[0].name);
    }
}

// ---- vec_mad (flash attention's V accumulation) ---------------------------------------------------

static ggml_kvq_vec_mad_t mad_of(const ggml_kvq_kernels & k, ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q4_HQQ:     return k.mad_q4_hqq;
        case GGML_TYPE_Q4_HQQ_128: return k.mad_q4_hqq_128;
        case GGML_TYPE_TQ3_0:      return k.mad_tq3_0;
        default:                   return nullptr;
    }
}

// One case: y0 += v*x with x of type t. Per value a kernel rounds d*v and m*v (once per block), the
// product with the code and the sum with m*v (one rounding if fused), and the addition to y0; the
// code times d (fp16, an 11-bit significand, times an integer below 2^7) is exact, and the
// dequantized reference x' = fl(d*q + m) is one more rounding from d*q + m. Each output is thus
// within gamma_6*(|y0| + |v|*(|d*q| + |m|)) of y0 + v*x' computed in double (u = 2^-24, gamma_k =
// k*u/(1 - k*u); m = 0 for TQ3_0). A value taken from a wrong block, lane or nibble is off by about
// |v*x| itself.
static void check_vec_mad(const ggml_kvq_kernels & kern, ggml_type t, const std::vector<float> & x, const std::vector<float> & y0,
                          float v, int64_t & n_cases) {
    const int64_t n  = (int64_t) x.size();
    const int64_t qk = ggml_blck_size(t);
    const std::vector<uint8_t> xq = quant(t, x);
    const std::vector<float>   xd = dequant(t, xq, n);
    const double u = ldexp(1.0, -24);
    const double g6 = 6.0*u/(1.0 - 6.0*u);

    std::vector<double> ref(n), bound(n);
    for (int64_t i = 0; i < n; ++i) {
        ref[i]   = (double) y0[i] + (double) v*(double) xd[i];
        bound[i] = g6*(fabs((double) y0[i]) + fabs((double) v)*abs_terms(t, xq, xd, i));
    }

    std::vector<float> got = y0;
    mad_of(kern, t)((int) n, got.data(), xq.data(), v);
    n_cases++;
    int64_t worst = 0;
    double worst_ratio = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const double r = fabs((double) got[i] - ref[i])/std::max(bound[i], 1e-300);
        if (!(r <= worst_ratio)) {
            worst_ratio = r;
            worst = i;
        }
    }
    S3D8T_CHECK(worst_ratio <= 1.0, "%s %s n=%" PRId64 " v=%g: vec_mad[%" PRId64 "] %.9g, reference %.9g, |diff| %.3g > bound %.3g",
                kern.name, ggml_type_name(t), n, (double) v, worst, (double) got[worst], ref[worst], fabs((double) got[worst] - ref[worst]), bound[worst]);

    // negative control (for v = 1): x with its blocks rotated by one (the wrong block for every value)
    // is far outside the bound, by at least a thousand times it somewhere (|x| ~ 1 against a bound of
    // ~1e-6, no near tie)
    if (n/qk >= 2 && v == 1.0f) {
        const std::vector<uint8_t> xs = rotate_blocks(xq, ggml_type_size(t));
        std::vector<float> bad = y0;
        mad_of(kern, t)((int) n, bad.data(), xs.data(), v);
        double worst_bad = 0.0;
        for (int64_t i = 0; i < n; ++i) {
            worst_bad = std::max(worst_bad, fabs((double) bad[i] - ref[i])/std::max(bound[i], 1e-300));
        }
        S3D8T_CHECK(worst_bad > 1e3, "%s %s n=%" PRId64 ": vec_mad of misaligned blocks is within %.3g bounds", kern.name, ggml_type_name(t), n, worst_bad);
    }
}

static void test_vec_mad(std::mt19937 & rng) {
    int nv = 0;
    const ggml_kvq_kernels * kernels = ggml_kvq_get_kernels(&nv);
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::uniform_real_distribution<float> w(0.0f, 1.0f);
    for_each_case(kernels, nv, "vec_mad", [&](const ggml_kvq_kernels & kern, ggml_type t, int64_t n, int rep, int64_t & n_cases) {
        std::vector<float> sc, off;
        channel_profile(rng, n, sc, off);
        std::vector<float> y0(n);
        for (float & e : y0) {
            e = 4.0f*g(rng);
        }
        // softmax weights: 1 (a new maximum), a typical one, a tiny one and 0
        const float vs[4] = { 1.0f, w(rng), 1e-3f*w(rng), 0.0f };
        check_vec_mad(kern, t, kv_row(rng, n, sc, off), y0, vs[rep], n_cases);
    });

    // flash attention takes the best variant; other types have none
    for (ggml_type t : kv_types) {
        const int64_t n = 256;
        std::vector<float> sc, off;
        channel_profile(rng, n, sc, off);
        const std::vector<uint8_t> xq = quant(t, kv_row(rng, n, sc, off));
        std::vector<float> a(n, 0.5f), b(n, 0.5f);
        S3D8T_CHECK(ggml_kvq_get_vec_mad(t) != nullptr, "%s: no vec_mad", ggml_type_name(t));
        ggml_kvq_get_vec_mad(t)((int) n, a.data(), xq.data(), 0.75f);
        mad_of(kernels[0], t)((int) n, b.data(), xq.data(), 0.75f);
        S3D8T_CHECK(memcmp(a.data(), b.data(), n*sizeof(float)) == 0, "%s: ggml_kvq_get_vec_mad is not the %s variant", ggml_type_name(t), kernels[0].name);
    }
    S3D8T_CHECK(ggml_kvq_get_vec_mad(GGML_TYPE_Q8_0) == nullptr && ggml_kvq_get_vec_mad(GGML_TYPE_F16) == nullptr,
                "ggml_kvq_get_vec_mad returns a kernel for a type that is not a KV-cache type");
}

// ---- quantizers ---------------------------------------------------------------------------------

static double rel_mse(const std::vector<float> & x, const std::vector<float> & r) {
    double e = 0.0, s = 0.0;
    for (size_t i = 0; i < x.size(); ++i) {
        e += ((double) x[i] - r[i])*((double) x[i] - r[i]);
        s += (double) x[i]*x[i];
    }
    return e/s;
}

// TQ3_0 (no zero point, 8 fixed levels times the block's scale d): every value takes the level nearest to it, up to
// the rounding of d to fp16 after the levels were chosen (|x/d - x*id| <= 127 * 2^-11 < 0.07 levels' units). The
// levels are read back by dequantizing crafted blocks with d = 1, so this check does not use the quantizer's table.
static void check_tq3_nearest(const std::vector<float> & x, const std::vector<uint8_t> & q) {
    const size_t bs = ggml_type_size(GGML_TYPE_TQ3_0);
    float levels[8];
    for (int l = 0; l < 8; ++l) {
        std::vector<uint8_t> b(bs, 0);
        const ggml_fp16_t one = ggml_fp32_to_fp16(1.0f);
        memcpy(b.data(), &one, sizeof(one));
        b[2] = (uint8_t) (l & 3);                 // value 0: low bits in qs[0] bits 0..1
        b[2 + QK_TQ3_0/4] = (uint8_t) (l >> 2);   // its high bit in hb[0] bit 0
        levels[l] = dequant(GGML_TYPE_TQ3_0, b, QK_TQ3_0)[0];
    }
    const std::vector<float> y = dequant(GGML_TYPE_TQ3_0, q, (int64_t) x.size());
    int64_t bad = 0, first = -1;
    for (size_t i = 0; i < x.size(); ++i) {
        ggml_fp16_t dh;
        memcpy(&dh, q.data() + (i/QK_TQ3_0)*bs, sizeof(dh));
        const float d = ggml_fp16_to_fp32(dh);
        if (d == 0.0f) {
            continue;
        }
        double best = INFINITY;
        for (float l : levels) {
            best = std::min(best, std::fabs((double) x[i] - (double) d*l));
        }
        if (std::fabs((double) x[i] - y[i]) > best + 0.07*d) {
            bad++;
            first = first < 0 ? (int64_t) i : first;
        }
    }
    S3D8T_CHECK(bad == 0, "tq3_0: %lld of %zu values not at their nearest level (first: x[%lld])", (long long) bad,
                x.size(), (long long) first);
}

static void test_quantizers(std::mt19937 & rng) {
    const int64_t n = 128*1024;
    std::normal_distribution<float> g(0.0f, 1.0f);
    std::vector<float> x(n);
    for (auto & v : x) {
        v = g(rng);
    }
    for (ggml_type t : kv_types) {
        // the CPU backend's from_float (what SET_ROWS/CPY write into the cache) is the reference
        const std::vector<uint8_t> q = quant(t, x);
        std::vector<uint8_t> r(q.size());
        ggml_get_type_traits(t)->from_float_ref(x.data(), r.data(), n);
        S3D8T_CHECK(q == r, "%s: from_float differs from from_float_ref", ggml_type_name(t));
        std::vector<uint8_t> c(q.size());
        const size_t nbytes = ggml_quantize_chunk(t, x.data(), c.data(), 0, n/1024, 1024, nullptr);
        S3D8T_CHECK(nbytes == q.size() && c == q, "%s: ggml_quantize_chunk differs from from_float", ggml_type_name(t));
        S3D8T_CHECK(ggml_validate_row_data(t, q.data(), q.size()), "%s: quantized data do not validate", ggml_type_name(t));
        std::vector<uint8_t> bad = q;
        const uint16_t nan16 = 0x7e00;
        memcpy(bad.data() + ggml_type_size(t)*7, &nan16, 2);
        S3D8T_CHECK(!ggml_validate_row_data(t, bad.data(), bad.size()), "%s: a NaN scale validates", ggml_type_name(t));

        const double e = rel_mse(x, dequant(t, q, n));
        printf("%-10s relative MSE on N(0,1): %.5f\n", ggml_type_name(t), e);
        // expected (numpy simulation of the same quantizers, 131072 values): Q4_HQQ 0.0055, Q4_HQQ_128
        // 0.0094, TQ3_0 0.026; the limits sit 10 % above, far below the next worse format
        if (t == GGML_TYPE_Q4_HQQ) {
            std::vector<uint8_t> q1(ggml_row_size(GGML_TYPE_Q4_1, n));
            ggml_quantize_chunk(GGML_TYPE_Q4_1, x.data(), q1.data(), 0, n/1024, 1024, nullptr);
            const double e1 = rel_mse(x, dequant(GGML_TYPE_Q4_1, q1, n));
            printf("%-10s relative MSE on N(0,1): %.5f\n", "q4_1", e1);
            // HQQ's zero point lowers Q4_1's error by ~10 % on Gaussian data (0.0055 vs 0.0061)
            S3D8T_CHECK(e < 0.95*e1, "q4_hqq error %.5f is not below q4_1's %.5f", e, e1);
            S3D8T_CHECK(e < 0.0061, "q4_hqq error %.5f", e);
        } else if (t == GGML_TYPE_Q4_HQQ_128) {
            S3D8T_CHECK(e < 0.0104, "q4_hqq_128 error %.5f", e);
        } else {
            S3D8T_CHECK(e < 0.0290, "tq3_0 error %.5f", e);
        }

        if (t == GGML_TYPE_TQ3_0) {
            check_tq3_nearest(x, q);
        }

        // degenerate blocks: zeros and a constant dequantize exactly
        const int64_t qk = ggml_blck_size(t);
        for (float cval : { 0.0f, 0.75f, -3.5f }) {
            if (t == GGML_TYPE_TQ3_0 && cval != 0.0f) {
                continue; // no zero point: a constant is not representable exactly
            }
            const std::vector<float> cx(qk, cval);
            const std::vector<float> cr = dequant(t, quant(t, cx), qk);
            S3D8T_CHECK(cr == cx, "%s: a constant block of %g does not dequantize exactly", ggml_type_name(t), cval);
        }
    }
}

// ---- flash attention ----------------------------------------------------------------------------

// attention in double: out[h][iq] = softmax_j(scale*q.k_j + mask[iq][j]) v_j, heads grouped as in ggml
static std::vector<double> attention_ref(const std::vector<float> & q, const std::vector<float> & k, const std::vector<float> & v,
        const std::vector<float> & mask, int64_t d, int64_t nq, int64_t nkv, int64_t h, int64_t hkv, float scale) {
    std::vector<double> out(d*h*nq);
    for (int64_t ih = 0; ih < h; ++ih) {
        const int64_t ik = ih/(h/hkv);
        for (int64_t iq = 0; iq < nq; ++iq) {
            std::vector<double> s(nkv);
            double mx = -INFINITY;
            for (int64_t j = 0; j < nkv; ++j) {
                double dot = 0.0;
                for (int64_t c = 0; c < d; ++c) {
                    dot += (double) q[(ih*nq + iq)*d + c]*(double) k[(ik*nkv + j)*d + c];
                }
                s[j] = scale*dot + mask[iq*nkv + j];
                mx = std::max(mx, s[j]);
            }
            double sum = 0.0;
            for (int64_t j = 0; j < nkv; ++j) {
                s[j] = s[j] == -INFINITY ? 0.0 : exp(s[j] - mx);
                sum += s[j];
            }
            for (int64_t c = 0; c < d; ++c) {
                double acc = 0.0;
                for (int64_t j = 0; j < nkv; ++j) {
                    acc += s[j]*(double) v[(ik*nkv + j)*d + c];
                }
                // ggml's output layout: [d, h, nq]
                out[(iq*h + ih)*d + c] = acc/sum;
            }
        }
    }
    return out;
}

static std::vector<float> to_bytes_type(ggml_type t, const std::vector<float> & x, int64_t d, std::vector<uint8_t> & bytes) {
    // rows of d values quantized independently (as SET_ROWS does); returns the dequantized values
    const int64_t nrows = (int64_t) x.size()/d;
    bytes.assign(ggml_row_size(t, d)*nrows, 0);
    std::vector<float> back(x.size());
    for (int64_t r = 0; r < nrows; ++r) {
        uint8_t * row = bytes.data() + r*ggml_row_size(t, d);
        if (t == GGML_TYPE_F32) {
            memcpy(row, x.data() + r*d, d*sizeof(float));
            memcpy(back.data() + r*d, x.data() + r*d, d*sizeof(float));
        } else if (t == GGML_TYPE_F16) {
            ggml_fp32_to_fp16_row(x.data() + r*d, (ggml_fp16_t *) row, d);
            ggml_fp16_to_fp32_row((const ggml_fp16_t *) row, back.data() + r*d, d);
        } else {
            ggml_get_type_traits_cpu(t)->from_float(x.data() + r*d, row, d);
            ggml_get_type_traits(t)->to_float(row, back.data() + r*d, d);
        }
    }
    return back;
}

// Bound: the CPU kernel differs from the double reference only by fp32 rounding: the K.Q dot products
// (relative to sum |q_i k_i| at most gamma_{2d/32+8}, see check_vec_dot; with |scale*s| < 40 here that
// is < 1e-4 absolute on each logit, i.e. < 1e-4 relative on each softmax weight), the online softmax
// (exp, rescaling: a few u per step, < nkv*4u = 6e-5 at nkv = 256) and the fp32 V accumulation (nkv
// terms, gamma_nkv < 2e-5). Together < 3e-4 relative to max|v| per output; the test allows 1e-3*max|v|.
// A K or V path that reads a wrong row, head or block is off by O(max|v|).
static void check_fattn(std::mt19937 & rng, ggml_type tk, ggml_type tv, int64_t d, int64_t nq, int64_t nkv, int64_t h, int64_t hkv, int n_threads) {
    std::vector<float> sc, off;
    channel_profile(rng, d, sc, off);
    std::vector<float> q, k, v;
    for (int64_t i = 0; i < h*nq; ++i) {
        const auto r = kv_row(rng, d, sc, off);
        q.insert(q.end(), r.begin(), r.end());
    }
    for (int64_t i = 0; i < hkv*nkv; ++i) {
        const auto r = kv_row(rng, d, sc, off);
        k.insert(k.end(), r.begin(), r.end());
        std::vector<float> vs(d), vo(d, 0.0f);
        for (auto & s : vs) s = 1.0f;
        const auto rv = kv_row(rng, d, vs, vo);
        v.insert(v.end(), rv.begin(), rv.end());
    }
    // causal-style mask: query iq sees the first nkv - nq + iq + 1 positions
    std::vector<float> mask(nq*nkv);
    for (int64_t iq = 0; iq < nq; ++iq) {
        for (int64_t j = 0; j < nkv; ++j) {
            mask[iq*nkv + j] = j <= nkv - nq + iq ? 0.0f : -INFINITY;
        }
    }
    const float scale = 1.0f/sqrtf((float) d)/4.0f; // outlier channels make q.k large: keep |scale*s| moderate

    std::vector<uint8_t> kb, vb;
    const std::vector<float> kd = to_bytes_type(tk, k, d, kb);
    const std::vector<float> vd = to_bytes_type(tv, v, d, vb);
    // the K path rounds Q to K's vec_dot_type (Q8_0 for the KV types; F32 K keeps it)
    std::vector<uint8_t> qb;
    const ggml_type tq = ggml_get_type_traits_cpu(tk)->vec_dot_type;
    const std::vector<float> qd = to_bytes_type(tq, q, d, qb);
    double vmax = 0.0;
    for (float x : vd) vmax = std::max(vmax, (double) fabsf(x));

    const int64_t nq_pad = nq; // mask: [n_kv, n_batch]
    cpu_op op(16);
    ggml_tensor * tq_ = ggml_new_tensor_3d(op.ctx, GGML_TYPE_F32, d, nq, h);
    ggml_tensor * tk_ = ggml_new_tensor_3d(op.ctx, tk, d, nkv, hkv);
    ggml_tensor * tv_ = ggml_new_tensor_3d(op.ctx, tv, d, nkv, hkv);
    ggml_tensor * tm_ = ggml_new_tensor_2d(op.ctx, GGML_TYPE_F16, nkv, nq_pad);
    ggml_tensor * out = ggml_flash_attn_ext(op.ctx, tq_, tk_, tv_, tm_, scale, 0.0f, 0.0f);
    S3D8T_CHECK(op.supports(out), "flash attention with K %s, V %s is not supported", ggml_type_name(tk), ggml_type_name(tv));
    op.alloc();
    ggml_backend_tensor_set(tq_, q.data(), 0, ggml_nbytes(tq_));
    ggml_backend_tensor_set(tk_, kb.data(), 0, ggml_nbytes(tk_));
    ggml_backend_tensor_set(tv_, vb.data(), 0, ggml_nbytes(tv_));
    std::vector<ggml_fp16_t> m16(nkv*nq_pad, ggml_fp32_to_fp16(-INFINITY));
    for (int64_t i = 0; i < nq*nkv; ++i) m16[i] = ggml_fp32_to_fp16(mask[i]);
    ggml_backend_tensor_set(tm_, m16.data(), 0, ggml_nbytes(tm_));
    S3D8T_CHECK(op.compute(out, n_threads), "flash attention failed");
    std::vector<float> got(ggml_nelements(out));
    ggml_backend_tensor_get(out, got.data(), 0, ggml_nbytes(out));

    const std::vector<double> ref = attention_ref(qd, kd, vd, mask, d, nq, nkv, h, hkv, scale);
    double worst = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        worst = std::max(worst, fabs((double) got[i] - ref[i]));
    }
    // negative control: attention on K rows shifted by one position is far outside the bound
    std::vector<float> ks(kd.size());
    for (size_t i = 0; i < kd.size(); ++i) ks[i] = kd[(i + d) % kd.size()];
    const std::vector<double> bad = attention_ref(qd, ks, vd, mask, d, nq, nkv, h, hkv, scale);
    double worst_bad = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        worst_bad = std::max(worst_bad, fabs((double) got[i] - bad[i]));
    }
    S3D8T_CHECK(worst_bad > 1e-2*vmax, "flash attention K %s V %s: shifted K rows agree too (%.3g)", ggml_type_name(tk), ggml_type_name(tv), worst_bad);
    S3D8T_CHECK(worst <= 1e-3*vmax, "flash attention K %s V %s d=%" PRId64 " nq=%" PRId64 " nkv=%" PRId64 " h=%" PRId64 "/%" PRId64 " t=%d: max |diff| %.3g > %.3g",
                ggml_type_name(tk), ggml_type_name(tv), d, nq, nkv, h, hkv, n_threads, worst, 1e-3*vmax);
}

static void test_fattn(std::mt19937 & rng) {
    const int fail0 = g_failures;
    int n = 0;
    // F32 as the other operand of the K-only and V-only cases (an F16 V accumulates in fp16, whose
    // rounding would hide behind a looser bound)
    const ggml_type all[] = { GGML_TYPE_F32, GGML_TYPE_Q4_HQQ, GGML_TYPE_Q4_HQQ_128, GGML_TYPE_TQ3_0 };
    for (ggml_type tk : all) {
        for (ggml_type tv : all) {
            if (tk == GGML_TYPE_F32 && tv == GGML_TYPE_F32) {
                continue;
            }
            for (int64_t d : { 64, 128 }) {
                if (d % ggml_blck_size(tk) != 0 || d % ggml_blck_size(tv) != 0) {
                    continue;
                }
                check_fattn(rng, tk, tv, d, 1, 256, 4, 2, 1);  // decode, grouped-query heads
                check_fattn(rng, tk, tv, d, 7, 96, 2, 1, 3);   // prefill rows, causal mask, 3 threads
                n += 2;
            }
        }
    }
    printf("flash attention: %d cases %s\n", n, g_failures == fail0 ? "OK" : "FAILED");
}

// ---- dump mode (numpy reference comparison) -------------------------------------------------------

static int dump(const char * type_name, int64_t n_per_row, const char * in, const char * out_q, const char * out_f) {
    ggml_type t = GGML_TYPE_COUNT;
    for (ggml_type c : kv_types) {
        if (strcmp(ggml_type_name(c), type_name) == 0) {
            t = c;
        }
    }
    if (t == GGML_TYPE_COUNT) {
        fprintf(stderr, "unknown type %s\n", type_name);
        return 2;
    }
    FILE * f = fopen(in, "rb");
    if (!f) {
        return 2;
    }
    std::vector<float> x;
    float buf[1024];
    size_t r;
    while ((r = fread(buf, sizeof(float), 1024, f)) > 0) {
        x.insert(x.end(), buf, buf + r);
    }
    fclose(f);
    if (n_per_row <= 0 || x.size() % n_per_row != 0 || n_per_row % ggml_blck_size(t) != 0) {
        fprintf(stderr, "bad row length\n");
        return 2;
    }
    const int64_t nrows = (int64_t) x.size()/n_per_row;
    std::vector<uint8_t> q(ggml_row_size(t, n_per_row)*nrows);
    ggml_quantize_chunk(t, x.data(), q.data(), 0, nrows, n_per_row, nullptr);
    std::vector<float> y = dequant(t, q, (int64_t) x.size());
    FILE * fq = fopen(out_q, "wb");
    FILE * ff = fopen(out_f, "wb");
    if (!fq || !ff) {
        return 2;
    }
    fwrite(q.data(), 1, q.size(), fq);
    fwrite(y.data(), sizeof(float), y.size(), ff);
    fclose(fq);
    fclose(ff);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc == 7 && strcmp(argv[1], "--dump") == 0) {
        return dump(argv[2], atoll(argv[3]), argv[4], argv[5], argv[6]);
    }
    ggml_cpu_init();
    std::mt19937 rng(13);
    test_vec_dot(rng);
    test_vec_mad(rng);
    test_quantizers(rng);
    test_fattn(rng);
    printf("%s (%d failures)\n", g_failures ? "FAILED" : "OK", g_failures);
    return g_failures ? 1 : 0;
}

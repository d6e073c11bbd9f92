// Kernel micro-benchmark: MUL_MAT on the ggml CPU backend, weights of each type x F32 activations,
// plus the machine's streaming read bandwidth, all in one run. Not a test; driven by
// benchmarks/bench_kernels.py, which builds this file against the host build and writes
// docs/benchmarks.md and docs/benchmarks.png.
//
// usage: bench_kernels --types f16,q8_0,s3d8 --shapes 1:4096:14336,128:4096:14336 --threads 1,2
//                      [--min-time 1.0] [--bw-mib 2048] [--rotate-mib 2048] [--rounds 3]
// shapes are m:k:n (m tokens, k inputs, n outputs); one JSON object per line on stdout.
// For few tokens (m <= 16, the memory-bound regime) the graph multiplies by enough copies of the
// weights to cover --rotate-mib, so that the weights stream from DRAM rather than from the cache;
// the bandwidth buffer is --bw-mib large for the same reason. Those shapes are measured in --rounds
// rounds (min-time split between them), each between two bandwidth measurements with the same
// threads: its record carries their mean as bw_gbps.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

using clk = std::chrono::steady_clock;

static std::vector<std::string> split(const std::string & s, char sep) {
    std::vector<std::string> out;
    size_t p = 0;
    while (p <= s.size()) {
        size_t q = s.find(sep, p);
        if (q == std::string::npos) {
            q = s.size();
        }
        if (q > p) {
            out.push_back(s.substr(p, q - p));
        }
        p = q + 1;
    }
    return out;
}

static ggml_type type_by_name(const std::string & name) {
    for (int i = 0; i < GGML_TYPE_COUNT; ++i) {
        const char * n = ggml_type_name((ggml_type) i);
        if (n && strcasecmp(n, name.c_str()) == 0) {
            return (ggml_type) i;
        }
    }
    fprintf(stderr, "unknown type %s\n", name.c_str());
    exit(1);
}

// weight-like data: Laplace with per-row spread
static std::vector<float> weights(int64_t n, int64_t k, uint32_t seed) {
    std::mt19937 rng(seed);
    std::exponential_distribution<float> ed(50.0f);
    std::uniform_real_distribution<float> ud(0.5f, 2.0f);
    std::vector<float> w((size_t) n * k);
    for (int64_t i = 0; i < n; ++i) {
        const float s = ud(rng);
        for (int64_t j = 0; j < k; ++j) {
            const float v = ed(rng) * s;
            w[(size_t) i * k + j] = (rng() & 1) ? v : -v;
        }
    }
    return w;
}

// quantizes rows in parallel (S3D8: one call for the whole matrix)
static std::vector<uint8_t> quantize(ggml_type type, const std::vector<float> & w, int64_t n, int64_t k, int n_threads) {
    std::vector<uint8_t> q(ggml_row_size(type, k) * n);
    if (type == GGML_TYPE_S3D8) {
        ggml_quantize_chunk(type, w.data(), q.data(), 0, n, k, nullptr);
        return q;
    }
    std::vector<float> imatrix;
    const float * im = nullptr;
    if (ggml_quantize_requires_imatrix(type)) {
        imatrix.assign(k, 1.0f);
        im = imatrix.data();
    }
    std::vector<std::thread> th;
    for (int t = 0; t < n_threads; ++t) {
        th.emplace_back([&, t]() {
            const int64_t r0 = n * t / n_threads;
            const int64_t r1 = n * (t + 1) / n_threads;
            if (r1 > r0) {
                ggml_quantize_chunk(type, w.data(), q.data(), r0 * k, r1 - r0, k, im);
            }
        });
    }
    for (auto & t : th) {
        t.join();
    }
    return q;
}

// streaming read bandwidth (GB/s) of a buffer of bytes with n_threads threads: the median of the passes
// made in min_time (at least min_passes), the statistic the kernels are timed with
static double read_bandwidth(const std::vector<uint64_t> & buf, int n_threads, double min_time, int min_passes = 3) {
    std::vector<double> gbps;
    std::atomic<uint64_t> sink { 0 };
    const auto t_end = clk::now() + std::chrono::duration<double>(min_time);
    do {
        const auto t0 = clk::now();
        std::vector<std::thread> th;
        for (int t = 0; t < n_threads; ++t) {
            th.emplace_back([&, t]() {
                const size_t i0 = buf.size() * t / n_threads;
                const size_t i1 = buf.size() * (t + 1) / n_threads;
                uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
                for (size_t i = i0; i + 4 <= i1; i += 4) {
                    a0 += buf[i + 0];
                    a1 += buf[i + 1];
                    a2 += buf[i + 2];
                    a3 += buf[i + 3];
                }
                sink += a0 ^ a1 ^ a2 ^ a3;
            });
        }
        for (auto & t : th) {
            t.join();
        }
        const double dt = std::chrono::duration<double>(clk::now() - t0).count();
        gbps.push_back(buf.size() * sizeof(uint64_t) / dt / 1e9);
    } while (clk::now() < t_end || (int) gbps.size() < min_passes);
    std::sort(gbps.begin(), gbps.end());
    return gbps[gbps.size() / 2];
}

// The int8 multiply-accumulate peak of one core: 24 independent vpdpbusd chains on registers (no
// memory operands), enough to cover the instruction's latency on every port that executes it, written
// as asm on register operands (compilers may keep such accumulators in memory and store
// them every iteration, which would measure stores). Returns MACs per second of one thread, or 0 where
// AVX512-VNNI is missing.
#if defined(__x86_64__) && defined(__GNUC__)
#define VNNI_CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
                       X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
constexpr int VNNI_N_CHAINS = 24;

__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline))
static uint32_t vnni_chains(int64_t iters, int8_t sv) {
#define VNNI_INIT(i) __m512i a##i = _mm512_set1_epi32(i);
#define VNNI_FOLD(i) r = _mm512_xor_si512(r, a##i);
    VNNI_CHAINS(VNNI_INIT)
    const __m512i u = _mm512_set1_epi8(3);
    const __m512i s = _mm512_set1_epi8(sv);
    for (int64_t it = 0; it < iters; ++it) {
        // asm on register operands (two statements: at most 30 operands each): the compiler can neither
        // fold the chains nor move them through memory
        __asm__ volatile(
            "vpdpbusd %[s], %[u], %[a0]\n\t"
            "vpdpbusd %[s], %[u], %[a1]\n\t"
            "vpdpbusd %[s], %[u], %[a2]\n\t"
            "vpdpbusd %[s], %[u], %[a3]\n\t"
            "vpdpbusd %[s], %[u], %[a4]\n\t"
            "vpdpbusd %[s], %[u], %[a5]\n\t"
            "vpdpbusd %[s], %[u], %[a6]\n\t"
            "vpdpbusd %[s], %[u], %[a7]\n\t"
            "vpdpbusd %[s], %[u], %[a8]\n\t"
            "vpdpbusd %[s], %[u], %[a9]\n\t"
            "vpdpbusd %[s], %[u], %[a10]\n\t"
            "vpdpbusd %[s], %[u], %[a11]\n\t"
            : [a0] "+v"(a0), [a1] "+v"(a1), [a2] "+v"(a2), [a3] "+v"(a3), [a4] "+v"(a4), [a5] "+v"(a5), [a6] "+v"(a6), [a7] "+v"(a7), [a8] "+v"(a8), [a9] "+v"(a9), [a10] "+v"(a10), [a11] "+v"(a11)
            : [u] "v"(u), [s] "v"(s));
        __asm__ volatile(
            "vpdpbusd %[s], %[u], %[a12]\n\t"
            "vpdpbusd %[s], %[u], %[a13]\n\t"
            "vpdpbusd %[s], %[u], %[a14]\n\t"
            "vpdpbusd %[s], %[u], %[a15]\n\t"
            "vpdpbusd %[s], %[u], %[a16]\n\t"
            "vpdpbusd %[s], %[u], %[a17]\n\t"
            "vpdpbusd %[s], %[u], %[a18]\n\t"
            "vpdpbusd %[s], %[u], %[a19]\n\t"
            "vpdpbusd %[s], %[u], %[a20]\n\t"
            "vpdpbusd %[s], %[u], %[a21]\n\t"
            "vpdpbusd %[s], %[u], %[a22]\n\t"
            "vpdpbusd %[s], %[u], %[a23]\n\t"
            : [a12] "+v"(a12), [a13] "+v"(a13), [a14] "+v"(a14), [a15] "+v"(a15), [a16] "+v"(a16), [a17] "+v"(a17), [a18] "+v"(a18), [a19] "+v"(a19), [a20] "+v"(a20), [a21] "+v"(a21), [a22] "+v"(a22), [a23] "+v"(a23)
            : [u] "v"(u), [s] "v"(s));
    }
    __m512i r = _mm512_setzero_si512();
    VNNI_CHAINS(VNNI_FOLD)
#undef VNNI_INIT
#undef VNNI_FOLD
    return (uint32_t) _mm512_reduce_add_epi32(r);
}

static double vnni_peak_one_thread(double min_time, uint64_t * sink) {
    constexpr int64_t ITERS = 1 << 16;
    double best = 0.0;
    const auto t_end = clk::now() + std::chrono::duration<double>(min_time);
    do {
        const auto t0 = clk::now();
        *sink += vnni_chains(ITERS, -5);
        const double dt = std::chrono::duration<double>(clk::now() - t0).count();
        best = std::max(best, (double) ITERS * VNNI_N_CHAINS * 64 / dt);
    } while (clk::now() < t_end);
    return best;
}

static double vnni_peak(int n_threads, double min_time) {
    if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) {
        return 0.0;
    }
    std::vector<double> per(n_threads, 0.0);
    std::vector<uint64_t> sinks(n_threads, 0);
    std::vector<std::thread> th;
    for (int t = 0; t < n_threads; ++t) {
        th.emplace_back([&, t]() { per[t] = vnni_peak_one_thread(min_time, &sinks[t]); });
    }
    for (auto & t : th) {
        t.join();
    }
    double sum = 0.0;
    for (double v : per) {
        sum += v;
    }
    return sum;
}
#else
static double vnni_peak(int, double) {
    return 0.0;
}
#endif

int main(int argc, char ** argv) {
    std::string types_arg  = "f16,bf16,q8_0,s3d8,q4_0,q2_K,iq2_s,iq3_xxs";
    std::string shapes_arg = "1:4096:14336,128:4096:14336,1601:1280:5120";
    std::string threads_arg = "1,2";
    double min_time = 1.0;
    int bw_mib = 2048;
    int rotate_mib = 2048;
    int rounds = 3;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) {
                fprintf(stderr, "missing value for %s\n", a.c_str());
                exit(1);
            }
            return argv[++i];
        };
        if (a == "--types") {
            types_arg = next();
        } else if (a == "--shapes") {
            shapes_arg = next();
        } else if (a == "--threads") {
            threads_arg = next();
        } else if (a == "--min-time") {
            min_time = atof(next().c_str());
        } else if (a == "--bw-mib") {
            bw_mib = atoi(next().c_str());
        } else if (a == "--rotate-mib") {
            rotate_mib = atoi(next().c_str());
        } else if (a == "--rounds") {
            rounds = std::max(1, atoi(next().c_str()));
        } else {
            fprintf(stderr, "unknown argument %s\n", a.c_str());
            return 1;
        }
    }

    std::vector<int> threads;
    for (const auto & t : split(threads_arg, ',')) {
        threads.push_back(atoi(t.c_str()));
    }
    const int max_threads = *std::max_element(threads.begin(), threads.end());

    // bandwidth first, the same thread counts; the buffer is kept for the measurements next to each
    // memory-bound kernel run (below)
    std::vector<uint64_t> bw_buf((size_t) bw_mib * 1024 * 1024 / sizeof(uint64_t));
    for (size_t i = 0; i < bw_buf.size(); ++i) {
        bw_buf[i] = i * 0x9e3779b97f4a7c15ull;
    }
    for (int nt : threads) {
        printf("{\"kind\": \"bandwidth\", \"threads\": %d, \"gbps\": %.3f, \"mib\": %d}\n", nt, read_bandwidth(bw_buf, nt, min_time), bw_mib);
        fflush(stdout);
    }

    // int8 VNNI peak, the same thread counts (the ceiling of the many-token kernels)
    for (int nt : threads) {
        const double p = vnni_peak(nt, min_time);
        if (p > 0.0) {
            printf("{\"kind\": \"vnni_peak\", \"threads\": %d, \"gmacs\": %.3f}\n", nt, p / 1e9);
            fflush(stdout);
        }
    }

    struct shape { int64_t m, k, n; };
    std::vector<shape> shapes;
    for (const auto & s : split(shapes_arg, ',')) {
        const auto p = split(s, ':');
        if (p.size() != 3) {
            fprintf(stderr, "bad shape %s\n", s.c_str());
            return 1;
        }
        shapes.push_back({ atoll(p[0].c_str()), atoll(p[1].c_str()), atoll(p[2].c_str()) });
    }

    ggml_backend_t backend = ggml_backend_cpu_init();

    // weights of one (k, n) are quantized once and used for every m
    for (size_t si = 0; si < shapes.size(); ++si) {
        const int64_t k = shapes[si].k;
        const int64_t n = shapes[si].n;
        bool done_before = false;
        for (size_t sj = 0; sj < si; ++sj) {
            done_before |= shapes[sj].k == k && shapes[sj].n == n;
        }
        if (done_before) {
            continue;
        }
        const auto w = weights(n, k, 1234);
        for (const auto & tn : split(types_arg, ',')) {
            const ggml_type type = type_by_name(tn);
            if (k % ggml_blck_size(type) != 0 || (type == GGML_TYPE_S3D8 && !ggml_s3d8_is_eligible(k, n))) {
                printf("{\"kind\": \"skip\", \"type\": \"%s\", \"k\": %lld, \"n\": %lld}\n", ggml_type_name(type), (long long) k, (long long) n);
                continue;
            }
            const auto tq0 = clk::now();
            const auto q = quantize(type, w, n, k, max_threads);
            const double tq = std::chrono::duration<double>(clk::now() - tq0).count();

            for (const auto & sh : shapes) {
                if (sh.k != k || sh.n != n) {
                    continue;
                }
                const int64_t m = sh.m;

                const int64_t copies = m <= 16 ? std::max<int64_t>(1, ((int64_t) rotate_mib * 1024 * 1024 + (int64_t) q.size() - 1) / (int64_t) q.size()) : 1;
                ggml_init_params ip = { ggml_tensor_overhead() * (4 + 2*copies) + ggml_graph_overhead_custom(4 + 2*copies, false), nullptr, true };
                ggml_context * ctx = ggml_init(ip);
                std::vector<ggml_tensor *> as;
                for (int64_t c = 0; c < copies; ++c) {
                    as.push_back(ggml_new_tensor_2d(ctx, type, k, n));
                }
                ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
                std::vector<ggml_tensor *> outs;
                for (int64_t c = 0; c < copies; ++c) {
                    outs.push_back(ggml_mul_mat(ctx, as[c], b));
                }
                ggml_tensor * out = outs[0];
                ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
                for (auto * a : as) {
                    ggml_backend_tensor_set(a, q.data(), 0, q.size());
                }
                {
                    std::mt19937 rng(7);
                    std::normal_distribution<float> nd;
                    std::vector<float> x((size_t) m * k);
                    for (auto & v : x) {
                        v = nd(rng);
                    }
                    ggml_backend_tensor_set(b, x.data(), 0, x.size() * sizeof(float));
                }
                ggml_cgraph * gf = ggml_new_graph_custom(ctx, 4 + 2*copies, false);
                for (auto * o : outs) {
                    ggml_build_forward_expand(gf, o);
                }
                const bool supported = ggml_backend_supports_op(backend, out);

                // memory-bound shapes (m <= 16): `rounds` measurements, each between two bandwidth measurements
                // with the same threads (the memory bandwidth a VM gets drifts within seconds: a ratio is only
                // meaningful against the bandwidth of the same moment)
                const bool memory_bound = m <= 16;
                for (int nt : threads) {
                    if (!supported) {
                        break;
                    }
                    ggml_backend_cpu_set_n_threads(backend, nt);
                    ggml_backend_graph_compute(backend, gf); // warm-up
                    for (int round = 0; round < (memory_bound ? rounds : 1); ++round) {
                        const double bw0 = memory_bound ? read_bandwidth(bw_buf, nt, 0.0) : 0.0;
                        std::vector<double> times;
                        const auto t_end = clk::now() + std::chrono::duration<double>(memory_bound ? min_time / rounds : min_time);
                        do {
                            const auto t0 = clk::now();
                            ggml_backend_graph_compute(backend, gf);
                            times.push_back(std::chrono::duration<double>(clk::now() - t0).count());
                        } while (clk::now() < t_end || times.size() < 3);
                        const double bw1 = memory_bound ? read_bandwidth(bw_buf, nt, 0.0) : 0.0;
                        std::sort(times.begin(), times.end());
                        const double t = times[times.size() / 2] / copies;
                        const double macs = (double) m * n * k;
                        printf("{\"kind\": \"mul_mat\", \"type\": \"%s\", \"m\": %lld, \"k\": %lld, \"n\": %lld, \"threads\": %d, "
                               "\"round\": %d, \"seconds\": %.9f, \"gmacs\": %.3f, \"weight_bytes\": %zu, \"weight_gbps\": %.3f, ",
                               ggml_type_name(type), (long long) m, (long long) k, (long long) n, nt, round, t, macs / t / 1e9,
                               q.size(), q.size() / t / 1e9);
                        if (memory_bound) {
                            printf("\"bw_gbps\": %.3f, ", 0.5 * (bw0 + bw1));
                        }
                        printf("\"runs\": %zu, \"copies\": %lld, \"quantize_s\": %.2f}\n", times.size(), (long long) copies, tq);
                        fflush(stdout);
                    }
                }
                if (!supported) {
                    printf("{\"kind\": \"unsupported\", \"type\": \"%s\", \"m\": %lld, \"k\": %lld, \"n\": %lld}\n",
                           ggml_type_name(type), (long long) m, (long long) k, (long long) n);
                }
                ggml_backend_buffer_free(buf);
                ggml_free(ctx);
            }
        }
    }

    ggml_backend_free(backend);
    return 0;
}

// FP32 fused multiply-add peak of one core, measured: 12 independent accumulators of the widest vector the
// compiler targets (-march=native), each updated with a*b+c in a loop the FMA latency cannot slow down.
// Built and run by benchmarks/bench_vision_encode.py (cc -O2 -march=native -ffp-contract=fast); prints GFLOPS.
#include <stdio.h>
#include <time.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
#define NACC 12

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

int main(void) {
    vec acc[NACC], a, b;
    for (int l = 0; l < LANES; l++) {
        a[l] = 0.999999f;
        b[l] = 1e-7f;
    }
    for (int j = 0; j < NACC; j++) {
        acc[j] = a * (float) j;
    }
    const long iters = 200000000L;
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        // twelve named accumulators, so that the compiler keeps them in registers (an indexed array it may keep
        // in memory: a load and a store per FMA)
        vec a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3], a4 = acc[4], a5 = acc[5];
        vec a6 = acc[6], a7 = acc[7], a8 = acc[8], a9 = acc[9], a10 = acc[10], a11 = acc[11];
        const double t0 = now();
        for (long i = 0; i < iters / 5; i++) {
            a0 = a0 * a + b; a1 = a1 * a + b; a2 = a2 * a + b; a3 = a3 * a + b;
            a4 = a4 * a + b; a5 = a5 * a + b; a6 = a6 * a + b; a7 = a7 * a + b;
            a8 = a8 * a + b; a9 = a9 * a + b; a10 = a10 * a + b; a11 = a11 * a + b;
        }
        const double gflops = 2.0 * LANES * NACC * (iters / 5) / (now() - t0) / 1e9;
        acc[0] = a0; acc[1] = a1; acc[2] = a2; acc[3] = a3; acc[4] = a4; acc[5] = a5;
        acc[6] = a6; acc[7] = a7; acc[8] = a8; acc[9] = a9; acc[10] = a10; acc[11] = a11;
        best = gflops > best ? gflops : best;
    }
    float sum = 0;
    for (int j = 0; j < NACC; j++) {
        for (int l = 0; l < LANES; l++) {
            sum += acc[j][l];
        }
    }
    printf("%.1f %d %g\n", best, LANES, (double) sum);
    return 0;
}

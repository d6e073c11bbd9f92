// The integer arithmetic of ggml-vulkan's S3D8 shaders (vulkan-shaders/s3d8_funcs.glsl), compiled as C++ and checked
// against the CPU's fp32 arithmetic, which IEEE 754 rounds correctly:
//   s3d8_div127(a)      == bits(a / 127.0f)   for every 61st positive finite float (35 M values, every exponent),
//                                             and the largest, smallest normal and every subnormal of a sample
//   s3d8_recip_bf16(s)  == bits(1.0f / s)     for every positive finite bf16 value s (all 32 639 of them)
//   s3d8_bf16_rne(u)    == GGML_FP32_TO_BF16  for the same floats as a / 127
// GLSL's own division is not correctly rounded (2.5 ULP), so the shaders compute these two quotients this way; on a
// device whose division happens to round correctly (lavapipe), test-backend-ops -b Vulkan0 cannot tell the two apart,
// and this test is what checks the shaders' divisions. It needs no Vulkan device and runs in every build.

#include "ggml.h"
#include "ggml-impl.h"

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>

// the GLSL built-ins and types s3d8_funcs.glsl uses
typedef uint32_t uint;
static int findMSB(uint x) { return x == 0 ? -1 : 31 - __builtin_clz(x); }
using std::max;

#define S3D8_ARITH_ONLY
#include "s3d8_funcs.glsl"

static uint bits(float f) {
    uint u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float from_bits(uint u) {
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

int main() {
    // the host must divide in IEEE fp32 without flushing subnormals (the reference below)
    volatile float tiny = 1e-44f;
    if (!(tiny / 2.0f > 0.0f)) {
        fprintf(stderr, "the host flushes subnormals: no reference\n");
        return 1;
    }

    int64_t n_div = 0, bad_div = 0, bad_bf16 = 0;
    auto check_div = [&](uint a) {
        const uint want = bits(from_bits(a) / 127.0f);
        const uint got  = s3d8_div127(a);
        ++n_div;
        if (got != want && bad_div++ < 10) {
            fprintf(stderr, "s3d8_div127(0x%08x): 0x%08x, want 0x%08x\n", a, got, want);
        }
        const uint16_t want_bf16 = GGML_FP32_TO_BF16(from_bits(want)).bits;
        if (s3d8_bf16_rne(want) != want_bf16 && bad_bf16++ < 10) {
            fprintf(stderr, "s3d8_bf16_rne(0x%08x): 0x%04x, want 0x%04x\n", want, s3d8_bf16_rne(want), want_bf16);
        }
    };
    for (uint a = 1; a < 0x7f800000u; a += 61) {
        check_div(a);
    }
    for (uint a = 1; a < 0x00800000u; a += 7) {   // subnormals (a / 127 is one too)
        check_div(a);
    }
    check_div(0x7f7fffffu);                         // FLT_MAX
    check_div(0x00800000u);                         // FLT_MIN

    int64_t n_rcp = 0, bad_rcp = 0;
    for (uint h = 1; h < 0x7f80u; ++h) {            // every positive finite bf16
        const uint s = h << 16;
        const uint want = bits(1.0f / from_bits(s));
        const uint got  = s3d8_recip_bf16(s);
        ++n_rcp;
        if (got != want && bad_rcp++ < 10) {
            fprintf(stderr, "s3d8_recip_bf16(0x%08x): 0x%08x, want 0x%08x\n", s, got, want);
        }
    }

    printf("a / 127: %" PRId64 " of %" PRId64 " wrong; bf16 rounding: %" PRId64 " wrong; 1 / s: %" PRId64 " of %" PRId64 " wrong\n",
           bad_div, n_div, bad_bf16, bad_rcp, n_rcp);
    return bad_div || bad_bf16 || bad_rcp ? 1 : 0;
}

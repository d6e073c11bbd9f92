// Checks that a build really compiled in the SIMD paths it was configured for (and none it must not have).
// The aarch64 CI builds run this under qemu-aarch64: a dotprod-only build that silently gained i8mm, or an
// i8mm build that silently lost it, would make the kernel tests prove less than they claim.
//
// usage: test-cpu-features --expect=dotprod,i8mm --forbid=sve
//        test-cpu-features --expect=native     (a GGML_NATIVE build: exactly the features this CPU reports)
#include "ggml-cpu.h"

#include <stdio.h>
#include <string.h>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

struct feature {
    const char * name;
    int (*has)(void);
};

static const struct feature features[] = {
    { "neon",     ggml_cpu_has_neon        },
    { "dotprod",  ggml_cpu_has_dotprod     },
    { "i8mm",     ggml_cpu_has_matmul_int8 },
    { "sve",      ggml_cpu_has_sve         },
    { "sme",      ggml_cpu_has_sme         },
    { "fp16_va",  ggml_cpu_has_fp16_va     },
    { "avx2",     ggml_cpu_has_avx2        },
    { "avx512",   ggml_cpu_has_avx512      },
    { "avx512_vbmi", ggml_cpu_has_avx512_vbmi },
    { "avx512_vnni", ggml_cpu_has_avx512_vnni },
    { "avx_vnni", ggml_cpu_has_avx_vnni    },
};

static const struct feature * find(const char * name, size_t len) {
    for (size_t i = 0; i < sizeof(features)/sizeof(features[0]); ++i) {
        if (strlen(features[i].name) == len && strncmp(features[i].name, name, len) == 0) {
            return &features[i];
        }
    }
    return NULL;
}

// returns the number of failures for a comma-separated list
static int check_list(const char * list, int want) {
    int failures = 0;
    while (list && *list) {
        const char * end = strchr(list, ',');
        size_t len = end ? (size_t)(end - list) : strlen(list);
        if (len > 0) {
            const struct feature * f = find(list, len);
            if (!f) {
                fprintf(stderr, "unknown feature '%.*s'\n", (int) len, list);
                failures++;
            } else if (f->has() != want) {
                fprintf(stderr, "FAIL: feature %s is %s, expected %s\n", f->name,
                        f->has() ? "present" : "absent", want ? "present" : "absent");
                failures++;
            }
        }
        list = end ? end + 1 : NULL;
    }
    return failures;
}

// What the CPU running the test reports (cpuid, the kernel's hwcaps), by the names above; -1 where this test does
// not know how to ask. A GGML_NATIVE build compiles for the building CPU, so it must have exactly these: one that
// silently lost AVX512 (a compiler flag dropped) would leave the AVX512 kernels untested.
static int cpu_reports(const char * name) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (strcmp(name, "avx2") == 0)        return __builtin_cpu_supports("avx2");
    if (strcmp(name, "avx512") == 0)      return __builtin_cpu_supports("avx512f");
    if (strcmp(name, "avx512_vbmi") == 0) return __builtin_cpu_supports("avx512vbmi");
    if (strcmp(name, "avx512_vnni") == 0) return __builtin_cpu_supports("avx512vnni");
    if (strcmp(name, "avx_vnni") == 0)    return __builtin_cpu_supports("avxvnni");
    if (strcmp(name, "neon") == 0 || strcmp(name, "dotprod") == 0 || strcmp(name, "i8mm") == 0 ||
        strcmp(name, "sve") == 0 || strcmp(name, "sme") == 0 || strcmp(name, "fp16_va") == 0) return 0;
#elif defined(__aarch64__) && defined(__linux__)
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    if (strcmp(name, "neon") == 0)    return (hw & HWCAP_ASIMD) != 0;
    if (strcmp(name, "dotprod") == 0) return (hw & HWCAP_ASIMDDP) != 0;
    if (strcmp(name, "i8mm") == 0)    return (hw2 & HWCAP2_I8MM) != 0;
    if (strcmp(name, "sve") == 0)     return (hw & HWCAP_SVE) != 0;
    if (strncmp(name, "avx", 3) == 0) return 0;
#else
    (void) name;
#endif
    return -1;
}

static int check_native(void) {
    int failures = 0, known = 0;
    for (size_t i = 0; i < sizeof(features)/sizeof(features[0]); ++i) {
        const int cpu = cpu_reports(features[i].name);
        if (cpu < 0) {
            continue;
        }
        known++;
        if (!!cpu != !!features[i].has()) {
            fprintf(stderr, "FAIL: the CPU %s %s, the native build %s it\n", cpu ? "has" : "lacks", features[i].name,
                    features[i].has() ? "has" : "lacks");
            failures++;
        }
    }
    if (known == 0) {
        fprintf(stderr, "FAIL: --expect=native: this test cannot ask this CPU for its features\n");
        failures++;
    }
    return failures;
}

int main(int argc, char ** argv) {
    const char * expect = "";
    const char * forbid = "";
    for (int i = 1; i < argc; ++i) {
        if (strncmp(argv[i], "--expect=", 9) == 0) {
            expect = argv[i] + 9;
        } else if (strncmp(argv[i], "--forbid=", 9) == 0) {
            forbid = argv[i] + 9;
        } else {
            fprintf(stderr, "usage: %s [--expect=a,b] [--forbid=c,d]\n", argv[0]);
            return 2;
        }
    }
    printf("compiled-in CPU features:");
    for (size_t i = 0; i < sizeof(features)/sizeof(features[0]); ++i) {
        if (features[i].has()) {
            printf(" %s", features[i].name);
        }
    }
    printf("\n");
    const int failures = strcmp(expect, "native") == 0 ? check_native() + check_list(forbid, 0)
                                                       : check_list(expect, 1) + check_list(forbid, 0);
    printf("%s\n", failures ? "FAILED" : "OK");
    return failures ? 1 : 0;
}

// Decompression bombs: tiny image files that claim huge sizes (tests/data/fuzz/bombs) must be rejected by
// mtmd_helper_bitmap_init_from_buf without the memory they claim. Each file is decoded in a child process
// (address space capped at 4 GiB so that a regression cannot take the machine's memory); the child reports
// how much its peak resident set (VmHWM) and its peak address space (VmPeak: untouched allocations count
// too) grew. A control image must still decode.
//   test-image-bomb TEXT_MODEL MMPROJ BOMB... [--ok IMAGE...]
#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"

#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

static const long long MAX_RSS_GROWTH_KB  = 64 * 1024;  // resident
static const long long MAX_VM_GROWTH_KB   = 512 * 1024; // address space
// CPU seconds of the decoding child (getrusage), not wall time: CTest runs two jobs at once on a loaded machine, and
// a rejection decodes nothing while a bomb that decodes burns seconds of CPU whatever the load
static const double    MAX_CPU_SECONDS    = 10.0;

static double cpu_seconds() {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + 1e-6*(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

static long long status_kb(const char * field) {
    std::ifstream f("/proc/self/status");
    std::string line;
    const size_t n = strlen(field);
    while (std::getline(f, line)) {
        if (line.compare(0, n, field) == 0 && line[n] == ':') {
            return atoll(line.c_str() + n + 1);
        }
    }
    return -1;
}

static void quiet(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        fprintf(stderr, "  log: %s", text);
    }
}

struct result { int decoded; long long rss_kb, vm_kb; double seconds; };

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s TEXT_MODEL MMPROJ BOMB... [--ok IMAGE...]\n", argv[0]);
        return 2;
    }
    llama_log_set(quiet, nullptr);
    mtmd_helper_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    mtmd_context_params cp = mtmd_context_params_default();
    cp.use_gpu = false;
    cp.warmup  = false;
    cp.print_timings = false;
    mtmd_context * ctx = model ? mtmd_init_from_file(argv[2], model, cp) : nullptr;
    if (!ctx) {
        fprintf(stderr, "cannot load %s / %s\n", argv[1], argv[2]);
        return 2;
    }

    int failures = 0;
    bool expect_ok = false;
    for (int i = 3; i < argc; ++i) {
        if (strcmp(argv[i], "--ok") == 0) {
            expect_ok = true;
            continue;
        }
        std::ifstream in(argv[i], std::ios::binary);
        std::vector<unsigned char> buf((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        if (buf.empty()) {
            fprintf(stderr, "FAIL %s: cannot read it\n", argv[i]);
            ++failures;
            continue;
        }
        int fds[2];
        if (pipe(fds) != 0) {
            perror("pipe");
            return 2;
        }
        const pid_t pid = fork();
        if (pid == 0) {
            close(fds[0]);
            struct rlimit lim = { 4ull << 30, 4ull << 30 };
            setrlimit(RLIMIT_AS, &lim);
            alarm(120);
            result r = {};
            const long long rss0 = status_kb("VmHWM"), vm0 = status_kb("VmPeak");
            const double t0 = cpu_seconds();
            mtmd_helper_bitmap_wrapper w = mtmd_helper_bitmap_init_from_buf(ctx, buf.data(), buf.size(), false,
                                                                             mtmd_helper_init_opt_default());
            r.seconds = cpu_seconds() - t0;
            r.rss_kb  = status_kb("VmHWM") - rss0;
            r.vm_kb   = status_kb("VmPeak") - vm0;
            r.decoded = w.bitmap != nullptr;
            if (w.bitmap) {
                fprintf(stderr, "  decoded %u x %u\n", mtmd_bitmap_get_nx(w.bitmap), mtmd_bitmap_get_ny(w.bitmap));
            }
            if (write(fds[1], &r, sizeof(r)) != (ssize_t) sizeof(r)) {
                _exit(3);
            }
            _exit(0);
        }
        close(fds[1]);
        result r = {};
        const ssize_t got = read(fds[0], &r, sizeof(r));
        close(fds[0]);
        int status = 0;
        waitpid(pid, &status, 0);
        const char * name = argv[i];
        if (got != (ssize_t) sizeof(r) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "FAIL %s: the decoding child died (status 0x%x%s)\n", name, status,
                    WIFSIGNALED(status) ? ", killed by a signal" : "");
            ++failures;
            continue;
        }
        bool ok;
        if (expect_ok) {
            ok = r.decoded;
        } else {
            ok = !r.decoded && r.rss_kb <= MAX_RSS_GROWTH_KB && r.vm_kb <= MAX_VM_GROWTH_KB && r.seconds <= MAX_CPU_SECONDS;
        }
        fprintf(stderr, "%s %s: %s, peak RSS +%lld KiB, peak address space +%lld KiB, %.3f CPU s\n", ok ? "ok  " : "FAIL",
                name, r.decoded ? "decoded" : "rejected", r.rss_kb, r.vm_kb, r.seconds);
        failures += !ok;
    }
    mtmd_free(ctx);
    llama_model_free(model);
    if (failures) {
        fprintf(stderr, "%d failure(s) (a bomb must be rejected within +%lld KiB resident, +%lld KiB address space, %.0f CPU s)\n",
                failures, MAX_RSS_GROWTH_KB, MAX_VM_GROWTH_KB, MAX_CPU_SECONDS);
    }
    return failures ? 1 : 0;
}

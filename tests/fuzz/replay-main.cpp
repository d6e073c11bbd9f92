// Driver that replays inputs through a fuzz target without libFuzzer: builds with any compiler, so the seeds
// and the regression inputs of tests/data/fuzz run in every native build's CTest (tests/fuzz/CMakeLists.txt).
//   <target>-replay [--expect FILE | --record FILE] FILE_OR_DIR...
// Each input's outcome (fuzz::outcome(): the target accepted it, or rejected it with the messages it logged) is
// checked against FILE (tests/data/fuzz/expect/<target>.tsv): one line per input, keyed by the last three components
// of its path, "KEY<TAB>accept" or "KEY<TAB>reject<TAB>TEXT" where TEXT must occur in one of the rejection's
// (normalized: numbers are '#') messages. Exit status 0: every input ran and had its expected outcome, and every
// line of FILE named an input; 1 otherwise (a crash is a crash). --record FILE writes the outcomes seen instead.
#include "fuzz-common.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerInitialize(int * argc, char *** argv);
extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size);

// the custom mutators call libFuzzer's; never reached when replaying
extern "C" size_t LLVMFuzzerMutate(uint8_t * /*data*/, size_t size, size_t /*max_size*/) { return size; }

static void collect(const std::string & path, std::vector<std::string> & files) {
    struct stat st;
    if (stat(path.c_str(), &st) != 0) {
        fprintf(stderr, "%s: not found\n", path.c_str());
        exit(2);
    }
    if (!S_ISDIR(st.st_mode)) {
        files.push_back(path);
        return;
    }
    DIR * dir = opendir(path.c_str());
    std::vector<std::string> names;
    while (dirent * e = readdir(dir)) {
        if (e->d_name[0] != '.') {
            names.push_back(e->d_name);
        }
    }
    closedir(dir);
    std::sort(names.begin(), names.end());
    for (const auto & n : names) {
        collect(path + "/" + n, files);
    }
}

// the last three components of a path: "regressions/mllama-text/duplicate-token.gguf" and
// "fuzz-seeds/mllama-text/duplicate-token.gguf" are two inputs
static std::string input_key(const std::string & path) {
    size_t pos = path.size();
    for (int i = 0; i < 3 && pos != std::string::npos && pos > 0; ++i) {
        pos = path.rfind('/', pos - 1);
    }
    return pos == std::string::npos ? path : path.substr(pos + 1);
}

struct expectation {
    bool        accept = false;
    std::string text; // reject: a substring of one of the messages
    bool        seen   = false;
};

static std::map<std::string, expectation> read_expectations(const char * path) {
    std::ifstream in(path);
    if (!in) {
        fprintf(stderr, "%s: cannot read the expected outcomes\n", path);
        exit(2);
    }
    std::map<std::string, expectation> out;
    std::string line;
    for (int no = 1; std::getline(in, line); ++no) {
        if (line.empty() || line[0] == '#') {
            continue;
        }
        const size_t t1 = line.find('\t');
        const size_t t2 = t1 == std::string::npos ? t1 : line.find('\t', t1 + 1);
        const std::string key  = line.substr(0, t1);
        const std::string verb = t1 == std::string::npos ? "" : line.substr(t1 + 1, t2 == std::string::npos ? t2 : t2 - t1 - 1);
        expectation e;
        e.accept = verb == "accept";
        e.text   = t2 == std::string::npos ? "" : line.substr(t2 + 1);
        if ((verb != "accept" && verb != "reject") || (e.accept && !e.text.empty()) || !out.emplace(key, e).second) {
            fprintf(stderr, "%s:%d: not 'KEY<TAB>accept' or 'KEY<TAB>reject[<TAB>TEXT]', or a repeated key: %s\n", path, no, line.c_str());
            exit(2);
        }
    }
    return out;
}

int main(int argc, char ** argv) {
    LLVMFuzzerInitialize(&argc, &argv);
    const char * expect_path = nullptr;
    FILE * record = nullptr;
    std::vector<std::string> files;
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if ((a == "--expect" || a == "--record") && i + 1 < argc) {
            if (a == "--expect") {
                expect_path = argv[++i];
            } else if (!(record = fopen(argv[++i], "w"))) {
                perror(argv[i]);
                return 2;
            }
            continue;
        }
        collect(a, files);
    }
    if (files.empty()) {
        fprintf(stderr, "no inputs\n");
        return 2;
    }
    std::map<std::string, expectation> expected;
    if (expect_path) {
        expected = read_expectations(expect_path);
    }
    int n_bad = 0;
    for (const auto & f : files) {
        std::ifstream in(f, std::ios::binary);
        std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        fprintf(stderr, "replay %s (%zu bytes)\n", f.c_str(), data.size());
        fuzz::outcome() = fuzz::outcome_t();
        LLVMFuzzerTestOneInput(data.data(), data.size());
        const fuzz::outcome_t & got = fuzz::outcome();
        const std::string key = input_key(f);
        if (got.state == fuzz::outcome_t::NONE) {
            fprintf(stderr, "  FAIL %s: the target neither accepted nor rejected it\n", key.c_str());
            n_bad++;
            continue;
        }
        const bool accepted = got.state == fuzz::outcome_t::ACCEPTED;
        if (record) {
            // a rejection is recorded with its first message, the most specific one (the loaders log the reason, then
            // their own failure), less llama's prefix; never one that depends on the machine (mtmd's helper tries
            // ffprobe, where installed, on what stb_image cannot decode)
            std::string text;
            for (const auto & m : got.messages) {
                if (m.find("ffprobe") == std::string::npos) {
                    const size_t at = m.find("error loading model: ");
                    text = at == std::string::npos ? m : m.substr(at + strlen("error loading model: "));
                    break;
                }
            }
            fprintf(record, accepted ? "%s\taccept\n" : "%s\treject\t%s\n", key.c_str(), text.c_str());
        }
        if (!expect_path) {
            continue;
        }
        auto it = expected.find(key);
        if (it == expected.end()) {
            fprintf(stderr, "  FAIL %s: no expected outcome in %s\n", key.c_str(), expect_path);
            n_bad++;
            continue;
        }
        expectation & e = it->second;
        e.seen = true;
        bool ok = accepted == e.accept;
        if (ok && !e.accept && !e.text.empty()) {
            ok = std::any_of(got.messages.begin(), got.messages.end(),
                             [&](const std::string & m) { return m.find(e.text) != std::string::npos; });
        }
        if (!ok) {
            fprintf(stderr, "  FAIL %s: %s, expected %s%s%s; messages:\n", key.c_str(), accepted ? "accepted" : "rejected",
                    e.accept ? "accept" : "reject with '", e.text.c_str(), e.accept ? "" : "'");
            for (const auto & m : got.messages) {
                fprintf(stderr, "    %s\n", m.c_str());
            }
            n_bad++;
        }
    }
    for (const auto & [key, e] : expected) {
        if (!e.seen) {
            fprintf(stderr, "  FAIL %s: expected in %s but not among the inputs\n", key.c_str(), expect_path);
            n_bad++;
        }
    }
    if (record) {
        fclose(record);
    }
    fprintf(stderr, "%zu inputs replayed, %d with another outcome than expected\n", files.size(), n_bad);
    return n_bad ? 1 : 0;
}

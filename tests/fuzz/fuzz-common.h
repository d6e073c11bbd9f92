// Shared pieces of the fuzz targets (docs/reliability.md, "Fuzzing the loaders"): in-memory files, log capture (the distinct
// rejection messages) and a GGUF-aware mutator.
#pragma once

#include "ggml.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

// libFuzzer's own mutator, for the custom mutators below (a weak stub in the replay driver)
extern "C" size_t LLVMFuzzerMutate(uint8_t * data, size_t size, size_t max_size);

namespace fuzz {

// An input as a file: a memfd (no disk, freed when closed) named /proc/self/fd/N for the loaders' fopen/mmap.
class memfile {
public:
    memfile(const uint8_t * data, size_t size) {
        fd_ = memfd_create("fuzz-input", MFD_CLOEXEC);
        if (fd_ < 0) {
            perror("memfd_create");
            abort();
        }
        size_t done = 0;
        while (done < size) {
            const ssize_t n = write(fd_, data + done, size - done);
            if (n <= 0) {
                perror("write");
                abort();
            }
            done += (size_t) n;
        }
        path_ = "/proc/self/fd/" + std::to_string(fd_);
    }
    ~memfile() { close(fd_); }
    memfile(const memfile &) = delete;
    memfile & operator=(const memfile &) = delete;
    const char * path() const { return path_.c_str(); }

private:
    int         fd_ = -1;
    std::string path_;
};

// Rejection messages: every number (a word that starts with a digit, 0x..., a hex byte such as "fb" in a
// list of numbers) becomes '#' so that one kind of error is one line; each new one is appended to $S3D8_FUZZ_MESSAGES
// (if set) the first time this process sees it.
inline std::string normalize_message(const char * text) {
    auto is_word = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
    auto is_hex  = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); };
    std::string out;
    const size_t n = strlen(text);
    for (size_t i = 0; i < n; ) {
        if (!is_word(text[i])) {
            out += text[i] == '\n' ? ' ' : text[i];
            ++i;
            continue;
        }
        size_t j = i;
        while (j < n && is_word(text[j])) {
            ++j;
        }
        const std::string word(text + i, j - i);
        // a hex byte without a digit ("fb") only in a list of numbers or after "magic"
        const bool in_list = (out.size() >= 2 && out.compare(out.size() - 2, 2, "# ") == 0) ||
                             (out.size() >= 6 && out.compare(out.size() - 6, 6, "magic ") == 0);
        const bool number = (word[0] >= '0' && word[0] <= '9') ||
                            (in_list && word.size() == 2 && is_hex(word[0]) && is_hex(word[1]));
        out += number ? std::string("#") : word;
        i = j;
    }
    while (!out.empty() && out.back() == ' ') {
        out.pop_back();
    }
    return out;
}

// What the target made of the input being run: accepted (the loader or decoder took it) or rejected, with the
// messages logged meanwhile. The replay driver (replay-main.cpp) resets it before each input and checks it against the
// input's expected outcome; libFuzzer ignores it.
struct outcome_t {
    enum { NONE, ACCEPTED, REJECTED } state = NONE;
    std::vector<std::string> messages; // normalized, in order
};
inline outcome_t & outcome() {
    static outcome_t o;
    return o;
}
inline void accept() { outcome().state = outcome_t::ACCEPTED; }
inline void reject() { outcome().state = outcome_t::REJECTED; }

inline void record_message(const char * text) {
    static std::mutex mutex;
    static std::set<std::string> seen;
    static FILE * out = [] {
        const char * path = getenv("S3D8_FUZZ_MESSAGES");
        return path && *path ? fopen(path, "a") : nullptr;
    }();
    const std::string msg = normalize_message(text);
    if (msg.empty()) {
        return;
    }
    std::lock_guard<std::mutex> lock(mutex);
    outcome().messages.push_back(msg);
    if (seen.insert(msg).second) {
        if (out) {
            fprintf(out, "%s\n", msg.c_str());
            fflush(out);
        }
        if (getenv("S3D8_FUZZ_VERBOSE")) {
            fprintf(stderr, "[new message] %s\n", msg.c_str());
        }
    }
}

// ggml/llama/mtmd log callback: errors (and warnings, which carry some of the rejections) are recorded,
// nothing is printed unless S3D8_FUZZ_VERBOSE=2
inline void log_callback(enum ggml_log_level level, const char * text, void * /*user_data*/) {
    static const bool print = [] {
        const char * v = getenv("S3D8_FUZZ_VERBOSE");
        return v && atoi(v) >= 2;
    }();
    if (print) {
        fputs(text, stderr);
    }
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN) {
        record_message(text);
    }
}

// --- GGUF-aware mutation ----------------------------------------------------------------------------------
// A GGUF file is a header, key-value pairs, tensor infos and data. Random bytes mostly land in the tensor
// data or break the framing; this mutator parses the file and rewrites one numeric field in place (a
// hyperparameter, an array element, an array or string length, a value type, a tensor's dimension, type
// or offset) with a value chosen to hit edges: 0, 1, -1, extremes, small numbers, +-1, x2, /2.

struct gguf_field {
    size_t offset;
    int    width; // bytes: 1, 2, 4, 8
    bool   is_float;
};

class gguf_scan {
public:
    gguf_scan(const uint8_t * data, size_t size) : p_(data), size_(size) {}

    // the numeric fields of the file (as far as it parses); false when the header does not parse
    bool scan(std::vector<gguf_field> & fields, size_t & data_offset) {
        if (size_ < 24 || memcmp(p_, "GGUF", 4) != 0) {
            return false;
        }
        pos_ = 4;
        uint32_t version;
        uint64_t n_tensors, n_kv;
        if (!u32(version) || !field(fields, 8, n_tensors) || !field(fields, 8, n_kv)) {
            return false;
        }
        for (uint64_t i = 0; i < n_kv && i < 100000; ++i) {
            uint64_t key_len;
            if (!u64(key_len) || !skip(key_len)) {
                return true;
            }
            uint64_t type;
            if (!field(fields, 4, type) || !value(fields, (uint32_t) type, 0)) {
                return true;
            }
        }
        for (uint64_t i = 0; i < n_tensors && i < 100000; ++i) {
            uint64_t name_len, n_dims, dim, type, offset;
            if (!u64(name_len) || !skip(name_len) || !field(fields, 4, n_dims)) {
                return true;
            }
            for (uint64_t d = 0; d < n_dims && d < 8; ++d) {
                if (!field(fields, 8, dim)) {
                    return true;
                }
            }
            if (!field(fields, 4, type) || !field(fields, 8, offset)) {
                return true;
            }
        }
        data_offset = pos_;
        return true;
    }

private:
    bool u32(uint32_t & v) { return read(&v, 4); }
    bool u64(uint64_t & v) { return read(&v, 8); }
    bool read(void * v, size_t n) {
        if (size_ - pos_ < n) {
            return false;
        }
        memcpy(v, p_ + pos_, n);
        pos_ += n;
        return true;
    }
    bool skip(uint64_t n) {
        if (size_ - pos_ < n) {
            return false;
        }
        pos_ += n;
        return true;
    }
    bool field(std::vector<gguf_field> & fields, int width, uint64_t & v, bool is_float = false) {
        v = 0;
        if (size_ - pos_ < (size_t) width) {
            return false;
        }
        fields.push_back({pos_, width, is_float});
        memcpy(&v, p_ + pos_, width);
        pos_ += width;
        return true;
    }
    bool value(std::vector<gguf_field> & fields, uint32_t type, int depth) {
        uint64_t v;
        switch (type) {
            case 0: case 1: case 7: return field(fields, 1, v);    // u8, i8, bool
            case 2: case 3:         return field(fields, 2, v);    // u16, i16
            case 4: case 5:         return field(fields, 4, v);    // u32, i32
            case 6:                 return field(fields, 4, v, true);
            case 10: case 11:       return field(fields, 8, v);    // u64, i64
            case 12:                return field(fields, 8, v, true);
            case 8: {                                               // string
                uint64_t len;
                return field(fields, 8, len) && skip(len);
            }
            case 9: {                                               // array
                if (depth > 0) {
                    return false;
                }
                uint64_t elem_type, n;
                if (!field(fields, 4, elem_type) || !field(fields, 8, n)) {
                    return false;
                }
                // every element of short arrays (layer lists, image means); the first 16 of long ones
                size_t keep = 0;
                for (uint64_t i = 0; i < n; ++i) {
                    if (i == 16) {
                        keep = fields.size();
                    }
                    if (!value(fields, (uint32_t) elem_type, depth + 1)) {
                        return false;
                    }
                    if (i >= 16) {
                        fields.resize(keep);
                    }
                }
                return true;
            }
            default: return false;
        }
    }

    const uint8_t * p_;
    size_t          size_;
    size_t          pos_ = 0;
};

inline uint64_t interesting_value(uint64_t old, int width, bool is_float, uint32_t r) {
    if (is_float) {
        static const float f32[] = {0.0f, -0.0f, 1.0f, -1.0f, 1e-30f, 1e30f, 0.5f, 2.0f, 65504.0f, 3.4e38f,
                                    __builtin_inff(), -__builtin_inff(), __builtin_nanf("")};
        static const double f64[] = {0.0, 1.0, -1.0, 1e-300, 1e300, __builtin_inf(), __builtin_nan("")};
        uint64_t v = 0;
        if (width == 4) {
            memcpy(&v, &f32[r % (sizeof(f32)/sizeof(f32[0]))], 4);
        } else {
            memcpy(&v, &f64[r % (sizeof(f64)/sizeof(f64[0]))], 8);
        }
        return v;
    }
    const uint64_t mask = width == 8 ? ~0ull : ((1ull << (8*width)) - 1);
    const uint64_t smax = mask >> 1;
    switch (r % 16) {
        case 0:  return 0;
        case 1:  return 1;
        case 2:  return mask;                 // -1
        case 3:  return smax;                 // INT_MAX
        case 4:  return smax + 1;             // INT_MIN
        case 5:  return (old + 1) & mask;
        case 6:  return (old - 1) & mask;
        case 7:  return (old * 2) & mask;
        case 8:  return old / 2;
        case 9:  return (r >> 4) % 9;         // small numbers: layer indices, counts
        case 10: return (r >> 4) % 65;
        case 11: return (1ull << ((r >> 4) % (8*width))) & mask;
        case 12: return ((1ull << ((r >> 4) % (8*width))) - 1) & mask;
        case 13: return 30000;
        case 14: return (old + ((r >> 4) % 17) - 8) & mask;
        default: return ((uint64_t) r * 0x9E3779B97F4A7C15ull) & mask;
    }
}

// One mutation of a GGUF input: a structured field rewrite, a byte mutation confined to the metadata part
// (header, key-values and tensor infos), or libFuzzer's own mutation of the whole input.
inline size_t mutate_gguf(uint8_t * data, size_t size, size_t max_size, unsigned int seed) {
    uint32_t r = seed * 2654435761u + 12345u;
    const uint32_t choice = r % 8;
    r = r * 1103515245u + 12345u;
    std::vector<gguf_field> fields;
    size_t data_offset = 0;
    if (choice < 6 && gguf_scan(data, size).scan(fields, data_offset) && !fields.empty()) {
        if (choice < 4) {
            const int n = 1 + (choice == 3 ? (int) (r % 3) : 0);
            for (int i = 0; i < n; ++i) {
                const gguf_field & f = fields[(r >> 3) % fields.size()];
                r = r * 1103515245u + 12345u;
                uint64_t old = 0;
                memcpy(&old, data + f.offset, f.width);
                const uint64_t v = interesting_value(old, f.width, f.is_float, r >> 5);
                memcpy(data + f.offset, &v, f.width);
                r = r * 1103515245u + 12345u;
            }
            return size;
        }
        if (data_offset > 0 && data_offset < size) {
            // libFuzzer's mutators on the metadata only; the tensor data are moved along unchanged
            std::vector<uint8_t> tail(data + data_offset, data + size);
            const size_t room = max_size - tail.size();
            const size_t head = LLVMFuzzerMutate(data, data_offset, room);
            memcpy(data + head, tail.data(), tail.size());
            return head + tail.size();
        }
    }
    return LLVMFuzzerMutate(data, size, max_size);
}

} // namespace fuzz

// Each GGUF target includes this once (FUZZ_GGUF_MUTATOR) to get the structure-aware mutator.
#ifdef FUZZ_GGUF_MUTATOR
extern "C" size_t LLVMFuzzerCustomMutator(uint8_t * data, size_t size, size_t max_size, unsigned int seed) {
    return fuzz::mutate_gguf(data, size, max_size, seed);
}
#endif

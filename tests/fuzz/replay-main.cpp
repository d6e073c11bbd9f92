// Driver that replays inputs through a fuzz target without libFuzzer: builds with any compiler, so the seeds
// and the regression inputs of tests/data/fuzz run in every native build's CTest (tests/fuzz/CMakeLists.txt).
//   <target>-replay FILE_OR_DIR...     (exit status 0: every input ran; a crash is a crash)
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
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

int main(int argc, char ** argv) {
    LLVMFuzzerInitialize(&argc, &argv);
    std::vector<std::string> files;
    for (int i = 1; i < argc; ++i) {
        collect(argv[i], files);
    }
    if (files.empty()) {
        fprintf(stderr, "no inputs\n");
        return 2;
    }
    for (const auto & f : files) {
        std::ifstream in(f, std::ios::binary);
        std::vector<uint8_t> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        fprintf(stderr, "replay %s (%zu bytes)\n", f.c_str(), data.size());
        LLVMFuzzerTestOneInput(data.data(), data.size());
    }
    fprintf(stderr, "%zu inputs replayed\n", files.size());
    return 0;
}

// Fuzz target: an mmproj GGUF through libmtmd's public API (mtmd_init_from_file: clip's GGUF reader,
// hyperparameters, tensors, the warmup graph), then one small image preprocessed, tokenized and encoded.
// The text model is fixed: $S3D8_FUZZ_TEXT_MODEL, default the tiny mllama text seed (FUZZ_TEXT_MODEL).
#define FUZZ_GGUF_MUTATOR
#include "fuzz-common.h"

#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"

#include <vector>

static llama_model * g_text_model = nullptr;

extern "C" int LLVMFuzzerInitialize(int * /*argc*/, char *** /*argv*/) {
    llama_log_set(fuzz::log_callback, nullptr);
    mtmd_helper_log_set(fuzz::log_callback, nullptr);
    llama_backend_init();
    const char * path = getenv("S3D8_FUZZ_TEXT_MODEL");
    path = path && *path ? path : FUZZ_TEXT_MODEL;
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    g_text_model = llama_model_load_from_file(path, mp);
    if (!g_text_model) {
        fprintf(stderr, "cannot load the text model %s (set S3D8_FUZZ_TEXT_MODEL)\n", path);
        abort();
    }
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    fuzz::memfile file(data, size);

    mtmd_context_params params = mtmd_context_params_default();
    params.use_gpu       = false;
    params.print_timings = false;
    params.n_threads     = 1;
    params.warmup        = true;
    mtmd_context * ctx = mtmd_init_from_file(file.path(), g_text_model, params);
    if (!ctx) {
        fuzz::reject();
        return 0;
    }
    fuzz::accept();
    if (mtmd_support_vision(ctx)) {
        // a 40 x 30 image: not the model's size, so preprocessing resizes and tiles it
        std::vector<unsigned char> rgb(40 * 30 * 3);
        for (size_t i = 0; i < rgb.size(); ++i) {
            rgb[i] = (unsigned char) (i * 37);
        }
        mtmd_bitmap * bitmap = mtmd_bitmap_init(40, 30, rgb.data());
        std::string prompt = std::string("describe ") + mtmd_get_marker(ctx);
        mtmd_input_text text = { prompt.c_str(), true, true };
        mtmd_input_chunks * chunks = mtmd_input_chunks_init();
        const mtmd_bitmap * bitmaps[] = { bitmap };
        if (mtmd_tokenize(ctx, chunks, &text, bitmaps, 1) == 0) {
            for (size_t i = 0; i < mtmd_input_chunks_size(chunks); ++i) {
                const mtmd_input_chunk * chunk = mtmd_input_chunks_get(chunks, i);
                if (mtmd_input_chunk_get_type(chunk) != MTMD_INPUT_CHUNK_TYPE_TEXT) {
                    mtmd_encode_chunk(ctx, chunk);
                }
            }
        }
        mtmd_input_chunks_free(chunks);
        mtmd_bitmap_free(bitmap);
    }
    mtmd_free(ctx);
    return 0;
}

// Fuzz target: image bytes through libmtmd's decoder (mtmd_helper_bitmap_init_from_buf: stb_image for
// PNG/JPEG/BMP/GIF/..., miniaudio for what looks like audio), then mllama's preprocessing and tokenization of
// the decoded bitmap. Models fixed: $S3D8_FUZZ_TEXT_MODEL / $S3D8_FUZZ_MMPROJ, default the tiny mllama seeds.
#include "fuzz-common.h"

#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"

static llama_model *  g_text_model = nullptr;
static mtmd_context * g_ctx        = nullptr;

static const char * env_or(const char * name, const char * fallback) {
    const char * v = getenv(name);
    return v && *v ? v : fallback;
}

extern "C" int LLVMFuzzerInitialize(int * /*argc*/, char *** /*argv*/) {
    llama_log_set(fuzz::log_callback, nullptr);
    mtmd_helper_log_set(fuzz::log_callback, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    const char * text = env_or("S3D8_FUZZ_TEXT_MODEL", FUZZ_TEXT_MODEL);
    g_text_model = llama_model_load_from_file(text, mp);
    if (!g_text_model) {
        fprintf(stderr, "cannot load the text model %s (set S3D8_FUZZ_TEXT_MODEL)\n", text);
        abort();
    }
    mtmd_context_params params = mtmd_context_params_default();
    params.use_gpu       = false;
    params.print_timings = false;
    params.n_threads     = 1;
    params.warmup        = false;
    const char * mmproj = env_or("S3D8_FUZZ_MMPROJ", FUZZ_MMPROJ);
    g_ctx = mtmd_init_from_file(mmproj, g_text_model, params);
    if (!g_ctx) {
        fprintf(stderr, "cannot load the mmproj %s (set S3D8_FUZZ_MMPROJ)\n", mmproj);
        abort();
    }
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    mtmd_helper_bitmap_wrapper w = mtmd_helper_bitmap_init_from_buf(g_ctx, data, size, false, mtmd_helper_init_opt_default());
    if (!w.bitmap) {
        fuzz::reject();
        return 0;
    }
    fuzz::accept();
    // preprocessing (tile choice, resize, normalisation) of whatever size was decoded
    std::string prompt = std::string("describe ") + mtmd_get_marker(g_ctx);
    mtmd_input_text text = { prompt.c_str(), true, true };
    mtmd_input_chunks * chunks = mtmd_input_chunks_init();
    const mtmd_bitmap * bitmaps[] = { w.bitmap };
    mtmd_tokenize(g_ctx, chunks, &text, bitmaps, 1);
    mtmd_input_chunks_free(chunks);
    mtmd_bitmap_free(w.bitmap);
    return 0;
}

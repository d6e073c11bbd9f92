// Fuzz target: a GGUF model file through libllama's public API, as llama-cli loads it: the GGUF parser,
// the hyperparameters, the vocabulary, the tensor infos and (check_tensors, vocab_only = false) the
// validation of every tensor's data; a model that loads then gets a context and decodes two tokens, which
// builds and runs the graph its hyperparameters describe. Built twice: fuzz-gguf-model (seeds: a tiny
// Llama with an S3D8 matrix) and fuzz-mllama-text (a tiny mllama text model).
#define FUZZ_GGUF_MUTATOR
#include "fuzz-common.h"

#include "llama.h"

extern "C" int LLVMFuzzerInitialize(int * /*argc*/, char *** /*argv*/) {
    llama_log_set(fuzz::log_callback, nullptr);
    llama_backend_init();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    fuzz::memfile file(data, size);

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers  = 0;
    mp.vocab_only    = false;
    mp.check_tensors = true;
    mp.load_mode     = (size & 1) ? LLAMA_LOAD_MODE_MMAP : LLAMA_LOAD_MODE_NONE; // both ways of reading the data
    llama_model * model = llama_model_load_from_file(file.path(), mp);
    if (!model) {
        fuzz::reject();
        return 0;
    }
    fuzz::accept();

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx           = 32;
    cp.n_batch         = 8;
    cp.n_ubatch        = 8;
    cp.n_seq_max       = 1;
    cp.n_threads       = 1;
    cp.n_threads_batch = 1;
    cp.no_perf         = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx) {
        const llama_vocab * vocab = llama_model_get_vocab(model);
        const int32_t n_vocab = llama_vocab_n_tokens(vocab);
        llama_token tokens[2] = { 0, n_vocab > 1 ? n_vocab - 1 : 0 };
        const llama_token bos = llama_vocab_bos(vocab);
        if (bos >= 0 && bos < n_vocab) {
            tokens[0] = bos;
        }
        if (n_vocab > 0) {
            llama_decode(ctx, llama_batch_get_one(tokens, 2));
        }
        llama_free(ctx);
    }
    llama_model_free(model);
    return 0;
}

// llama-mllama-dump: runs an mllama (Llama 3.2 Vision) model on an explicit token sequence and writes what the
// parity tests compare against transformers, as .npy files in the output directory:
//
//   prompt_logits.npy  f32 [n_prompt, n_vocab]  logits of every prompt position
//   step_logits.npy    f32 [n_steps,  n_vocab]  logits of the greedy decode steps after the prompt
//   tokens.npy         i32 [n_steps + 1]        greedy tokens (first = argmax of the last prompt position)
//   cross_<i>.npy      f32 [n_rows, n_embd]     cross-attention states of image i (vision encoder + projector)
//   cross_valid.npy    i32 [n_images]           rows of those states that are not padding (the image's own tiles)
//
// --image-max-tiles N caps the tiles of an image (mtmd_context_params.image_max_tiles, default: the projector's).
//
// With --state-roundtrip, the sequence state (KV cache and cross-attention states) is saved after the prompt,
// the memory is cleared and the state restored before the decode steps.
//
// With --dump-tensors DIR, the intermediate tensors of the vision encoder (local_inp, global_inp, layer_out-<il>)
// and of the text model (l_out-<il>, for the prompt) are written to DIR as <name>.npy (shape as ggml's ne,
// reversed), for layer-by-layer comparisons; --dump-name NAME (repeatable) adds the graph tensor of that exact name
// (e.g. attn_norm-0, Vcur-0, result_norm, result_output: the inputs and outputs of single S3D8 matmuls).
// The tool runs any llama.cpp text model too (no --mmproj/--image/--cross): the phone-path test uses it so.
//
// Every occurrence of the image token in --tokens stands for the next --image (in order). The cross-attention
// states of all images are attached before the prompt is decoded, as the reference implementation sees them.
// -ctkx/-ctvx set the types of the cross-attention store (default: -ctk/-ctv), as --cache-type-k-cross/-v-cross do in
// the common tools.
//
// With --cross FILE.npy (f32 [n_rows, n_embd], one per image) the states are read from a file instead of being
// computed by the vision encoder, which tests the text model on its own.

#include "llama.h"
#include "mtmd.h"
#include "mtmd-helper.h"
#include "ggml-backend.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

struct npy_array {
    std::vector<float> data;
    std::vector<size_t> shape;
};

static void write_npy(const std::string & path, const char * descr, const void * data, size_t elsize, const std::vector<size_t> & shape) {
    std::string shp = "(";
    size_t n = 1;
    for (size_t i = 0; i < shape.size(); ++i) {
        shp += std::to_string(shape[i]) + (shape.size() == 1 ? ",": (i + 1 < shape.size() ? ", " : ""));
        n *= shape[i];
    }
    shp += ")";
    std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shp + ", }";
    while ((10 + header.size() + 1) % 64 != 0) {
        header += ' ';
    }
    header += '\n';
    std::ofstream f(path, std::ios::binary);
    if (!f) {
        throw std::runtime_error("cannot write " + path);
    }
    const uint16_t hlen = (uint16_t) header.size();
    f.write("\x93NUMPY\x01\x00", 8);
    f.write((const char *) &hlen, 2);
    f.write(header.data(), header.size());
    f.write((const char *) data, n*elsize);
    if (!f) {
        throw std::runtime_error("failed to write " + path);
    }
}

static npy_array read_npy_f32(const std::string & path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        throw std::runtime_error("cannot read " + path);
    }
    char magic[8];
    f.read(magic, 8);
    if (memcmp(magic, "\x93NUMPY", 6) != 0) {
        throw std::runtime_error(path + ": not a .npy file");
    }
    uint32_t hlen = 0;
    if (magic[6] == 1) {
        uint16_t h16;
        f.read((char *) &h16, 2);
        hlen = h16;
    } else {
        f.read((char *) &hlen, 4);
    }
    std::string header(hlen, ' ');
    f.read(header.data(), hlen);
    if (header.find("'<f4'") == std::string::npos || header.find("'fortran_order': False") == std::string::npos) {
        throw std::runtime_error(path + ": expected a C-ordered float32 array");
    }
    npy_array res;
    const size_t p0 = header.find('(');
    const size_t p1 = header.find(')');
    std::string dims = header.substr(p0 + 1, p1 - p0 - 1);
    size_t n = 1;
    for (size_t pos = 0; pos < dims.size();) {
        size_t end = dims.find(',', pos);
        if (end == std::string::npos) {
            end = dims.size();
        }
        std::string d = dims.substr(pos, end - pos);
        if (d.find_first_not_of(' ') != std::string::npos) {
            res.shape.push_back(std::stoul(d));
            n *= res.shape.back();
        }
        pos = end + 1;
    }
    res.data.resize(n);
    f.read((char *) res.data.data(), n*sizeof(float));
    if (!f) {
        throw std::runtime_error(path + ": truncated");
    }
    return res;
}

// eval callback writing selected F32 tensors as .npy files
struct tensor_dumper {
    std::string dir;
    std::vector<std::string> names; // --dump-name: exact names, besides the prefixes below
    bool enabled = true;
    bool dump = true;               // write the wanted tensors (false: --placement alone)
    // --placement: "OP<TAB>src0 type<TAB>buffer of the result" -> count, for every node that computes something
    // (ggml_op_desc: unary and GLU ops by their own name); the scheduler allocates a node's result in a buffer of the
    // backend that computes it, so the buffer names the backend
    std::map<std::string, int> * placement = nullptr;

    void record(const struct ggml_tensor * t) const {
        if (placement && t->op != GGML_OP_NONE && t->op != GGML_OP_VIEW && t->op != GGML_OP_RESHAPE &&
                t->op != GGML_OP_PERMUTE && t->op != GGML_OP_TRANSPOSE) {
            (*placement)[std::string(ggml_op_desc(t)) + "\t" + (t->src[0] ? ggml_type_name(t->src[0]->type) : "-") +
                         "\t" + (t->buffer ? ggml_backend_buffer_name(t->buffer) : "none")]++;
        }
    }

    bool wanted(const char * name) const {
        static const char * prefixes[] = { "local_inp", "global_inp", "layer_out-", "l_out-" };
        if (strchr(name, ' ') != nullptr) {
            return false; // views and reshapes of a named tensor
        }
        for (const char * p : prefixes) {
            if (strncmp(name, p, strlen(p)) == 0) {
                return true;
            }
        }
        return std::find(names.begin(), names.end(), name) != names.end();
    }

    static bool cb(struct ggml_tensor * t, bool ask, void * user_data) {
        auto * self = (tensor_dumper *) user_data;
        if (ask) {
            self->record(t);
        }
        if (!self->enabled || !self->dump || !self->wanted(t->name)) {
            return !ask; // not observed; keep computing
        }
        if (ask) {
            return true;
        }
        if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
            return true;
        }
        std::vector<float> v(ggml_nelements(t));
        ggml_backend_tensor_get(t, v.data(), 0, ggml_nbytes(t));
        std::vector<size_t> shape;
        for (int d = GGML_MAX_DIMS - 1; d >= 0; --d) {
            if (t->ne[d] > 1 || !shape.empty() || d == 0) {
                shape.push_back(t->ne[d]);
            }
        }
        write_npy(self->dir + "/" + t->name + ".npy", "<f4", v.data(), sizeof(float), shape);
        return true;
    }
};

static void usage(const char * argv0) {
    fprintf(stderr,
        "usage: %s -m TEXT.gguf [--mmproj MMPROJ.gguf --image IMG ...] [--cross STATES.npy --n-valid N ...]\n"
        "          --tokens ID,ID,... [--n-steps N] [-ctk TYPE] [-ctv TYPE] [-ctkx TYPE] [-ctvx TYPE] [-fa on|off|auto]\n"
        "          [-t N] -o OUTDIR\n"
        "          [--dump-tensors DIR [--dump-name NAME ...]] [--state-roundtrip] [--image-max-tiles N]\n"
        "          [-ngl N] [-ub N] [--placement]\n"
        "  -ub N         tokens per ubatch (default: the whole prompt in one)\n"
        "  -ngl N        layers to offload to the first GPU device (default 0; the vision encoder too when N != 0)\n"
        "  --placement   write OUTDIR/op_placement.tsv: every op that computes, by op, type of src0 and the buffer\n"
        "                (= backend) of its result, with its count\n",
        argv0);
}

static ggml_type parse_type(const std::string & s) {
    for (int i = 0; i < GGML_TYPE_COUNT; ++i) {
        const char * name = ggml_type_name((ggml_type) i);
        if (name && s == name) {
            return (ggml_type) i;
        }
    }
    throw std::runtime_error("unknown cache type " + s);
}

static int argmax(const float * v, int n) {
    return (int) (std::max_element(v, v + n) - v);
}

int main(int argc, char ** argv) {
    std::string model_path;
    std::string mmproj_path;
    std::string out_dir;
    std::string dump_dir;
    std::vector<std::string> dump_names;
    bool state_roundtrip = false;
    std::vector<std::string> images;
    std::vector<std::string> cross_files;
    std::vector<int32_t> cross_valid;
    std::vector<llama_token> tokens;
    int n_steps   = 0;
    int n_threads = 2;
    int image_max_tiles = -1;
    int n_gpu_layers = 0;
    int n_ubatch = 0;
    bool placement = false;
    ggml_type type_k = GGML_TYPE_F16;
    ggml_type type_v = GGML_TYPE_F16;
    ggml_type type_k_cross = GGML_TYPE_COUNT; // = type_k
    ggml_type type_v_cross = GGML_TYPE_COUNT; // = type_v
    llama_flash_attn_type fa = LLAMA_FLASH_ATTN_TYPE_AUTO;

    try {
        for (int i = 1; i < argc; ++i) {
            const std::string a = argv[i];
            auto next = [&]() -> std::string {
                if (i + 1 >= argc) {
                    throw std::runtime_error("missing value for " + a);
                }
                return argv[++i];
            };
            if (a == "-m") {
                model_path = next();
            } else if (a == "--mmproj") {
                mmproj_path = next();
            } else if (a == "--image") {
                images.push_back(next());
            } else if (a == "--cross") {
                cross_files.push_back(next());
            } else if (a == "--n-valid") {
                cross_valid.push_back(std::stoi(next()));
            } else if (a == "--tokens") {
                const std::string s = next();
                for (size_t p = 0; p < s.size();) {
                    size_t e = s.find(',', p);
                    if (e == std::string::npos) {
                        e = s.size();
                    }
                    tokens.push_back(std::stoi(s.substr(p, e - p)));
                    p = e + 1;
                }
            } else if (a == "--n-steps") {
                n_steps = std::stoi(next());
            } else if (a == "-ctk") {
                type_k = parse_type(next());
            } else if (a == "-ctv") {
                type_v = parse_type(next());
            } else if (a == "-ctkx") {
                type_k_cross = parse_type(next());
            } else if (a == "-ctvx") {
                type_v_cross = parse_type(next());
            } else if (a == "-fa") {
                const std::string v = next();
                fa = v == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED : v == "off" ? LLAMA_FLASH_ATTN_TYPE_DISABLED : LLAMA_FLASH_ATTN_TYPE_AUTO;
            } else if (a == "-t") {
                n_threads = std::stoi(next());
            } else if (a == "-o") {
                out_dir = next();
            } else if (a == "--dump-tensors") {
                dump_dir = next();
            } else if (a == "--dump-name") {
                dump_names.push_back(next());
            } else if (a == "--state-roundtrip") {
                state_roundtrip = true;
            } else if (a == "--image-max-tiles") {
                image_max_tiles = std::stoi(next());
            } else if (a == "-ub") {
                n_ubatch = std::stoi(next());
            } else if (a == "-ngl") {
                n_gpu_layers = std::stoi(next());
            } else if (a == "--placement") {
                placement = true;
            } else {
                usage(argv[0]);
                return 2;
            }
        }
    } catch (const std::exception & e) {
        fprintf(stderr, "error: %s\n", e.what());
        usage(argv[0]);
        return 2;
    }

    if (model_path.empty() || out_dir.empty() || tokens.empty() || (!images.empty() && mmproj_path.empty()) ||
            (!dump_names.empty() && dump_dir.empty()) ||
            (!images.empty() && !cross_files.empty()) || cross_valid.size() > cross_files.size()) {
        usage(argv[0]);
        return 2;
    }

    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = n_gpu_layers;
    llama_model * model = llama_model_load_from_file(model_path.c_str(), mparams);
    if (!model) {
        fprintf(stderr, "error: failed to load %s\n", model_path.c_str());
        return 1;
    }

    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    const int n_embd  = llama_model_n_embd(model);

    const int n_prompt = (int) tokens.size();

    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = std::max(256, n_prompt + n_steps + 16);
    cparams.n_batch         = std::max(n_prompt, 64);
    cparams.n_ubatch        = n_ubatch > 0 ? std::min<int>(n_ubatch, cparams.n_batch) : cparams.n_batch;
    cparams.n_seq_max       = 1;
    cparams.n_threads       = n_threads;
    cparams.n_threads_batch = n_threads;
    cparams.type_k          = type_k;
    cparams.type_v          = type_v;
    cparams.type_k_cross    = type_k_cross;
    cparams.type_v_cross    = type_v_cross;
    cparams.flash_attn_type = fa;
    cparams.no_perf         = true;

    std::map<std::string, int> op_placement;
    tensor_dumper dumper;
    dumper.dir = dump_dir;
    dumper.names = dump_names;
    dumper.dump = !dump_dir.empty();
    dumper.placement = placement ? &op_placement : nullptr;
    if (!dump_dir.empty() || placement) {
        cparams.cb_eval           = tensor_dumper::cb;
        cparams.cb_eval_user_data = &dumper;
    }

    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) {
        fprintf(stderr, "error: failed to create the context\n");
        return 1;
    }

    // positions of the media tokens
    std::vector<llama_pos> media_pos;

    int ret = 0;
    try {
        // cross-attention states of every image
        struct states {
            std::vector<float> data;
            size_t  n_rows;
            int32_t n_valid;
        };
        std::vector<states> cross;

        llama_token media_token = LLAMA_TOKEN_NULL;

        if (!mmproj_path.empty()) {
            mtmd_context_params mp = mtmd_context_params_default();
            mp.use_gpu       = n_gpu_layers != 0;
            mp.n_threads     = n_threads;
            mp.print_timings = false;
            mp.warmup        = false;
            mp.flash_attn_type = fa;
            mp.image_max_tiles = image_max_tiles;
            if (!dump_dir.empty() || placement) {
                mp.cb_eval           = tensor_dumper::cb;
                mp.cb_eval_user_data = &dumper;
            }
            mtmd_context * mctx = mtmd_init_from_file(mmproj_path.c_str(), model, mp);
            if (!mctx) {
                throw std::runtime_error("failed to load " + mmproj_path);
            }
            if (!mtmd_decode_use_cross_attn(mctx)) {
                throw std::runtime_error("the projector does not use cross-attention");
            }
            media_token = mtmd_get_cross_attn_token(mctx);

            for (size_t i = 0; i < images.size(); ++i) {
                auto bmp = mtmd_helper_bitmap_init_from_file(mctx, images[i].c_str(), false, mtmd_helper_init_opt_default());
                if (!bmp.bitmap) {
                    throw std::runtime_error("cannot load image " + images[i]);
                }
                mtmd_input_text text = { mtmd_default_marker(), strlen(mtmd_default_marker()), false, true };
                const mtmd_bitmap * bitmaps[] = { bmp.bitmap };
                mtmd_input_chunks * chunks = mtmd_input_chunks_init();
                if (mtmd_tokenize(mctx, chunks, &text, bitmaps, 1) != 0) {
                    throw std::runtime_error("mtmd_tokenize failed for " + images[i]);
                }
                const mtmd_input_chunk * chunk = nullptr;
                for (size_t c = 0; c < mtmd_input_chunks_size(chunks); ++c) {
                    if (mtmd_input_chunk_get_type(mtmd_input_chunks_get(chunks, c)) == MTMD_INPUT_CHUNK_TYPE_IMAGE) {
                        chunk = mtmd_input_chunks_get(chunks, c);
                    }
                }
                if (!chunk || mtmd_encode_chunk(mctx, chunk) != 0) {
                    throw std::runtime_error("failed to encode " + images[i]);
                }
                int32_t n_valid = 0;
                const int32_t n_rows = mtmd_image_tokens_get_n_cross_rows(mtmd_input_chunk_get_tokens_image(chunk), &n_valid);
                const float * embd = mtmd_get_output_embd(mctx);
                cross.push_back({ std::vector<float>(embd, embd + (size_t) n_rows*n_embd), (size_t) n_rows, n_valid });
                mtmd_input_chunks_free(chunks);
                mtmd_bitmap_free(bmp.bitmap);
            }
            mtmd_free(mctx);
        } else {
            for (size_t i = 0; i < cross_files.size(); ++i) {
                npy_array a = read_npy_f32(cross_files[i]);
                if (a.shape.size() != 2 || (int) a.shape[1] != n_embd) {
                    throw std::runtime_error(cross_files[i] + ": expected shape [n_rows, n_embd]");
                }
                const int32_t n_valid = i < cross_valid.size() ? cross_valid[i] : (int32_t) a.shape[0];
                cross.push_back({ std::move(a.data), a.shape[0], n_valid });
            }
            if (!cross.empty()) {
                // the image token is the first token of the vocabulary that the output layer does not predict,
                // for a model converted from transformers it is <|image|>
                media_token = llama_vocab_n_tokens(vocab) - 1;
                for (int id = 0; id < n_vocab; ++id) {
                    char buf[64];
                    const int n = llama_token_to_piece(vocab, id, buf, sizeof(buf), 0, true);
                    if (n > 0 && std::string(buf, n) == "<|image|>") {
                        media_token = id;
                        break;
                    }
                }
            }
        }

        for (int i = 0; i < n_prompt; ++i) {
            if (tokens[i] == media_token) {
                media_pos.push_back(i);
            }
        }
        if (media_pos.size() != cross.size()) {
            throw std::runtime_error("the number of media tokens (" + std::to_string(media_pos.size()) +
                    ") differs from the number of images (" + std::to_string(cross.size()) + ")");
        }

        for (size_t i = 0; i < cross.size(); ++i) {
            write_npy(out_dir + "/cross_" + std::to_string(i) + ".npy", "<f4", cross[i].data.data(), sizeof(float),
                    { cross[i].n_rows, (size_t) n_embd });
            const llama_embd e = { cross[i].data.data(), cross[i].n_rows, (size_t) n_embd };
            if (llama_cross_attn_add(ctx, 0, media_pos[i], e, cross[i].n_valid) != 0) {
                throw std::runtime_error("llama_cross_attn_add failed");
            }
        }
        {
            std::vector<int32_t> valid;
            for (const auto & c : cross) {
                valid.push_back(c.n_valid);
            }
            write_npy(out_dir + "/cross_valid.npy", "<i4", valid.data(), sizeof(int32_t), { valid.size() });
        }

        // prompt, logits for every position
        llama_batch batch = llama_batch_init(n_prompt, 0, 1);
        for (int i = 0; i < n_prompt; ++i) {
            batch.token[i]     = tokens[i];
            batch.pos[i]       = i;
            batch.n_seq_id[i]  = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i]    = 1;
        }
        batch.n_tokens = n_prompt;
        if (llama_decode(ctx, batch) != 0) {
            throw std::runtime_error("llama_decode failed on the prompt");
        }
        std::vector<float> prompt_logits((size_t) n_prompt*n_vocab);
        for (int i = 0; i < n_prompt; ++i) {
            memcpy(prompt_logits.data() + (size_t) i*n_vocab, llama_get_logits_ith(ctx, i), n_vocab*sizeof(float));
        }
        llama_batch_free(batch);

        dumper.enabled = false;

        if (state_roundtrip) {
            std::vector<uint8_t> state(llama_state_seq_get_size(ctx, 0));
            if (llama_state_seq_get_data(ctx, state.data(), state.size(), 0) != state.size()) {
                throw std::runtime_error("failed to save the sequence state");
            }
            llama_memory_clear(llama_get_memory(ctx), true);
            if (llama_state_seq_set_data(ctx, state.data(), state.size(), 0) != state.size()) {
                throw std::runtime_error("failed to restore the sequence state");
            }
        }

        std::vector<int32_t> out_tokens = { argmax(prompt_logits.data() + (size_t) (n_prompt - 1)*n_vocab, n_vocab) };
        std::vector<float> step_logits((size_t) n_steps*n_vocab);
        for (int s = 0; s < n_steps; ++s) {
            llama_batch b = llama_batch_init(1, 0, 1);
            b.token[0] = out_tokens.back();
            b.pos[0] = n_prompt + s;
            b.n_seq_id[0] = 1;
            b.seq_id[0][0] = 0;
            b.logits[0] = 1;
            b.n_tokens = 1;
            if (llama_decode(ctx, b) != 0) {
                throw std::runtime_error("llama_decode failed at step " + std::to_string(s));
            }
            llama_batch_free(b);
            const float * lg = llama_get_logits_ith(ctx, 0);
            memcpy(step_logits.data() + (size_t) s*n_vocab, lg, n_vocab*sizeof(float));
            out_tokens.push_back(argmax(lg, n_vocab));
        }

        write_npy(out_dir + "/prompt_logits.npy", "<f4", prompt_logits.data(), sizeof(float), { (size_t) n_prompt, (size_t) n_vocab });
        write_npy(out_dir + "/step_logits.npy",   "<f4", step_logits.data(),   sizeof(float), { (size_t) n_steps,  (size_t) n_vocab });
        write_npy(out_dir + "/tokens.npy",        "<i4", out_tokens.data(),    sizeof(int32_t), { out_tokens.size() });
        if (placement) {
            std::ofstream f(out_dir + "/op_placement.tsv");
            for (const auto & [key, count] : op_placement) {
                f << key << "\t" << count << "\n";
            }
            if (!f) {
                throw std::runtime_error("cannot write " + out_dir + "/op_placement.tsv");
            }
        }
    } catch (const std::exception & e) {
        fprintf(stderr, "error: %s\n", e.what());
        ret = 1;
    }

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();

    return ret;
}

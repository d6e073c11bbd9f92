"""llama.cpp (mllama text model + mtmd vision) against transformers on a random tiny Llama 3.2 Vision.

transformers runs with the vision taps patched to Meta's semantics (layer inputs, see mllama.md 3.4), eager
attention and float32; llama.cpp runs the f32 GGUFs with an f32 KV cache and without flash attention, so both
sides compute in float32 and the only differences are rounding: max relative error (max |a - b| / max |b|)
<= 1e-4 on logits and cross-attention states, and identical greedy tokens. The tokens can be required to be
identical because every greedy decision of the reference is asserted not to be a near tie within that bound
(tests.mllama.margins: margin above 2 * TOL * max|logits|; the smallest measured is 3.5e-4 of max|logits|, the
bound 2e-4), so the comparison cannot hinge on a CPU's rounding.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest

from tests.mllama import harness, reference as R, tiny_model as T
from tests.mllama.margins import assert_decisive_chain, assert_same_greedy_chain

TOL = 1e-4
N_STEPS = 8

# the instruct layout: <|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n<|image|>text<|eot_id|>
# <|start_header_id|>assistant<|end_header_id|>\n\n - five tokens precede the image
PROMPT_IMAGE = [T.BOS_ID, T.START_HEADER_ID, 101, T.END_HEADER_ID, 202, T.IMAGE_TOKEN_ID, 40, 41, 42, 43,
                T.EOT_ID, T.START_HEADER_ID, 102, T.END_HEADER_ID, 202]
PROMPT_TEXT = [T.BOS_ID, T.START_HEADER_ID, 101, T.END_HEADER_ID, 202, 40, 41, 42, 43,
               T.EOT_ID, T.START_HEADER_ID, 102, T.END_HEADER_ID, 202]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return T.get()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return R.load_model(model_dir)


@pytest.fixture(scope="module")
def gguf_f32(model_dir, tmp_path_factory) -> tuple[Path, Path]:
    harness.binary("llama-mllama-dump")  # fail early and clearly when the tool is not built
    return harness.convert(model_dir, tmp_path_factory.mktemp("gguf"), "f32")


def make_image(tmp_path: Path, h: int, w: int, seed: int) -> tuple[Path, object]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    path = tmp_path / f"img_{h}x{w}_{seed}.png"
    img.save(path)
    return path, img


def reference_decisions(ref: R.Reference) -> list[tuple[np.ndarray, np.ndarray]]:
    """The greedy decisions of the reference, each with the logits array whose scale the tolerance is taken of:
    the last prompt row (the first token), then every decode step (the following tokens)."""
    return [(ref.prompt_logits[-1], ref.prompt_logits)] + [(row, ref.step_logits) for row in ref.step_logits]


def check(ref: R.Reference, out: harness.Dump, what: str) -> None:
    n_vocab = ref.prompt_logits.shape[1]
    assert_decisive_chain(reference_decisions(ref), TOL, what=what)
    # the tokenizer has one more token than the output layer (<|image|>): its logit must never win
    assert np.all(np.isneginf(out.prompt_logits[:, n_vocab:])), f"{what}: extra logits are not -inf"
    e_prompt = R.rel_err(out.prompt_logits[:, :n_vocab], ref.prompt_logits)
    assert e_prompt <= TOL, f"{what}: prompt logits rel err {e_prompt:.3g}"
    if ref.step_logits.size:
        e_steps = R.rel_err(out.step_logits[:, :n_vocab], ref.step_logits)
        assert e_steps <= TOL, f"{what}: decode-step logits rel err {e_steps:.3g}"
    assert_same_greedy_chain(out.tokens, ref.tokens, reference_decisions(ref), TOL, what=what)


def test_text_only(hf_model, gguf_f32, tmp_path):
    text, _ = gguf_f32
    ref = R.run(hf_model, PROMPT_TEXT, [], n_steps=N_STEPS)
    out = harness.run_dump(text, PROMPT_TEXT, tmp_path, n_steps=N_STEPS)
    check(ref, out, "text-only")


# the last two shrink both axes: 200x61 -> 91x28 makes Pillow (>= 13) run its vertical pass first, 61x200 -> 28x91
# the horizontal one; the 8-bit intermediate image makes the order visible (mtmd follows Pillow's rule)
@pytest.mark.parametrize("h,w,ar_id", [(28, 28, 1), (28, 84, 3), (84, 28, 7), (56, 56, 6), (200, 61, 8), (61, 200, 4)],
                         ids=["1-tile", "ar3-1x3", "ar7-3x1", "ar6-2x2", "ar8-shrink-vertical-first",
                              "ar4-shrink-horizontal-first"])
def test_image(hf_model, gguf_f32, tmp_path, h, w, ar_id):
    text, mmproj = gguf_f32
    path, img = make_image(tmp_path, h, w, seed=h * 100 + w)
    assert int(R.preprocess([img]).aspect_ratio_ids[0, 0]) == ar_id

    ref = R.run(hf_model, PROMPT_IMAGE, [img], n_steps=N_STEPS)
    out = harness.run_dump(text, PROMPT_IMAGE, tmp_path, mmproj=mmproj, images=[path], n_steps=N_STEPS)

    e_cross = R.rel_err(out.cross[0], ref.cross_states)
    assert e_cross <= TOL, f"cross-attention states rel err {e_cross:.3g}"
    check(ref, out, f"image {h}x{w}")


def test_image_upscaled(hf_model, gguf_f32, tmp_path):
    """A 20x20 image is upscaled to one tile (bilinear with antialiasing, PIL semantics)."""
    text, mmproj = gguf_f32
    path, img = make_image(tmp_path, 20, 20, seed=7)
    ref = R.run(hf_model, PROMPT_IMAGE, [img], n_steps=2)
    out = harness.run_dump(text, PROMPT_IMAGE, tmp_path, mmproj=mmproj, images=[path], n_steps=2)
    assert R.rel_err(out.cross[0], ref.cross_states) <= TOL
    check(ref, out, "image 20x20")


def test_two_images(hf_model, gguf_f32, tmp_path):
    """Spans: the text between the images attends the first one only, the text after the second one attends it."""
    text, mmproj = gguf_f32
    p1, img1 = make_image(tmp_path, 28, 56, seed=1)
    p2, img2 = make_image(tmp_path, 56, 28, seed=2)
    ids = [T.BOS_ID, 30, T.IMAGE_TOKEN_ID, 31, 32, 33, T.IMAGE_TOKEN_ID, 34, 35, 36]
    ref = R.run(hf_model, ids, [img1, img2], n_steps=4)
    out = harness.run_dump(text, ids, tmp_path, mmproj=mmproj, images=[p1, p2], n_steps=4)
    n = ref.cross_states.shape[0] // 2
    assert R.rel_err(out.cross[0], ref.cross_states[:n]) <= TOL
    assert R.rel_err(out.cross[1], ref.cross_states[n:]) <= TOL
    check(ref, out, "two images")


def test_text_model_with_reference_states(hf_model, gguf_f32, tmp_path):
    """The text model alone, fed transformers' own cross-attention states (isolates it from the vision side)."""
    text, _ = gguf_f32
    _, img = make_image(tmp_path, 28, 84, seed=3)
    ref = R.run(hf_model, PROMPT_IMAGE, [img], n_steps=N_STEPS)
    states = tmp_path / "states.npy"
    np.save(states, ref.cross_states.astype(np.float32))
    n_valid = R.preprocess([img]).num_tiles[0] * (ref.cross_states.shape[0] // 4)
    out = harness.run_dump(text, PROMPT_IMAGE, tmp_path, cross=[(states, n_valid)], n_steps=N_STEPS)
    check(ref, out, "reference states")


@pytest.mark.parametrize("cache_type,tol", [("f16", 2e-2), ("q8_0", 5e-2)])
def test_cache_types(hf_model, gguf_f32, tmp_path, cache_type, tol):
    """The cross-attention K/V are stored in the context's cache types (here with flash attention, as the
    quantized V cache needs it); the result stays close to the f32 reference."""
    text, mmproj = gguf_f32
    path, img = make_image(tmp_path, 28, 84, seed=5)
    ref = R.run(hf_model, PROMPT_IMAGE, [img], n_steps=2)
    out = harness.run_dump(text, PROMPT_IMAGE, tmp_path, mmproj=mmproj, images=[path], n_steps=2,
                           cache_type=cache_type, flash_attn="on")
    n_vocab = ref.prompt_logits.shape[1]
    err = R.rel_err(out.prompt_logits[:, :n_vocab], ref.prompt_logits)
    assert err <= tol, f"{cache_type} cache: prompt logits rel err {err:.3g}"


# The cross-attention store in its own types (-ctkx/-ctvx; docs/kv-cache.md, "The cross-attention store of mllama"):
# the self-attention cache is f32 (flash attention, on because a quantised V needs it, reads it in f16: the f16 row),
# so the store's rounding is what the types add. Bound: max relative error of the prompt logits (all 15 positions,
# before and after the image) against transformers, measured values in the comments (x86 AVX512). The quantised bytes
# are the reference quantisers' on every build; only the last bits of the f32 K/V fed to them differ between CPUs, so
# 1.5-2x head-room is ample, and every bound is at least 2x below the error of attending another image (0.243,
# test_cross_store_bounds_discriminate): a store that reads the wrong rows or garbage cannot pass.
CROSS_STORE_BOUNDS = {           # measured rel err
    "f16": 2e-3,                 # 0.00093 (the f32 store gives the same: flash attention reads K/V in f16)
    "q8_0": 5e-3,                # 0.0026
    "q4_hqq": 5e-2,              # 0.0323  (q4_0: 0.0363)
    "q4_hqq_128": 5e-2,          # 0.0325
    "tq3_0": 9e-2,               # 0.0578
}
# without the rotation (LLAMA_ATTN_ROT_DISABLE=1); the random model has no outlier channels for the rotation to
# spread, so here it neither helps nor hurts much (q4_hqq is even a little better without it)
CROSS_STORE_BOUNDS_ROT_OFF = {   # measured rel err
    "q4_hqq": 5e-2,              # 0.0279
    "q4_hqq_128": 6e-2,          # 0.0386
    "tq3_0": 1e-1,               # 0.0669
}
CROSS_STORE_IMAGE = (28, 84, 5)  # h, w, seed


@pytest.fixture(scope="module")
def cross_store_ref(hf_model, tmp_path_factory) -> tuple[Path, R.Reference]:
    path, img = make_image(tmp_path_factory.mktemp("img"), *CROSS_STORE_IMAGE)
    return path, R.run(hf_model, PROMPT_IMAGE, [img], n_steps=0)


def logits_err(out: harness.Dump, ref: R.Reference) -> float:
    """Prompt logits only (teacher-forced): a decode step's logits follow the token chosen before it, which a near
    tie can flip (the random model has them at these error levels), and would then compare different prompts."""
    n_vocab = ref.prompt_logits.shape[1]
    return R.rel_err(out.prompt_logits[:, :n_vocab], ref.prompt_logits)


def run_cross_store(gguf_f32, path: Path, tmp_path: Path, cross_type: str,
                    env: dict[str, str] | None = None) -> harness.Dump:
    text, mmproj = gguf_f32
    return harness.run_dump(text, PROMPT_IMAGE, tmp_path, mmproj=mmproj, images=[path], n_steps=0,
                            cache_type="f32", cross_type=cross_type, flash_attn="on", env=env)


@pytest.mark.parametrize("cross_type", list(CROSS_STORE_BOUNDS))
def test_cross_store_types(gguf_f32, cross_store_ref, tmp_path, cross_type):
    path, ref = cross_store_ref
    out = run_cross_store(gguf_f32, path, tmp_path, cross_type)
    rot = cross_type not in ("f16", "f32")   # the pinned tree's rule: quantised types are rotated (heads of 128)
    assert (f"cross-attention store: K ({cross_type}), V ({cross_type}), attn_rot_k = {int(rot)} ({128 if rot else 0}), "
            f"attn_rot_v = {int(rot)} ({64 if rot else 0})") in out.log, out.log[-3000:]
    # the self-attention cache keeps its own type
    assert "K (f32):" in out.log and f"K ({cross_type}): " in out.log, out.log[-3000:]
    err = logits_err(out, ref)
    assert err <= CROSS_STORE_BOUNDS[cross_type], f"cross store {cross_type}: logits rel err {err:.3g}"


@pytest.mark.parametrize("cross_type", list(CROSS_STORE_BOUNDS_ROT_OFF))
def test_cross_store_rotation_off(gguf_f32, cross_store_ref, tmp_path, cross_type):
    path, ref = cross_store_ref
    out = run_cross_store(gguf_f32, path, tmp_path, cross_type, env={"LLAMA_ATTN_ROT_DISABLE": "1"})
    assert "attn_rot_k = 0 (0), attn_rot_v = 0 (0)" in out.log, out.log[-3000:]
    err = logits_err(out, ref)
    assert err <= CROSS_STORE_BOUNDS_ROT_OFF[cross_type], f"cross store {cross_type}, no rotation: rel err {err:.3g}"


# a quantised K without flash attention (V f32): K.Q by ggml_mul_mat on the quantised rows instead of flash attention's
# vec_dot (measured: the same error as with flash attention on, 0.0396 / 0.0212 / 0.0259)
CROSS_STORE_K_ONLY_BOUNDS = {    # measured rel err, flash attention off
    "q4_hqq": 3.5e-2,            # 0.0212
    "q4_hqq_128": 4e-2,          # 0.0259
    "tq3_0": 6e-2,               # 0.0395
}


@pytest.mark.parametrize("k_type", list(CROSS_STORE_K_ONLY_BOUNDS))
def test_cross_store_quantised_k_without_flash_attention(gguf_f32, cross_store_ref, tmp_path, k_type):
    path, ref = cross_store_ref
    text, mmproj = gguf_f32
    out = harness.run_dump(text, PROMPT_IMAGE, tmp_path, mmproj=mmproj, images=[path], cache_type="f32",
                           flash_attn="off", extra=["-ctkx", k_type, "-ctvx", "f32"])
    assert f"K ({k_type}), V (f32), attn_rot_k = 1 (128), attn_rot_v = 0 (0)" in out.log, out.log[-3000:]
    err = logits_err(out, ref)
    assert err <= CROSS_STORE_K_ONLY_BOUNDS[k_type], f"cross store K {k_type}, no flash attention: rel err {err:.3g}"


def test_cross_store_bounds_discriminate(gguf_f32, cross_store_ref, tmp_path):
    """Negative control: the logits with the states of another image (an f32 store) are far outside every bound."""
    _, ref = cross_store_ref
    h, w, seed = CROSS_STORE_IMAGE
    other, _ = make_image(tmp_path, h, w, seed=seed + 1)
    err = logits_err(run_cross_store(gguf_f32, other, tmp_path / "other", "f32"), ref)
    worst = max([*CROSS_STORE_BOUNDS.values(), *CROSS_STORE_BOUNDS_ROT_OFF.values()])
    assert err >= 2 * worst, f"another image gives rel err {err:.3g}, the widest bound is {worst:.3g}"  # measured 0.243


def test_mtmd_cli_answers_like_transformers(hf_model, model_dir, gguf_f32, tmp_path):
    """llama-mtmd-cli end to end (chat template, tokenizer, image marker): its greedy answer about an image is the
    one transformers generates for the same chat."""
    from transformers import AutoTokenizer

    text, mmproj = gguf_f32
    path, img = make_image(tmp_path, 28, 84, seed=11)
    question = "What does the image show?"

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)
    ref = R.run(hf_model, ids, [img], n_steps=7)
    answer = []
    for t in ref.tokens:
        if t in (T.EOT_ID, T.EOS_ID):
            break
        answer.append(t)
    # the CLI runs the graph llama-mllama-dump runs (f32 cache, no flash attention), within TOL of transformers (the
    # tests above): it generates these tokens if no decision up to the end of the answer is a near tie within TOL
    assert_decisive_chain(reference_decisions(ref)[: len(answer) + 1], TOL, what="mtmd-cli answer")
    # the answer of a random model is a few byte-level tokens, not necessarily valid UTF-8: compare the bytes
    expected = T.token_bytes(tok, answer)

    cmd = [str(harness.binary("llama-mtmd-cli")), "-m", str(text), "--mmproj", str(mmproj), "--image", str(path),
           "-p", question, "-n", "8", "--temp", "0", "-t", "2", "-ctk", "f32", "-ctv", "f32", "-fa", "off"]
    p = subprocess.run(cmd, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode(errors="replace")[-3000:]
    assert p.stdout.strip(b"\n") == expected.strip(b"\n")


def test_state_roundtrip(gguf_f32, tmp_path):
    """Saving and restoring the sequence state keeps the attached image (the decode steps do not change)."""
    text, mmproj = gguf_f32
    path, _ = make_image(tmp_path, 28, 84, seed=21)
    a = harness.run_dump(text, PROMPT_IMAGE, tmp_path / "a", mmproj=mmproj, images=[path], n_steps=4)
    b = harness.run_dump(text, PROMPT_IMAGE, tmp_path / "b", mmproj=mmproj, images=[path], n_steps=4,
                         extra=["--state-roundtrip"])
    assert np.array_equal(a.step_logits, b.step_logits)
    assert a.tokens == b.tokens


# --- the tile cap (--image-max-tiles, mtmd_context_params.image_max_tiles) ------------------------------------------
#
# At each cap N the preprocessing must be transformers' MllamaImageProcessor(max_image_tiles=N) (canvas, resize, pad,
# tile split, aspect-ratio mask), the aspect-ratio id the tables' id of the same grid, and the encoder must work on N
# tile slots (reference.py's docstring): on scikit-image's photos, whose canvases at the tiny model's 28-pixel tiles
# are 2x2 (cap 4) down to 1x1 for the astronaut and the cat, and 4x1, 3x1, 2x1, 1x1 for a tall strip of the
# astronaut (the grids whose ids differ between the processor's numbering and the tables').

CAPS = [1, 2, 3, 4]
N_POS = (T.IMAGE_SIZE // T.PATCH_SIZE) ** 2 + 1  # positions of a tile, [CLS] included
# photo -> (tiles high, tiles wide) at caps 1, 2, 3, 4 (MllamaImageProcessor's canvases, asserted below)
PHOTO_GRIDS = {"astronaut": [(1, 1), (1, 1), (1, 1), (2, 2)],
               "chelsea": [(1, 1), (1, 2), (1, 2), (2, 2)],
               "astronaut-strip": [(1, 1), (2, 1), (3, 1), (4, 1)]}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """scikit-image's astronaut (512 x 512) and cat (chelsea, 451 x 300), and a 170 x 512 strip of the astronaut."""
    import skimage.data
    from PIL import Image

    d = tmp_path_factory.mktemp("photos")
    arrays = {"astronaut": skimage.data.astronaut(), "chelsea": skimage.data.chelsea()}
    arrays["astronaut-strip"] = np.ascontiguousarray(arrays["astronaut"][:, 170:340])
    out: dict[str, tuple[Path, object]] = {}
    for name, a in arrays.items():
        img = Image.fromarray(a)
        img.save(d / f"{name}.png")
        out[name] = (d / f"{name}.png", img)
    return out


def patch_embeddings(model, inp: R.ImageInputs) -> np.ndarray:
    """transformers' patch embedding (the 14x14 convolution of the tiny model's 7x7 patches) of the image's own tiles:
    [n_tiles, n_patches, n_embd], as llama.cpp's patch_embd tensor; a function of the preprocessed pixels alone."""
    import torch

    px = torch.from_numpy(inp.pixel_values[0, 0, : inp.num_tiles[0]])
    with torch.no_grad():
        e = model.model.vision_model.patch_embedding(px)
    return e.flatten(2).transpose(1, 2).numpy()


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("photo", list(PHOTO_GRIDS))
def test_image_max_tiles_preprocessing(hf_model, gguf_f32, photos, tmp_path, photo, cap):
    """At each cap: the canvas, the pixels of every tile (resize, pad, split, normalisation: the patch embeddings),
    the valid tiles (the aspect-ratio mask), and the encoder output on cap tile slots (the aspect-ratio id: the
    tile embeddings) are transformers'."""
    import torch

    text, mmproj = gguf_f32
    path, img = photos[photo]
    inp = R.preprocess([img], cap)
    th, tw = PHOTO_GRIDS[photo][cap - 1]
    assert inp.num_tiles == [th * tw] and inp.pixel_values.shape[2] == cap
    assert inp.aspect_ratio_mask[0, 0].tolist() == [1] * (th * tw) + [0] * (cap - th * tw)
    with torch.no_grad(), R.patch_meta_taps(), (R.tile_slots() if cap < R.TABLE_TILES else nullcontext()):
        vis = hf_model.model.vision_model(pixel_values=torch.from_numpy(inp.pixel_values),
                                          aspect_ratio_ids=torch.from_numpy(inp.aspect_ratio_ids),
                                          aspect_ratio_mask=torch.from_numpy(inp.aspect_ratio_mask))
        ref = hf_model.model.multi_modal_projector(vis.last_hidden_state)
    ref = ref.reshape(-1, ref.shape[-1]).numpy()

    dump = tmp_path / "tensors"
    dump.mkdir()
    out = harness.run_dump(text, [T.BOS_ID, T.IMAGE_TOKEN_ID, 40], tmp_path, mmproj=mmproj, images=[path],
                           image_max_tiles=cap, extra=["--dump-tensors", str(dump), "--dump-name", "patch_embd"])
    assert out.cross[0].shape[0] == cap * N_POS, "the cross-attention states are not cap tiles"
    assert out.cross_valid == [th * tw * N_POS]
    ref_px = patch_embeddings(hf_model, inp)
    px = np.load(dump / "patch_embd.npy").reshape(-1, *ref_px.shape[1:])  # (the dump drops leading 1-sized axes)
    e_px = R.rel_err(px[: th * tw], ref_px)
    assert e_px <= TOL, f"{photo}, cap {cap}: patch embeddings rel err {e_px:.3g}"
    e_cross = R.rel_err(out.cross[0], ref)
    assert e_cross <= TOL, f"{photo}, cap {cap}: cross-attention states rel err {e_cross:.3g}"


def test_image_max_tiles_aspect_ratio_ids(hf_model, photos):
    """Negative control of the id conversion: transformers' processor numbers the grids of at most cap tiles, and its
    own id (2x1 at cap 2 is its 3, the tables' 5: the 1x3 row) gives other states, far outside TOL; transformers'
    own embedding modules cannot run 2 tile slots at all with 4-tile tables."""
    import torch

    _, img = photos["astronaut-strip"]
    inp = R.preprocess([img], 2)
    assert int(inp.processor_ids[0, 0]) == 3 and int(inp.aspect_ratio_ids[0, 0]) == 5
    kw = dict(pixel_values=torch.from_numpy(inp.pixel_values), aspect_ratio_mask=torch.from_numpy(inp.aspect_ratio_mask))
    vm = hf_model.model.vision_model
    with torch.no_grad(), R.patch_meta_taps():
        with pytest.raises(RuntimeError):
            vm(aspect_ratio_ids=torch.from_numpy(inp.aspect_ratio_ids), **kw)
        with R.tile_slots():
            ours = vm(aspect_ratio_ids=torch.from_numpy(inp.aspect_ratio_ids), **kw).last_hidden_state.numpy()
            theirs = vm(aspect_ratio_ids=torch.from_numpy(inp.processor_ids), **kw).last_hidden_state.numpy()
    assert R.rel_err(theirs, ours) > 100 * TOL  # measured 1.3


@pytest.mark.parametrize("cap", [1, 3])  # (cap 2: its states in test_image_max_tiles_preprocessing)
def test_image_max_tiles_answers(hf_model, gguf_f32, photos, tmp_path, cap):
    """The text model with the fewer cross-attention states of a cap: logits and greedy tokens as transformers'."""
    text, mmproj = gguf_f32
    path, img = photos["astronaut-strip"]
    ref = R.run(hf_model, PROMPT_IMAGE, [img], n_steps=N_STEPS, max_tiles=cap)
    out = harness.run_dump(text, PROMPT_IMAGE, tmp_path, mmproj=mmproj, images=[path], n_steps=N_STEPS,
                           image_max_tiles=cap)
    assert R.rel_err(out.cross[0], ref.cross_states) <= TOL
    check(ref, out, f"astronaut strip, cap {cap}")


def cli_answer(text: Path, mmproj: Path, image: Path, question: str, *extra: str,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    cmd = [str(harness.binary("llama-mtmd-cli")), "-m", str(text), "--mmproj", str(mmproj), "--image", str(image),
           "-p", question, "-n", "8", "--temp", "0", "-t", "2", "-ctk", "f32", "-ctv", "f32", "-fa", "off", *extra]
    return subprocess.run(cmd, capture_output=True, timeout=120, env={**os.environ, **(env or {})})


def test_mtmd_cli_image_max_tiles(hf_model, model_dir, gguf_f32, photos):
    """llama-mtmd-cli --image-max-tiles 2 (and LLAMA_ARG_IMAGE_MAX_TILES=2) answers like transformers at that cap,
    not like the uncapped model; caps outside 1..4 are clear errors."""
    from transformers import AutoTokenizer

    text, mmproj = gguf_f32
    path, img = photos["astronaut-strip"]
    question = "What does the image show?"
    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)
    expected = {}
    for cap in (2, 4):
        ref = R.run(hf_model, ids, [img], n_steps=7, max_tiles=cap)
        answer = []
        for t in ref.tokens:
            if t in (T.EOT_ID, T.EOS_ID):
                break
            answer.append(t)
        assert_decisive_chain(reference_decisions(ref)[: len(answer) + 1], TOL, what=f"mtmd-cli answer, cap {cap}")
        expected[cap] = T.token_bytes(tok, answer).strip(b"\n")
    assert expected[2] != expected[4], "the cap does not change transformers' answer: choose another image"

    for extra, env in (((  "--image-max-tiles", "2"), None), ((), {"LLAMA_ARG_IMAGE_MAX_TILES": "2"})):
        p = cli_answer(text, mmproj, path, question, *extra, env=env)
        assert p.returncode == 0, p.stderr.decode(errors="replace")[-3000:]
        assert p.stdout.strip(b"\n") == expected[2]

    p = cli_answer(text, mmproj, path, question, "--image-max-tiles", "5")
    assert p.returncode != 0
    assert "image_max_tiles 5 is out of range: this model takes 1 to 4 tiles per image" in p.stderr.decode(errors="replace")
    p = cli_answer(text, mmproj, path, question, "--image-max-tiles", "0")
    assert p.returncode != 0
    assert "--image-max-tiles must be at least 1" in p.stderr.decode(errors="replace")


def test_image_max_tiles_gguf_default(model_dir, gguf_f32, photos, tmp_path):
    """The converter writes the preprocessor's max_image_tiles as clip.vision.image_max_tiles (4 for the tiny model,
    as for Llama 3.2 Vision; 2 from a preprocessor_config.json that says 2), the encoder takes it as the default cap
    (--image-max-tiles may still raise it to the 4 tiles of the tables), and a file without the key (older
    conversions) uses all the tiles of the tables."""
    import json
    import shutil
    import sys

    from gguf_s3d8 import gguf_py

    gguf = gguf_py.series_gguf()

    def image_max_tiles(mmproj: Path) -> int | None:
        field = gguf.GGUFReader(str(mmproj)).get_field("clip.vision.image_max_tiles")
        return None if field is None else int(field.contents())

    def rows(mmproj: Path, out: Path, *cap: int) -> int:
        path, _ = photos["chelsea"]
        d = harness.run_dump(gguf_f32[0], [T.BOS_ID, T.IMAGE_TOKEN_ID, 40], out, mmproj=mmproj, images=[path],
                             image_max_tiles=cap[0] if cap else None)
        return d.cross[0].shape[0] // N_POS

    assert image_max_tiles(gguf_f32[1]) == 4
    assert rows(gguf_f32[1], tmp_path / "default") == 4

    ckpt = tmp_path / "ckpt-2-tiles"
    ckpt.mkdir()
    for f in model_dir.iterdir():  # the weights are linked, the small files copied
        if f.suffix == ".safetensors":
            (ckpt / f.name).symlink_to(f)
        else:
            shutil.copy(f, ckpt / f.name)
    cfg = json.loads((ckpt / "preprocessor_config.json").read_text())
    cfg["max_image_tiles"] = 2
    (ckpt / "preprocessor_config.json").write_text(json.dumps(cfg))
    (tmp_path / "gguf-2-tiles").mkdir()
    _, mmproj2 = harness.convert(ckpt, tmp_path / "gguf-2-tiles", "f32")
    assert image_max_tiles(mmproj2) == 2
    assert rows(mmproj2, tmp_path / "two") == 2
    assert rows(mmproj2, tmp_path / "raised", 4) == 4

    no_key = tmp_path / "mmproj-no-key.gguf"
    script = gguf_py.gguf_py_dir() / "gguf" / "scripts" / "gguf_new_metadata.py"  # imports the tree's gguf-py
    subprocess.run([sys.executable, str(script), "--force", "--remove-metadata", "clip.vision.image_max_tiles",
                    str(mmproj2), str(no_key)], check=True, capture_output=True, timeout=120)
    assert image_max_tiles(no_key) is None
    assert rows(no_key, tmp_path / "no-key") == 4

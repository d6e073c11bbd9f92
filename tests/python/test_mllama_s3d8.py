"""mllama with S3D8 weights: llama.cpp against transformers running the same dequantised weights with the same
int8 activation quantisation (tests/mllama/s3d8_reference.py).

Every weight matrix of the tiny model that S3D8 covers in the real model is S3D8-eligible here; the converter
falls back only for the patch embedding (a 7x7 convolution kernel), which both sides run in f16.

Why the end-to-end bound is not "float rounding": S3D8 quantises every activation row with a bf16 scale
(max|x|/127 rounded to bf16). Two float32 implementations that differ by one ulp in a row maximum can round
that scale to neighbouring bf16 values, which moves the whole row onto another int8 grid: a ~1e-2 relative
change of that matmul's output, which then propagates. So the layer-by-layer check is the strict one: each
vision layer of transformers, fed llama.cpp's input of that layer, must reproduce llama.cpp's output to float
rounding - bit-exact in most layers; a layer may still see a bf16 scale flip of one row, hence 5e-3 (a wrong
weight, permutation, mask or gate gives errors of order 1) - and so must each text layer (self- and
cross-attention, fed the same cross-attention states) - and the S3D8 matmuls themselves are bit-exact
(checked against the codec's integer reference while writing this test); end to end, the results must agree
within the activation-quantisation noise and give the same greedy token at every prompt position where that is not
a near tie within the noise (tests.mllama.margins: margin above 2 * E2E_TOL * max|logits|). The first generated
token alone used to be compared: its margins, 0.04 of max|logits| (image) and 0.04 (text only), lie inside the
noise bound of 0.12, so another CPU's rounding could flip it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.mllama import harness, reference as R, s3d8_reference, tiny_model as T
from tests.mllama.margins import assert_same_argmax

LAYER_TOL = 5e-3     # one layer, same input: float rounding, plus the odd bf16 scale flip
E2E_TOL = 6e-2       # whole model: activation-quantisation noise (see the module docstring)

PROMPT_IMAGE = [T.BOS_ID, T.START_HEADER_ID, 101, T.END_HEADER_ID, 202, T.IMAGE_TOKEN_ID, 40, 41, 42, 43,
                T.EOT_ID, T.START_HEADER_ID, 102, T.END_HEADER_ID, 202]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return T.get()


@pytest.fixture(scope="module")
def gguf_s3d8(model_dir) -> tuple[Path, Path]:
    harness.binary("llama-mllama-dump")
    return harness.convert(model_dir, None, "s3d8")  # cached: an S3D8 conversion takes minutes


@pytest.fixture(scope="module")
def hf_s3d8(model_dir, gguf_s3d8):
    model = R.load_model(model_dir)
    report = s3d8_reference.patch_model(model, model_dir, list(gguf_s3d8))
    return model, report


def make_image(tmp_path: Path, h: int, w: int):
    from PIL import Image

    rng = np.random.default_rng(h * 1000 + w)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    path = tmp_path / f"img_{h}x{w}.png"
    img.save(path)
    return path, img


def test_s3d8_conversion_covers_the_matrices(hf_s3d8):
    _, report = hf_s3d8
    kinds: dict[str, list[str]] = {}
    for name, how in report.items():
        kinds.setdefault(how, []).append(name)
    assert kinds.get("f16 conv") == ["v.patch_embd.weight"], kinds
    assert "f16 matmul" not in kinds, kinds
    assert {"output.weight", "mm.0.weight", "blk.1.cross_attn_k.weight", "v.global.blk.0.ffn_down.weight"} \
        <= set(kinds["s3d8 integer matmul"])
    assert kinds.get("dequantised rows") == ["token_embd.weight"]


@pytest.mark.parametrize("h,w", [(28, 84), (56, 56)], ids=["ar3", "ar6"])
def test_s3d8_vision_layers(hf_s3d8, gguf_s3d8, tmp_path, h, w):
    """Teacher-forced: every local and global vision layer, fed llama.cpp's input, gives llama.cpp's output."""
    import torch
    from transformers.models.mllama.modeling_mllama import _prepare_aspect_ratio_attention_mask

    model, _ = hf_s3d8
    text, mmproj = gguf_s3d8
    path, img = make_image(tmp_path, h, w)
    dump = tmp_path / "tensors"
    dump.mkdir()
    harness.run_dump(text, [T.BOS_ID, T.IMAGE_TOKEN_ID, 40], tmp_path / "out", mmproj=mmproj, images=[path],
                     extra=["--dump-tensors", str(dump)])

    vm = model.model.vision_model
    inp = R.preprocess([img])
    n_pos = (T.IMAGE_SIZE // T.PATCH_SIZE) ** 2 + 1
    n_pad = -(-n_pos // 8) * 8
    mask = _prepare_aspect_ratio_attention_mask(torch.from_numpy(inp.aspect_ratio_mask).reshape(1, -1), n_pos,
                                                n_pad, torch.float32)

    def load(name: str) -> torch.Tensor:
        return torch.from_numpy(np.load(dump / f"{name}.npy")).reshape(1, -1, vm.hidden_size)

    layers = list(vm.transformer.layers) + list(vm.global_transformer.layers)
    n_local = len(vm.transformer.layers)
    with torch.no_grad():
        for il, layer in enumerate(layers):
            x = load("local_inp" if il == 0 else "global_inp" if il == n_local else f"layer_out-{il - 1}")
            y = layer(x, attention_mask=mask)
            err = R.rel_err(load(f"layer_out-{il}").numpy(), y.numpy())
            assert err <= LAYER_TOL, f"vision layer {il}: rel err {err:.3g}"


def test_s3d8_text_layers(hf_s3d8, gguf_s3d8, tmp_path):
    """Teacher-forced text model: every decoder layer (self- and cross-attention) of transformers, fed
    llama.cpp's input of that layer through a forward pre-hook, gives llama.cpp's output of that layer. Both
    sides use the same cross-attention states (transformers', handed to llama.cpp with --cross)."""
    import torch

    model, _ = hf_s3d8
    text, _ = gguf_s3d8
    _, img = make_image(tmp_path, 28, 84)
    ref = R.run(model, PROMPT_IMAGE, [img], n_steps=0)
    states = tmp_path / "states.npy"
    np.save(states, ref.cross_states.astype(np.float32))
    n_valid = R.preprocess([img]).num_tiles[0] * (ref.cross_states.shape[0] // 4)
    dump = tmp_path / "tensors"
    dump.mkdir()
    harness.run_dump(text, PROMPT_IMAGE, tmp_path / "out", cross=[(states, n_valid)],
                     extra=["--dump-tensors", str(dump)])

    layers = model.model.language_model.layers
    n_embd = model.config.text_config.hidden_size

    def load(il: int) -> torch.Tensor:
        return torch.from_numpy(np.load(dump / f"l_out-{il}.npy")).reshape(1, -1, n_embd)

    outputs: dict[int, torch.Tensor] = {}

    def feed(il: int):
        def pre_hook(module, args, kwargs):
            if il == 0:
                return None  # the embeddings: the same dequantised rows on both sides
            x = load(il - 1)
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})
        return pre_hook

    def grab(il: int):
        def hook(module, args, kwargs, out):
            outputs[il] = (out[0] if isinstance(out, tuple) else out).detach()
        return hook

    handles = [h for il, layer in enumerate(layers)
               for h in (layer.register_forward_pre_hook(feed(il), with_kwargs=True),
                         layer.register_forward_hook(grab(il), with_kwargs=True))]
    try:
        R.run(model, PROMPT_IMAGE, [img], n_steps=0)
    finally:
        for h in handles:
            h.remove()
    cross_layers = set(model.config.text_config.cross_attention_layers)
    assert cross_layers and set(outputs) == set(range(len(layers))), sorted(outputs)
    for il in range(len(layers)):
        err = R.rel_err(load(il).numpy(), outputs[il].numpy())
        kind = "cross-attention" if il in cross_layers else "self-attention"
        assert err <= LAYER_TOL, f"text layer {il} ({kind}): rel err {err:.3g}"


def test_s3d8_end_to_end(hf_s3d8, gguf_s3d8, tmp_path):
    model, _ = hf_s3d8
    text, mmproj = gguf_s3d8
    path, img = make_image(tmp_path, 84, 28)
    ref = R.run(model, PROMPT_IMAGE, [img], n_steps=0)
    out = harness.run_dump(text, PROMPT_IMAGE, tmp_path, mmproj=mmproj, images=[path])
    n_vocab = ref.prompt_logits.shape[1]
    e_cross = R.rel_err(out.cross[0], ref.cross_states)
    e_logits = R.rel_err(out.prompt_logits[:, :n_vocab], ref.prompt_logits)
    assert e_cross <= E2E_TOL, f"cross-attention states rel err {e_cross:.3g}"
    assert e_logits <= E2E_TOL, f"prompt logits rel err {e_logits:.3g}"
    # measured: 6 of the 15 positions decisive (margins 0.13-0.31 of max|logits|)
    assert_same_argmax(out.prompt_logits[:, :n_vocab], ref.prompt_logits, E2E_TOL, min_rows=3, what="image prompt")


def test_s3d8_text_only(hf_s3d8, gguf_s3d8, tmp_path):
    model, _ = hf_s3d8
    text, _ = gguf_s3d8
    ids = [T.BOS_ID, T.START_HEADER_ID, 101, T.END_HEADER_ID, 202, 40, 41, 42, 43]
    ref = R.run(model, ids, [], n_steps=0)
    out = harness.run_dump(text, ids, tmp_path)
    n_vocab = ref.prompt_logits.shape[1]
    assert R.rel_err(out.prompt_logits[:, :n_vocab], ref.prompt_logits) <= E2E_TOL
    # measured: 2 of the 9 positions decisive (margins 0.15 and 0.31 of max|logits|)
    assert_same_argmax(out.prompt_logits[:, :n_vocab], ref.prompt_logits, E2E_TOL, min_rows=2, what="text prompt")

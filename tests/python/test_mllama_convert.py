"""The converter on the real Llama 3.2 11B Vision layout, without the weights.

The checkpoint is simulated by the safetensors headers of every Hub tensor (names and shapes of mllama.md
section 4) over a sparse file, so planning the conversion - names, shapes, the three vocabulary sizes, the
per-tensor types, by the series' model classes (``conversion/mllama.py``) as QAT and GPTQ plan with them
(``UpstreamSource.weight_placements``) - is checked for the 11B model in seconds; no tensor data is read.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from convert.upstream_source import UpstreamSource, WeightPlacement

N_TEXT_LAYERS = 40
CROSS = [3, 8, 13, 18, 23, 28, 33, 38]

CONFIG_11B = {
    "architectures": ["MllamaForConditionalGeneration"],
    "image_token_index": 128256,
    "model_type": "mllama",
    "text_config": {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "cross_attention_layers": CROSS,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": 128004,
    },
    "vision_config": {
        "hidden_size": 1280, "attention_heads": 16, "intermediate_size": 5120, "num_hidden_layers": 32,
        "num_global_layers": 8, "intermediate_layers_indices": [3, 7, 15, 23, 30], "vision_output_dim": 7680,
        "image_size": 560, "patch_size": 14, "max_num_tiles": 4, "norm_eps": 1e-5, "num_channels": 3,
        "hidden_act": "gelu",
    },
}


def hub_tensors() -> dict[str, list[int]]:
    t: dict[str, list[int]] = {}
    lm = "language_model.model."
    t[lm + "embed_tokens.weight"] = [128264, 4096]
    t[lm + "norm.weight"] = [4096]
    t["language_model.lm_head.weight"] = [128256, 4096]
    for il in range(N_TEXT_LAYERS):
        p = f"{lm}layers.{il}."
        t[p + "input_layernorm.weight"] = [4096]
        t[p + "post_attention_layernorm.weight"] = [4096]
        t[p + "mlp.gate_proj.weight"] = [14336, 4096]
        t[p + "mlp.up_proj.weight"] = [14336, 4096]
        t[p + "mlp.down_proj.weight"] = [4096, 14336]
        a = "cross_attn" if il in CROSS else "self_attn"
        t[p + f"{a}.q_proj.weight"] = [4096, 4096]
        t[p + f"{a}.o_proj.weight"] = [4096, 4096]
        t[p + f"{a}.k_proj.weight"] = [1024, 4096]
        t[p + f"{a}.v_proj.weight"] = [1024, 4096]
        if il in CROSS:
            t[p + "cross_attn.q_norm.weight"] = [128]
            t[p + "cross_attn.k_norm.weight"] = [128]
            t[p + "cross_attn_attn_gate"] = [1]
            t[p + "cross_attn_mlp_gate"] = [1]
    v = "vision_model."
    t[v + "patch_embedding.weight"] = [1280, 3, 14, 14]
    t[v + "class_embedding"] = [1280]
    t[v + "gated_positional_embedding.embedding"] = [1601, 1280]
    t[v + "gated_positional_embedding.gate"] = [1]
    t[v + "gated_positional_embedding.tile_embedding.weight"] = [9, 8197120]
    for w in ("pre", "post"):
        t[v + f"{w}_tile_positional_embedding.embedding.weight"] = [9, 5120]
        t[v + f"{w}_tile_positional_embedding.gate"] = [1]
        t[v + f"layernorm_{w}.weight"] = [1280]
        t[v + f"layernorm_{w}.bias"] = [1280]
    for enc, n in (("transformer", 32), ("global_transformer", 8)):
        for il in range(n):
            p = f"{v}{enc}.layers.{il}."
            for m in ("q", "k", "v", "o"):
                t[p + f"self_attn.{m}_proj.weight"] = [1280, 1280]
            t[p + "mlp.fc1.weight"] = [5120, 1280]
            t[p + "mlp.fc1.bias"] = [5120]
            t[p + "mlp.fc2.weight"] = [1280, 5120]
            t[p + "mlp.fc2.bias"] = [1280]
            for ln in ("input_layernorm", "post_attention_layernorm"):
                t[p + f"{ln}.weight"] = [1280]
                t[p + f"{ln}.bias"] = [1280]
            if enc == "global_transformer":
                t[p + "gate_attn"] = [1]
                t[p + "gate_ffn"] = [1]
    t["multi_modal_projector.weight"] = [4096, 7680]
    t["multi_modal_projector.bias"] = [4096]
    return t


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("mllama-11b-layout")
    (d / "config.json").write_text(json.dumps(CONFIG_11B))
    (d / "preprocessor_config.json").write_text(json.dumps({
        "size": {"height": 560, "width": 560}, "max_image_tiles": 4, "resample": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    header, off = {}, 0
    for name, shape in hub_tensors().items():
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    (d / "tokenizer.json").write_text("{}")  # the text class wants a tokenizer; planning tensors never reads it
    blob = json.dumps(header).encode()
    path = d / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.truncate(8 + len(blob) + off)  # sparse: the weights are never read
    return d


def _placed(ckpt: Path, out_type: str = "s3d8") -> tuple[dict[str, WeightPlacement], dict[str, WeightPlacement]]:
    """GGUF name -> placement of every checkpoint tensor: the text file's (S3D8) and the vision file's (out_type)."""
    text = UpstreamSource(ckpt).weight_placements("s3d8", "q8_0")
    vision = UpstreamSource(ckpt, mmproj=True).weight_placements(out_type, "q8_0")
    return {p.gguf_name: p for p in text.values()}, {p.gguf_name: p for p in vision.values()}


def test_parameter_count(ckpt):
    text, vision = _placed(ckpt)
    assert len(text) + len(vision) == len(hub_tensors())  # every checkpoint tensor lands in exactly one file
    assert sum(math.prod(p.shape) for p in [*text.values(), *vision.values()]) == 10_670_220_835


def test_text_layout(ckpt):
    jobs, _ = _placed(ckpt)
    # the three vocabulary sizes: embeddings keep their 128264 rows, the output its 128256 rows
    assert jobs["token_embd.weight"].shape == (128264, 4096)
    assert jobs["output.weight"].shape == (128256, 4096)
    for il in range(N_TEXT_LAYERS):
        if il in CROSS:
            assert f"blk.{il}.attn_q.weight" not in jobs
            assert jobs[f"blk.{il}.cross_attn_k.weight"].shape == (1024, 4096)
            assert jobs[f"blk.{il}.cross_attn_k.weight"].rows is None  # no RoPE: HF's row order
            assert jobs[f"blk.{il}.cross_attn_q_norm.weight"].shape == (128,)
            assert jobs[f"blk.{il}.cross_attn_attn_gate"].shape == (1,)
            assert jobs[f"blk.{il}.cross_attn_mlp_gate"].shape == (1,)
        else:
            assert jobs[f"blk.{il}.attn_k.weight"].shape == (1024, 4096)
            rows = jobs[f"blk.{il}.attn_k.weight"].rows  # RoPE: HF's rotate-half rows interleaved per head
            assert rows is not None and list(rows[:4]) == [0, 64, 1, 65] and sorted(rows) == list(range(1024))
            assert f"blk.{il}.cross_attn_q.weight" not in jobs
    assert len(jobs) == 3 + 32 * 9 + 8 * 13


def test_vision_layout(ckpt):
    _, jobs = _placed(ckpt)
    assert jobs["v.tile_position_embd"].shape == (9, 8197120)
    assert jobs["v.position_embd"].shape == (1601, 1280)
    assert jobs["v.global.blk.7.gate_ffn"].shape == (1,)
    assert "v.blk.31.ffn_down.weight" in jobs and "v.blk.32.ffn_down.weight" not in jobs
    assert jobs["mm.0.weight"].shape == (4096, 7680)
    assert all(p.rows is None for p in jobs.values())


@pytest.mark.parametrize("out_type", ["s3d8", "q8_0", "f16"])
def test_types(ckpt, out_type):
    """Big matrices get the requested type; norms, gates, biases and the vision tables stay F32; the patch
    embedding (a convolution kernel) is F16."""
    text, vision = _placed(ckpt, out_type)
    types = {n: p.qtype.name for n, p in vision.items()}
    types.update({n: p.qtype.name for n, p in text.items() if out_type == "s3d8"})
    want = out_type.upper()
    for name, t in types.items():
        if name in ("v.patch_embd.weight",):
            assert t == "F16", (name, t)
        elif name.endswith(".weight") and not name.endswith(("_norm.weight", "ln1.weight", "ln2.weight",
                                                              "_ln.weight")):
            assert t == want, (name, t)
        else:
            assert t == "F32", (name, t)


def test_to_gguf_writes_mmproj(tmp_path):
    """``convert/to_gguf.py --mmproj`` (the users' entry point) writes the same two files as convert.mllama, and
    refuses --mmproj for a model that is not mllama."""
    from convert.to_gguf import main as to_gguf_main
    from tests.mllama import harness, tiny_model

    model = tiny_model.get()
    ref_text, ref_mmproj = harness.convert(model, tmp_path, "f16")
    text, mmproj = tmp_path / "cli-text.gguf", tmp_path / "cli-mmproj.gguf"
    assert to_gguf_main([str(model), "--type", "f16", "-o", str(text), "--mmproj", str(mmproj),
                         "--tokenizer-pre", "llama-bpe", "--no-progress"]) == 0
    assert text.read_bytes() == ref_text.read_bytes()
    assert mmproj.read_bytes() == ref_mmproj.read_bytes()

    not_mllama = tmp_path / "llama"
    not_mllama.mkdir()
    (not_mllama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert to_gguf_main([str(not_mllama), "-o", str(tmp_path / "x.gguf"), "--mmproj", str(tmp_path / "m.gguf")]) == 2
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "m.gguf").exists()

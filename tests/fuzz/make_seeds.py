#!/usr/bin/env python3
"""Write the seed corpora of the fuzz targets (docs/reliability.md, "Fuzzing the loaders"), deterministically.

    python -m tests.fuzz.make_seeds [--out tests/data/fuzz/seeds]

One folder per target:

- ``s3d8-rows``: S3D8 containers: the golden vectors of tests/data/s3d8_golden (read from there by the run
  script, not copied) plus two-slice tensors made of them and a few cut or patched ones.
- ``gguf-model``: a tiny Llama whose ``ffn_down`` is S3D8 (a golden container), everything else F16/F32, and
  variants of it with one hyperparameter or tensor field changed.
- ``mllama-text``: a tiny mllama text model (the structure of tests/mllama's tiny Llama 3.2 Vision, widths
  shrunk, a toy byte-level BPE tokenizer) and variants: block counts, cross-attention layer lists, head counts, vocabulary.
- ``mmproj``: the matching tiny mllama mmproj and variants: image and patch sizes, tile counts, feature
  layers, head counts, projection width. ``mllama-text/tiny.gguf`` and ``mmproj/tiny.gguf`` are also the
  fixed models that the mmproj and image targets load.
- ``image``: small PNG and JPEG files (Pillow), truncated and corrupted ones, and the decompression bombs.

Everything is a function of this file: the same bytes on every run (the random weights are seeded).
"""

from __future__ import annotations

import argparse
import io
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from qat.toy_tokenizer import byte_to_unicode

REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN = REPO_ROOT / "tests" / "data" / "s3d8_golden"
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "fuzz" / "seeds"


def _gguf():
    from gguf_s3d8.gguf_py import series_gguf

    return series_gguf()


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _weights(name: str, shape: tuple[int, ...], dtype=np.float16, scale: float = 0.05) -> np.ndarray:
    """Seeded small random weights; shape in numpy order (rows first)."""
    return (_rng(name).standard_normal(shape) * scale).astype(dtype)


class Model:
    """A GGUF in memory: ordered KV pairs and tensors, written with gguf-py."""

    def __init__(self, arch: str):
        self.arch = arch
        self.kv: dict[str, tuple[Any, Any]] = {}  # key -> (value, GGUFValueType or None)
        self.tensors: dict[str, tuple[np.ndarray, object, tuple[int, ...] | None]] = {}

    def set(self, key: str, value, vtype=None):
        self.kv[key] = (value, vtype)

    def tensor(self, name: str, data: np.ndarray, raw_dtype=None, raw_shape=None):
        self.tensors[name] = (data, raw_dtype, raw_shape)

    def copy(self) -> "Model":
        m = Model(self.arch)
        m.kv = dict(self.kv)
        m.tensors = dict(self.tensors)
        return m

    def write(self, path: Path) -> None:
        gguf = _gguf()
        path.parent.mkdir(parents=True, exist_ok=True)
        w = gguf.GGUFWriter(str(path), arch=self.arch)
        # GGUFWriter writes general.architecture itself; the rest in insertion order
        for key, (value, vtype) in self.kv.items():
            if key == "general.architecture":
                continue
            if vtype is None:
                if isinstance(value, bool):
                    vtype = gguf.GGUFValueType.BOOL
                elif isinstance(value, int):
                    vtype = gguf.GGUFValueType.UINT32
                elif isinstance(value, float):
                    vtype = gguf.GGUFValueType.FLOAT32
                elif isinstance(value, str):
                    vtype = gguf.GGUFValueType.STRING
                elif isinstance(value, (list, tuple)):
                    vtype = gguf.GGUFValueType.ARRAY
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_array(key, list(value))
            else:
                w.add_key_value(key, value, vtype)
        for name, (data, raw_dtype, raw_shape) in self.tensors.items():
            w.add_tensor(name, data, raw_shape=raw_shape, raw_dtype=raw_dtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def _byte_tokens() -> list[str]:
    """The 256 byte tokens of a byte-level BPE vocabulary, in byte order."""
    table = byte_to_unicode()
    return [table[b] for b in range(256)]


MERGES = [("\u0120", "t"), ("h", "e"), ("\u0120t", "he")]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|image|>"]


def _tokenizer_kv() -> list[tuple[str, object, object]]:
    """(key, value, type) of a toy byte-level BPE tokenizer (gpt2 / llama-bpe): 256 byte tokens, 3 merges and
    Llama 3's special tokens, ``<|image|>`` last (mllama's cross-attention token)."""
    gguf = _gguf()
    T = gguf.GGUFValueType
    tokens = _byte_tokens() + [a + b for a, b in MERGES] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)  # NORMAL, CONTROL
    return [
        ("tokenizer.ggml.model", "gpt2", T.STRING),
        ("tokenizer.ggml.pre", "llama-bpe", T.STRING),
        ("tokenizer.ggml.tokens", tokens, T.ARRAY),
        ("tokenizer.ggml.token_type", types, T.ARRAY),
        ("tokenizer.ggml.merges", [f"{a} {b}" for a, b in MERGES], T.ARRAY),
        ("tokenizer.ggml.bos_token_id", tokens.index("<|begin_of_text|>"), T.UINT32),
        ("tokenizer.ggml.eos_token_id", tokens.index("<|eot_id|>"), T.UINT32),
        ("tokenizer.ggml.padding_token_id", tokens.index("<|end_of_text|>"), T.UINT32),
    ]


def _with_tokenizer(m: Model, tok) -> None:
    for key, value, vtype in tok:
        m.set(key, value, vtype)


# --- S3D8 containers -----------------------------------------------------------------------------------

def s3d8_rows(out: Path) -> None:
    special = (GOLDEN / "special.container.u8").read_bytes()
    fitted = (GOLDEN / "fitted.container.u8").read_bytes()
    pad2 = (GOLDEN / "pad2.container.u8").read_bytes()
    seeds = {
        "two-slices.u8": special + fitted,                      # valid: two 48 x 2048 slices
        "mixed-shapes.u8": special + pad2[: len(special)],      # slice 1 of another shape
        "short.u8": special[:-43],                              # one row of bytes short
        "header-only.u8": special[:128],
    }
    bad_version = bytearray(special)
    bad_version[4] = 2
    seeds["version2.u8"] = bytes(bad_version)
    big_n = bytearray(special)
    big_n[12:16] = struct.pack("<I", 0xFFFFFFFF)
    seeds["n-max.u8"] = bytes(big_n)
    for name, data in seeds.items():
        (out / name).write_bytes(data)


# --- the tiny S3D8 Llama -----------------------------------------------------------------------------------

def llama_s3d8(tok) -> Model:
    """1 layer, n_embd 48, 2 heads (1 KV head) of 24, n_ff 2048: ffn_down (k = 2048, n = 48) is S3D8."""
    gguf = _gguf()
    E, F, H, HKV, D = 48, 2048, 2, 1, 24
    n_vocab = next(len(v) for k, v, _ in tok if k == "tokenizer.ggml.tokens")
    m = Model("llama")
    m.set("general.name", "fuzz-s3d8-llama")
    m.set("llama.block_count", 1)
    m.set("llama.context_length", 256)
    m.set("llama.embedding_length", E)
    m.set("llama.feed_forward_length", F)
    m.set("llama.attention.head_count", H)
    m.set("llama.attention.head_count_kv", HKV)
    m.set("llama.rope.freq_base", 10000.0)
    m.set("llama.attention.layer_norm_rms_epsilon", 1e-5)
    m.set("llama.rope.dimension_count", D)
    m.set("llama.vocab_size", n_vocab)
    m.set("general.file_type", 96)
    _with_tokenizer(m, tok)
    m.tensor("token_embd.weight", _weights("tok", (n_vocab, E)))
    m.tensor("output_norm.weight", np.ones(E, np.float32))
    m.tensor("blk.0.attn_norm.weight", np.ones(E, np.float32))
    m.tensor("blk.0.attn_q.weight", _weights("q", (H * D, E), np.float32))
    m.tensor("blk.0.attn_k.weight", _weights("k", (HKV * D, E), np.float32))
    m.tensor("blk.0.attn_v.weight", _weights("v", (HKV * D, E), np.float32))
    m.tensor("blk.0.attn_output.weight", _weights("o", (E, H * D), np.float32))
    m.tensor("blk.0.ffn_norm.weight", np.ones(E, np.float32))
    m.tensor("blk.0.ffn_gate.weight", _weights("gate", (F, E)))
    m.tensor("blk.0.ffn_up.weight", _weights("up", (F, E)))
    down = np.frombuffer((GOLDEN / "special.container.u8").read_bytes(), np.uint8)
    m.tensor("blk.0.ffn_down.weight", down.reshape(E, 43 * F // 128), raw_dtype=gguf.GGMLQuantizationType.S3D8)
    return m


# --- the tiny mllama (text + mmproj) ---------------------------------------------------------------------

TEXT: dict[str, Any] = dict(E=48, F=64, H=2, HKV=1, D=24, layers=3, cross=[1])
VISION: dict[str, Any] = dict(E=32, H=2, layers=2, global_layers=1, image=28, patch=7, tiles=4, feature_layer=[0, 1])


def mllama_text(tok) -> Model:
    gguf = _gguf()
    E, F, H, HKV, D = (TEXT[k] for k in ("E", "F", "H", "HKV", "D"))
    n_vocab = next(len(v) for k, v, _ in tok if k == "tokenizer.ggml.tokens") - 1  # without <|image|>
    m = Model("mllama")
    m.set("general.name", "fuzz-tiny-mllama")
    m.set("mllama.block_count", TEXT["layers"])
    m.set("mllama.context_length", 256)
    m.set("mllama.embedding_length", E)
    m.set("mllama.feed_forward_length", F)
    m.set("mllama.attention.head_count", H)
    m.set("mllama.attention.head_count_kv", HKV)
    m.set("mllama.rope.freq_base", 500000.0)
    m.set("mllama.attention.layer_norm_rms_epsilon", 1e-5)
    m.set("general.file_type", 1)
    m.set("mllama.vocab_size", n_vocab)
    m.set("mllama.rope.dimension_count", D)
    m.set("mllama.attention.cross_attention_layers", TEXT["cross"], gguf.GGUFValueType.ARRAY)
    _with_tokenizer(m, tok)
    m.tensor("rope_freqs.weight", np.ones(D // 2, np.float32))
    m.tensor("token_embd.weight", _weights("tok", (n_vocab + 8, E)))
    for i in range(TEXT["layers"]):
        b = f"blk.{i}"
        if i in TEXT["cross"]:
            m.tensor(f"{b}.cross_attn_k_norm.weight", np.ones(D, np.float32))
            m.tensor(f"{b}.cross_attn_k.weight", _weights(f"{b}k", (HKV * D, E)))
            m.tensor(f"{b}.cross_attn_output.weight", _weights(f"{b}o", (E, H * D)))
            m.tensor(f"{b}.cross_attn_q_norm.weight", np.ones(D, np.float32))
            m.tensor(f"{b}.cross_attn_q.weight", _weights(f"{b}q", (H * D, E)))
            m.tensor(f"{b}.cross_attn_v.weight", _weights(f"{b}v", (HKV * D, E)))
            m.tensor(f"{b}.cross_attn_attn_gate", np.full(1, 0.5, np.float32))
            m.tensor(f"{b}.cross_attn_mlp_gate", np.full(1, 0.5, np.float32))
        else:
            m.tensor(f"{b}.attn_k.weight", _weights(f"{b}k", (HKV * D, E)))
            m.tensor(f"{b}.attn_output.weight", _weights(f"{b}o", (E, H * D)))
            m.tensor(f"{b}.attn_q.weight", _weights(f"{b}q", (H * D, E)))
            m.tensor(f"{b}.attn_v.weight", _weights(f"{b}v", (HKV * D, E)))
        m.tensor(f"{b}.attn_norm.weight", np.ones(E, np.float32))
        m.tensor(f"{b}.ffn_down.weight", _weights(f"{b}down", (E, F)))
        m.tensor(f"{b}.ffn_gate.weight", _weights(f"{b}gate", (F, E)))
        m.tensor(f"{b}.ffn_up.weight", _weights(f"{b}up", (F, E)))
        m.tensor(f"{b}.ffn_norm.weight", np.ones(E, np.float32))
    m.tensor("output.weight", _weights("out", (n_vocab, E)))
    m.tensor("output_norm.weight", np.ones(E, np.float32))
    return m


def mllama_mmproj() -> Model:
    gguf = _gguf()
    E, H = VISION["E"], VISION["H"]
    P, S, T = VISION["patch"], VISION["image"], VISION["tiles"]
    n_pos = (S // P) ** 2 + 1
    n_ratios = 9  # the aspect-ratio ids of up to 4 tiles, + 1
    m = Model("clip")
    m.set("general.type", "mmproj")
    m.set("general.name", "fuzz-tiny-mllama (vision)")
    m.set("general.file_type", 1)
    m.set("clip.projector_type", "mllama")
    m.set("clip.has_vision_encoder", True)
    m.set("clip.use_gelu", True)
    m.set("clip.vision.image_size", S)
    m.set("clip.vision.patch_size", P)
    m.set("clip.vision.embedding_length", E)
    m.set("clip.vision.feed_forward_length", E)
    m.set("clip.vision.block_count", VISION["layers"])
    m.set("clip.vision.global_block_count", VISION["global_layers"])
    m.set("clip.vision.projection_dim", TEXT["E"])
    m.set("clip.vision.attention.head_count", H)
    m.set("clip.vision.attention.layer_norm_epsilon", 1e-5)
    m.set("clip.vision.preproc_max_tiles", T)
    m.set("clip.vision.feature_layer", VISION["feature_layer"], gguf.GGUFValueType.ARRAY)
    m.set("clip.vision.image_mean", [0.48145467, 0.4578275, 0.40821073], gguf.GGUFValueType.ARRAY)
    m.set("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711], gguf.GGUFValueType.ARRAY)
    n_feat = E * (len(VISION["feature_layer"]) + 1)
    m.tensor("mm.0.bias", np.zeros(TEXT["E"], np.float32))
    m.tensor("mm.0.weight", _weights("mm", (TEXT["E"], n_feat)))
    m.tensor("v.class_embd", _weights("cls", (E,), np.float32))
    m.tensor("v.position_embd", _weights("pos", (n_pos, E), np.float32))
    m.tensor("v.position_gate", np.full(1, 0.5, np.float32))
    m.tensor("v.tile_position_embd", _weights("tpos", (n_ratios, n_pos * E * T), np.float32))
    m.tensor("v.patch_embd.weight", _weights("patch", (E, 3, P, P)))
    m.tensor("v.pre_tile_position_embd", _weights("pre", (n_ratios, T * E), np.float32))
    m.tensor("v.pre_tile_position_gate", np.full(1, 0.5, np.float32))
    m.tensor("v.post_tile_position_embd", _weights("post", (n_ratios, T * E), np.float32))
    m.tensor("v.post_tile_position_gate", np.full(1, 0.5, np.float32))
    for ln in ("pre_ln", "post_ln"):
        m.tensor(f"v.{ln}.weight", np.ones(E, np.float32))
        m.tensor(f"v.{ln}.bias", np.zeros(E, np.float32))
    blocks = [f"v.blk.{i}" for i in range(VISION["layers"])]
    blocks += [f"v.global.blk.{i}" for i in range(VISION["global_layers"])]
    for b in blocks:
        if ".global." in b:
            m.tensor(f"{b}.gate_attn", np.full(1, 0.5, np.float32))
            m.tensor(f"{b}.gate_ffn", np.full(1, 0.5, np.float32))
        for ln in ("ln1", "ln2"):
            m.tensor(f"{b}.{ln}.weight", np.ones(E, np.float32))
            m.tensor(f"{b}.{ln}.bias", np.zeros(E, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_up", "ffn_down"):
            m.tensor(f"{b}.{name}.weight", _weights(f"{b}{name}", (E, E)))
        m.tensor(f"{b}.ffn_up.bias", np.zeros(E, np.float32))
        m.tensor(f"{b}.ffn_down.bias", np.zeros(E, np.float32))
    return m


def _variants(base: Model, changes: dict[str, dict[str, object]], out: Path) -> None:
    gguf = _gguf()
    for name, kv in changes.items():
        v = base.copy()
        for key, value in kv.items():
            if value is None:
                v.kv.pop(key, None)
            elif isinstance(value, list):
                v.set(key, value, gguf.GGUFValueType.ARRAY)
            elif isinstance(value, int) and value < 0:
                v.set(key, value, gguf.GGUFValueType.INT32)
            else:
                v.set(key, value, base.kv.get(key, (None, None))[1])
        v.write(out / f"{name}.gguf")


def text_variants(out: Path, base: Model) -> None:
    a = "mllama"
    _variants(base, {
        "blocks-0": {f"{a}.block_count": 0},
        "blocks-2": {f"{a}.block_count": 2},
        "blocks-4": {f"{a}.block_count": 4},
        "blocks-huge": {f"{a}.block_count": 0x7FFFFFFF},
        "cross-none": {f"{a}.attention.cross_attention_layers": None},
        "cross-empty": {f"{a}.attention.cross_attention_layers": []},
        "cross-0": {f"{a}.attention.cross_attention_layers": [0]},
        "cross-2": {f"{a}.attention.cross_attention_layers": [2]},
        "cross-3": {f"{a}.attention.cross_attention_layers": [3]},
        "cross-neg": {f"{a}.attention.cross_attention_layers": [-1]},
        "cross-dup": {f"{a}.attention.cross_attention_layers": [1, 1]},
        "cross-many": {f"{a}.attention.cross_attention_layers": list(range(600))},
        "heads-0": {f"{a}.attention.head_count": 0},
        "heads-3": {f"{a}.attention.head_count": 3},
        "heads-48": {f"{a}.attention.head_count": 48},
        "kvheads-0": {f"{a}.attention.head_count_kv": 0},
        "kvheads-2": {f"{a}.attention.head_count_kv": 2},
        "kvheads-7": {f"{a}.attention.head_count_kv": 7},
        "embd-0": {f"{a}.embedding_length": 0},
        "ff-0": {f"{a}.feed_forward_length": 0},
        "ctx-0": {f"{a}.context_length": 0},
        "rope-0": {f"{a}.rope.dimension_count": 0},
        "rope-odd": {f"{a}.rope.dimension_count": 23},
        "vocab-1": {f"{a}.vocab_size": 1},
        "vocab-big": {f"{a}.vocab_size": 1 << 20},
        "eps-0": {f"{a}.attention.layer_norm_rms_epsilon": 0.0},
        "eps-neg": {f"{a}.attention.layer_norm_rms_epsilon": -1.0},
        "eps-nan": {f"{a}.attention.layer_norm_rms_epsilon": float("nan")},
        "duplicate-token": {"tokenizer.ggml.tokens": _byte_tokens() + ["a"] + SPECIALS[1:]},
        "no-tokens": {"tokenizer.ggml.tokens": None},
        "bos-huge": {"tokenizer.ggml.bos_token_id": 0xFFFFFFF0},
    }, out)


def mmproj_variants(out: Path, base: Model) -> None:
    v = "clip.vision"
    _variants(base, {
        "image-0": {f"{v}.image_size": 0},
        "image-27": {f"{v}.image_size": 27},
        "image-56": {f"{v}.image_size": 56},
        "image-30000": {f"{v}.image_size": 30000},
        "patch-0": {f"{v}.patch_size": 0},
        "patch-5": {f"{v}.patch_size": 5},
        "patch-28": {f"{v}.patch_size": 28},
        "patch-29": {f"{v}.patch_size": 29},
        "tiles-0": {f"{v}.preproc_max_tiles": 0},
        "tiles-1": {f"{v}.preproc_max_tiles": 1},
        "tiles-8": {f"{v}.preproc_max_tiles": 8},
        "tiles-huge": {f"{v}.preproc_max_tiles": 0x7FFFFFFF},
        "tiles-none": {f"{v}.preproc_max_tiles": None},
        "features-empty": {f"{v}.feature_layer": []},
        "features-neg": {f"{v}.feature_layer": [-1, 1]},
        "features-5": {f"{v}.feature_layer": [0, 5]},
        "features-3": {f"{v}.feature_layer": [0, 1, 2]},
        "heads-0": {f"{v}.attention.head_count": 0},
        "heads-3": {f"{v}.attention.head_count": 3},
        "blocks-0": {f"{v}.block_count": 0},
        "blocks-3": {f"{v}.block_count": 3},
        "global-0": {f"{v}.global_block_count": 0},
        "global-2": {f"{v}.global_block_count": 2},
        "proj-64": {f"{v}.projection_dim": 64},
        "embd-0": {f"{v}.embedding_length": 0},
        "mean-short": {f"{v}.image_mean": [0.5]},
        "projector-unknown": {"clip.projector_type": "nonsense"},
        "projector-none": {"clip.projector_type": None},
        "image-size-string": {f"{v}.image_size": "28"},
        "blocks-huge": {f"{v}.block_count": 0x7FFFFFFF},
        "global-huge": {f"{v}.global_block_count": 0x7FFFFFFF},
    }, out)


def model_variants(out: Path, base: Model) -> None:
    a = "llama"
    _variants(base, {
        "ff-1024": {f"{a}.feed_forward_length": 1024},
        "embd-96": {f"{a}.embedding_length": 96},
        "heads-0": {f"{a}.attention.head_count": 0},
        "heads-5": {f"{a}.attention.head_count": 5},
        "kvheads-0": {f"{a}.attention.head_count_kv": 0},
        "blocks-2": {f"{a}.block_count": 2},
    }, out)
    gguf = _gguf()
    # the S3D8 tensor declared with other shapes (the container says 48 x 2048)
    for name, (n, k) in {"down-96": (96, 2048), "down-ineligible": (48, 1024)}.items():
        m = base.copy()
        data = np.frombuffer((GOLDEN / "special.container.u8").read_bytes(), np.uint8)
        data = np.resize(data, n * 43 * k // 128).reshape(n, 43 * k // 128)
        m.tensor("blk.0.ffn_down.weight", data, raw_dtype=gguf.GGMLQuantizationType.S3D8)
        m.write(out / f"{name}.gguf")
    m = base.copy()
    zeros = np.frombuffer((GOLDEN / "zeros.container.u8").read_bytes(), np.uint8).reshape(48, 688)
    m.tensor("blk.0.ffn_down.weight", zeros, raw_dtype=gguf.GGMLQuantizationType.S3D8)
    m.write(out / "down-zeros.gguf")


# --- images --------------------------------------------------------------------------------------------

def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def png_bomb(width: int, height: int, idat: bytes) -> bytes:
    """A PNG whose header claims width x height RGB pixels, with the given (compressed) image data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b"")


def jpeg_bomb(width: int, height: int) -> bytes:
    """A small baseline JPEG whose frame header (SOF0) is patched to claim width x height pixels."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (120, 30, 200)).save(buf, "JPEG", quality=50)
    data = bytearray(buf.getvalue())
    sof = data.find(b"\xff\xc0")
    assert sof > 0, "no SOF0 marker"
    data[sof + 5: sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def images(out: Path) -> None:
    from PIL import Image

    rng = _rng("images")
    pixels = rng.integers(0, 256, (20, 28, 3), dtype=np.uint8)
    img = Image.fromarray(pixels, "RGB")
    files: dict[str, bytes] = {}
    for fmt, ext, kw in (("PNG", "png", {}), ("JPEG", "jpg", {"quality": 75}),
                         ("JPEG", "progressive.jpg", {"quality": 75, "progressive": True}),
                         ("BMP", "bmp", {}), ("GIF", "gif", {})):
        buf = io.BytesIO()
        img.save(buf, fmt, **kw)
        files[f"small.{ext}"] = buf.getvalue()
    # a top-down BMP (negative height in the header, rows stored first to last), which the pixel bounds must
    # count with the absolute height
    bmp = bytearray(files["small.bmp"])
    bmp[22:26] = (-pixels.shape[0]).to_bytes(4, "little", signed=True)
    files["small.top-down.bmp"] = bytes(bmp)
    for ext, compression in (("tga", None), ("rle.tga", "tga_rle")):
        buf = io.BytesIO()
        img.save(buf, "TGA", compression=compression)
        files[f"small.{ext}"] = buf.getvalue()
    buf = io.BytesIO()
    img.save(buf, "PPM")
    files["small.ppm"] = buf.getvalue()
    # the densest legitimate run-length TGA (one colour: 128-pixel packets of 4 bytes, 32 pixels per byte) must
    # still decode next to the truncated-file check (more than 128 pixels per byte of file is refused)
    buf = io.BytesIO()
    Image.new("RGB", (1024, 64), (10, 200, 30)).save(buf, "TGA", compression="tga_rle")
    files["solid-rle.tga"] = buf.getvalue()
    buf = io.BytesIO()
    img.convert("L").save(buf, "PNG")
    files["gray.png"] = buf.getvalue()
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (9, 5, 4), dtype=np.uint8), "RGBA").save(buf, "PNG")
    files["rgba.png"] = buf.getvalue()
    buf = io.BytesIO()
    img.convert("P").save(buf, "PNG")
    files["palette.png"] = buf.getvalue()
    buf = io.BytesIO()
    Image.new("RGB", (1, 300)).save(buf, "PNG")
    files["tall.png"] = buf.getvalue()
    for name in ("small.png", "small.jpg"):
        data = files[name]
        files[f"truncated-half.{name}"] = data[: len(data) // 2]
        files[f"truncated-header.{name}"] = data[:40]
    # stb_image itself refuses a decoded size over 2^31 bytes ("too large": 30000 x 30000 RGB); 26000 x 26000
    # (1.9 GiB decoded) and 16384 x 16384 pass that check, and stb's JPEG decoder fills the missing data with zeros
    for side in (30000, 26000, 16384):
        files[f"bomb-{side}.png"] = png_bomb(side, side, zlib.compress(b"\0" * 65536, 9))
        files[f"bomb-{side}.jpg"] = jpeg_bomb(side, side)
    files["tall-1x30000.jpg"] = jpeg_bomb(1, 30000)
    for name, data in files.items():
        (out / name).write_bytes(data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    out: Path = args.out
    tok = _tokenizer_kv()
    dirs = {name: out / name for name in ("s3d8-rows", "gguf-model", "mllama-text", "mmproj", "image")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
        for f in d.iterdir():
            f.unlink()
    s3d8_rows(dirs["s3d8-rows"])
    base = llama_s3d8(tok)
    base.write(dirs["gguf-model"] / "tiny.gguf")
    model_variants(dirs["gguf-model"], base)
    text = mllama_text(tok)
    text.write(dirs["mllama-text"] / "tiny.gguf")
    text_variants(dirs["mllama-text"], text)
    mmproj = mllama_mmproj()
    mmproj.write(dirs["mmproj"] / "tiny.gguf")
    mmproj_variants(dirs["mmproj"], mmproj)
    images(dirs["image"])
    for name, d in dirs.items():
        files = sorted(d.iterdir())
        print(f"{name}: {len(files)} seeds, {sum(f.stat().st_size for f in files)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

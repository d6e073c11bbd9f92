"""Random tiny Llama 3.2 Vision ("mllama") checkpoints for the parity tests.

The recipe follows the shared spec (mllama.md section 6) with two changes the tests need:

* every weight matrix that S3D8 would cover in the real 11B model is at least 1024 wide and of an
  S3D8-eligible shape (text hidden 1152, ffn 1280, kv 3 x 128 rows; vision hidden 1280; projector
  3840 -> 1152), so the same checkpoint exercises the S3D8 path;
* every scalar gate, every norm weight/bias and the tile tables are randomised, otherwise tanh(0) = 0
  switches whole branches off and all-ones norm weights hide wrong-tensor bugs.

A small byte-level BPE tokenizer (256 byte tokens + merges + the Llama-3 special tokens, ``<|image|>``
right after the text vocabulary, as in the real model) makes the checkpoint usable end to end.

Models are written once per configuration into a cache directory (``$S3D8_CACHE`` or ``<repo>/.cache``)
under a name derived from the configuration hash; creation is atomic (temporary folder + rename).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

#: Token ids of the toy tokenizer (text vocabulary = 504 ids, image token = 504, embeddings = 512 rows; both
#: the output and the embedding matrices are S3D8-eligible at these sizes).
N_BPE = 496
SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>", "<|finetune_right_pad_id|>", "<|eom_id|>", "<|python_tag|>",
]
VOCAB_SIZE = N_BPE + len(SPECIAL_TOKENS)  # 504
BOS_ID = N_BPE + 0
EOS_ID = N_BPE + 1
START_HEADER_ID = N_BPE + 2
END_HEADER_ID = N_BPE + 3
EOT_ID = N_BPE + 4
PAD_ID = N_BPE + 5
IMAGE_TOKEN_ID = VOCAB_SIZE  # 504

IMAGE_SIZE = 28
PATCH_SIZE = 7
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["MllamaForConditionalGeneration"],
    "image_token_index": IMAGE_TOKEN_ID,
    "text_config": {
        "vocab_size": VOCAB_SIZE, "hidden_size": 1152, "intermediate_size": 1280, "num_hidden_layers": 5,
        "cross_attention_layers": [1, 3], "num_attention_heads": 9, "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        "bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID], "pad_token_id": PAD_ID,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE, "num_channels": 3, "hidden_size": 1280,
        "attention_heads": 10, "intermediate_size": 1280, "num_hidden_layers": 2, "num_global_layers": 1,
        "intermediate_layers_indices": [0, 1], "vision_output_dim": 3840, "max_num_tiles": 4, "norm_eps": 1e-5,
    },
}

#: A smaller variant for the QAT pipeline test (a few training steps must take seconds): the widths of TINY_CONFIG
#: (S3D8 needs k % 128 == 0 and enough rows of slack for its header) with 2 text layers (one cross-attention) and
#: one local + one global vision layer (one tap).
QAT_CONFIG: dict[str, Any] = copy.deepcopy(TINY_CONFIG)
QAT_CONFIG["text_config"].update({"num_hidden_layers": 2, "cross_attention_layers": [1]})
QAT_CONFIG["vision_config"].update({"num_hidden_layers": 1, "intermediate_layers_indices": [0],
                                    "vision_output_dim": 2560})

# bump when the recipe (not the config) changes, so cached checkpoints are rebuilt
_RECIPE_VERSION = 2

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What does the image show? The image shows a red square on a blue background.",
    "Describe this picture in one sentence, please.",
    "A cat sits on the mat; a dog sleeps in the sun.",
    "user assistant system image picture photo color shape left right top bottom",
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ?",
] * 4 + [
    # deterministic pseudo-words, enough distinct pairs for the merges
    " ".join("".join(chr(97 + (i * 7 + j * 13 + k * 3) % 26) for k in range(2 + (i + j) % 5)) for j in range(40))
    for i in range(40)
]


def cache_root() -> Path:
    env = os.environ.get("S3D8_CACHE")
    root = Path(env) if env else REPO_ROOT / ".cache"
    if not root.is_absolute():
        root = REPO_ROOT / root
    return root / "mllama"


def config_hash(cfg: dict[str, Any], seed: int) -> str:
    blob = json.dumps({"cfg": cfg, "seed": seed, "v": _RECIPE_VERSION}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def build_tokenizer():
    """A deterministic byte-level BPE tokenizer with Llama-3 style special tokens and ``<|image|>``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # the Llama 3 split regex followed by the byte-level mapping (what llama.cpp's "llama-bpe" does)
    llama3_regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(llama3_regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=N_BPE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    if tok.get_vocab_size() != N_BPE:
        raise RuntimeError(f"toy BPE has {tok.get_vocab_size()} tokens, expected {N_BPE}")
    tok.add_special_tokens(SPECIAL_TOKENS + ["<|image|>"])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>")
    fast.chat_template = CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids("<|image|>") == IMAGE_TOKEN_ID
    assert fast.convert_tokens_to_ids("<|begin_of_text|>") == BOS_ID
    return fast


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map of byte-level BPE vocabularies (the 256 byte tokens)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def token_bytes(tok, ids: list[int]) -> bytes:
    """The bytes that tokens of a byte-level BPE tokenizer (this module's toy one) stand for, through GPT-2's
    byte <-> printable character map; the answer of a random model need not be valid UTF-8, so tests compare bytes."""
    byte_of = {c: b for b, c in byte_to_unicode().items()}
    return b"".join(bytes(byte_of[c] for c in piece) for piece in tok.convert_ids_to_tokens(ids))


def image_processor():
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    return MllamaImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, max_image_tiles=4,
                                   image_mean=IMAGE_MEAN, image_std=IMAGE_STD)


def _randomise(model, seed: int) -> None:
    """Random gates, norm weights/biases and tile tables (see the module docstring)."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name and p.numel() == 1:
                p.copy_(torch.empty(1).uniform_(-1.2, 1.2, generator=g))
            elif "norm" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name and name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("fc1.bias", "fc2.bias", "multi_modal_projector.bias")):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif "tile_positional_embedding.embedding" in name or "tile_embedding" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))


def build(out_dir: Path, cfg: dict[str, Any] = TINY_CONFIG, seed: int = 0) -> Path:
    """Write a random tiny mllama checkpoint (safetensors f32, config, tokenizer, preprocessor) to out_dir."""
    import torch
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    torch.manual_seed(seed)
    conf = MllamaConfig(**{k: v for k, v in copy.deepcopy(cfg).items() if k != "architectures"})
    model = MllamaForConditionalGeneration(conf).eval()
    _randomise(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer().save_pretrained(out_dir)
    image_processor().save_pretrained(out_dir)
    # the converter reads the chat template from tokenizer_config.json
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["chat_template"] = CHAT_TEMPLATE
    tc_path.write_text(json.dumps(tc, indent=1))
    return out_dir


def get(cfg: dict[str, Any] = TINY_CONFIG, seed: int = 0) -> Path:
    """The cached checkpoint directory for (cfg, seed), built on first use."""
    root = cache_root()
    path = root / f"tiny-mllama-{config_hash(cfg, seed)}"
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-mllama-", dir=root))
    try:
        build(tmp, cfg, seed)
        try:
            os.replace(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():  # lost a race to another process: theirs is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    import sys

    print(get() if len(sys.argv) < 2 else build(Path(sys.argv[1])))

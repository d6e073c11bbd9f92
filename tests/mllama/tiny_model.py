"""Random tiny Llama 3.2 Vision ("mllama") checkpoints for the parity tests.

The recipe follows the shared spec (mllama.md section 6) with two changes the tests need:

* every weight matrix that S3D8 would cover in the real 11B model is at least 1024 wide and of an
  S3D8-eligible shape (text hidden 1152, ffn 1280, kv 3 x 128 rows; vision hidden 1280; projector
  3840 -> 1152), so the same checkpoint exercises the S3D8 path;
* every scalar gate, every norm weight/bias and the tile tables are randomised, otherwise tanh(0) = 0
  switches whole branches off and all-ones norm weights hide wrong-tensor bugs.

The toy byte-level BPE tokenizer of ``qat.toy_tokenizer`` (256 byte tokens + merges + the Llama-3 special
tokens, ``<|image|>`` right after the text vocabulary, as in the real model; its names are re-exported here)
makes the checkpoint usable end to end.

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

from qat.toy_tokenizer import (BOS_ID, CHAT_TEMPLATE, END_HEADER_ID, EOS_ID, EOT_ID, IMAGE_TOKEN_ID,  # noqa: F401
                               N_BPE, PAD_ID, SPECIAL_TOKENS, START_HEADER_ID, VOCAB_SIZE, build_tokenizer,
                               byte_to_unicode, token_bytes)

REPO_ROOT = Path(__file__).resolve().parents[2]

IMAGE_SIZE = 28
PATCH_SIZE = 7
IMAGE_MEAN = [0.48145466, 0.4578275, 0.40821073]
IMAGE_STD = [0.26862954, 0.26130258, 0.27577711]

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

def cache_root() -> Path:
    env = os.environ.get("S3D8_CACHE")
    root = Path(env) if env else REPO_ROOT / ".cache"
    if not root.is_absolute():
        root = REPO_ROOT / root
    return root / "mllama"


def config_hash(cfg: dict[str, Any], seed: int) -> str:
    blob = json.dumps({"cfg": cfg, "seed": seed, "v": _RECIPE_VERSION}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def image_processor(image_size: int = IMAGE_SIZE, max_image_tiles: int = 4):
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    return MllamaImageProcessorPil(size={"height": image_size, "width": image_size}, max_image_tiles=max_image_tiles,
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
    image_processor(cfg["vision_config"]["image_size"]).save_pretrained(out_dir)
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

"""Tiny random HF checkpoints, for tests and demos of the converter.

* :func:`write_tiny_llama`: a Llama written tensor by tensor (numpy, no torch), reusing a real tokenizer (by default
  the SmolLM2 export's, see ``convert.assets``); shapes are chosen by the caller, which makes it easy to build
  checkpoints with NaN weights, odd shapes or broken files.
* :func:`write_tiny_hf_model`: any architecture of :data:`TINY_ARCHITECTURES` (Llama, Mistral, Qwen2, Gemma 3),
  built and saved by transformers itself; :func:`train_sentencepiece` makes a SentencePiece tokenizer for them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def llama_tensors(*, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                  tied: bool = True, seed: int = 0, head_dim: int | None = None,
                  std: float = 0.02) -> dict[str, np.ndarray]:
    """HF-named float32 weights of a LlamaForCausalLM (matrices with std ``std``, norms around 1);
    ``head_dim`` defaults to hidden / heads."""
    rng = np.random.default_rng(seed)
    hd = head_dim or hidden // heads

    def mat(n: int, k: int) -> np.ndarray:
        return (rng.standard_normal((n, k)) * std).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(vocab, hidden),
                                "model.norm.weight": (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)}
    if not tied:
        t["lm_head.weight"] = mat(vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        t[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        t[p + "self_attn.q_proj.weight"] = mat(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = mat(kv_heads * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = mat(kv_heads * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = mat(hidden, heads * hd)
        t[p + "mlp.gate_proj.weight"] = mat(ffn, hidden)
        t[p + "mlp.up_proj.weight"] = mat(ffn, hidden)
        t[p + "mlp.down_proj.weight"] = mat(hidden, ffn)
    return t


def write_tiny_llama(out_dir: Path, tokenizer_dir: Path, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                     kv_heads: int = 2, ffn: int = 128, vocab: int = 49152, tied: bool = True, seed: int = 0,
                     rope: dict[str, Any] | None = None, tensors: dict[str, np.ndarray] | None = None,
                     config_overrides: dict[str, Any] | None = None) -> Path:
    """Write config.json, model.safetensors and the tokenizer files of a tiny Llama into ``out_dir``.

    ``tensors`` replaces the random weights (e.g. to plant a NaN); ``rope`` is the ``rope_parameters``
    entry (default: plain RoPE, theta 10000).
    """
    from safetensors.numpy import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = llama_tensors(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn,
                                vocab=vocab, tied=tied, seed=seed)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": rope or {"rope_theta": 10000.0, "rope_type": "default"}, "dtype": "float32",
    }
    cfg.update(config_overrides or {})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


# ---------------------------------------------------------------------------------------------------
# any architecture upstream converts, built by transformers itself

#: Tiny configurations (transformers config class, model_type, sizes) whose matrices all have
#: k % 128 == 0, so that every one of them can be S3D8 (``gguf_s3d8.s3d8_ineligibility``).
TINY_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"model_type": "llama", "head_dim": 64},
    "MistralForCausalLM": {"model_type": "mistral", "head_dim": 64, "sliding_window": None},
    "Qwen2ForCausalLM": {"model_type": "qwen2", "use_sliding_window": False},
    "Gemma3ForCausalLM": {"model_type": "gemma3_text", "head_dim": 64, "sliding_window": 64,
                          "query_pre_attn_scalar": 64, "layer_types": ["sliding_attention", "full_attention"]},
}


def write_tiny_hf_model(out_dir: Path, architecture: str, tokenizer_dir: Path, *, vocab: int, hidden: int = 256,
                        layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 512, tied: bool = True,
                        seed: int = 0, bos_token_id: int = 1, eos_token_id: int = 2) -> Path:
    """An HF checkpoint of ``architecture`` (a key of :data:`TINY_ARCHITECTURES`) with random weights, saved by
    transformers' ``save_pretrained`` (its own names, shapes and config), plus the tokenizer files of
    ``tokenizer_dir`` (needs torch)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_ARCHITECTURES[architecture])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                               max_position_embeddings=2048, tie_word_embeddings=tied, bos_token_id=bos_token_id,
                               eos_token_id=eos_token_id, pad_token_id=None, **spec)
    cfg.architectures = [architecture]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # norms around their neutral value (Gemma: stored minus one)
                p.copy_((0.0 if model_type.startswith("gemma") else 1.0) + 0.1 * torch.randn_like(p))
            elif p.ndim >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.normal_(0.0, 0.01)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens_map")) or f.name == "chat_template.jinja"):
            shutil.copy(f, out_dir / f.name)
    return out_dir


def train_sentencepiece(text: str, out_dir: Path, *, vocab_size: int = 1000, model_type: str = "bpe") -> Path:
    """A SentencePiece tokenizer (``tokenizer.model`` + ``tokenizer_config.json``, Llama 2 / Mistral style: byte
    fallback, ``<unk>``/``<s>``/``</s>`` = 0/1/2) trained on ``text``, in ``out_dir``."""
    import sentencepiece as spm

    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(out_dir / "tokenizer"), vocab_size=vocab_size,
                                   model_type=model_type, byte_fallback=True, character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
                                   input_sentence_size=200000, shuffle_input_sentence=False)
    corpus.unlink()
    (out_dir / "tokenizer.vocab").unlink(missing_ok=True)
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=1) + "\n")
    return out_dir


def train_byte_level_bpe(text: str, out_dir: Path, *, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer (GPT-2 style ``tokenizer.json`` + ``tokenizer_config.json``; ``<|endoftext|>`` = 0,
    also BOS and EOS) trained on ``text`` with the ``tokenizers`` package, in ``out_dir``. Its probe encoding
    matches none of upstream's known pre-tokenizers: a conversion names one with ``--tokenizer-pre``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "add_bos_token": False}, indent=1) + "\n")
    return out_dir

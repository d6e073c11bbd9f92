"""A tiny random Llama teacher and a hand-made JSONL of samples, for the QAT tests and quick demos.

Widths are chosen so that both S3D8 and the Q8_0 fallback occur (k = 1024: q/k/v (384/192 rows), gate/up
(384 rows) and the tied 768-row embedding are S3D8-eligible; o_proj and down_proj (k = 384) are not; head_dim 96),
and the q/k RoPE row permutation touches S3D8 matrices. The tokenizer is the toy byte-level BPE of ``qat.toy_tokenizer`` (505 ids).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 1024, 4, 2, 96, 384, 768


def write_teacher(out_dir: Path, *, layers: int = 1, seed: int = 0) -> Path:
    """config.json, model.safetensors (fp32) and tokenizer files of the tiny teacher in ``out_dir``."""
    from convert.synthetic import llama_tensors, write_tiny_llama
    from qat.toy_tokenizer import build_tokenizer

    t = llama_tensors(hidden=HIDDEN, layers=layers, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, vocab=VOCAB, tied=True,
                      seed=seed, head_dim=HEAD_DIM, std=0.03)
    tok_dir = out_dir / "tokenizer"
    build_tokenizer().save_pretrained(tok_dir)
    return write_tiny_llama(out_dir, tok_dir, hidden=HIDDEN, layers=layers, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN,
                            vocab=VOCAB, tied=True, tensors=t, config_overrides={"head_dim": HEAD_DIM})


_WORDS = "the cat sat on a mat and looked at the red ball while birds sang in old green trees".split()


def write_samples(path: Path, n: int = 8, seed: int = 0) -> Path:
    """``n`` text-only samples in the qat.data JSONL schema (chat and plain templates, both finish reasons)."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        prompt = " ".join(rng.choice(_WORDS, int(rng.integers(3, 8)))) + "?\n"
        chat = i % 2 == 0
        prompt_text = (f"<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n") if chat else f"<|begin_of_text|>{prompt}"
        response = " ".join(rng.choice(_WORDS, int(rng.integers(6, 20))))
        lines.append(json.dumps({"id": i, "seed": seed, "image": None, "template": "chat" if chat else "plain",
                                 "prompt": prompt, "prompt_text": prompt_text, "response": response,
                                 "finish_reason": "stop" if i % 3 else "length", "teacher": "tiny"}))
    path.write_text("\n".join(lines) + "\n")
    return path

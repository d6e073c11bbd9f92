"""Tokenizer metadata for byte-level BPE ("gpt2") tokenizers, as llama.cpp expects it.

Written keys: ``tokenizer.ggml.model`` = ``gpt2``, ``tokenizer.ggml.pre`` (which pre-tokenizer regex
llama.cpp applies), ``tokens``, ``token_type`` and - via gguf-py's ``SpecialVocab`` - ``merges``,
special-token ids, ``add_*_token`` flags and the chat template.

The token list comes from the HF tokenizer (transformers ``AutoTokenizer``) with llama.cpp's conventions:
ids without a token become ``[PAD<id>]`` (UNUSED); added tokens are CONTROL when special (or when they
look like ``<|...|>``) and USER_DEFINED otherwise, and non-normalised added tokens are stored in their
normalised spelling (encode + decode), because llama.cpp matches added tokens on normalised text.

``tokenizer.ggml.pre`` cannot be read from the tokenizer files; like upstream we identify the
pre-tokenizer by hashing the token ids the tokenizer produces for a fixed probe text. Only the families
this project converts are listed; anything else must be named with ``--tokenizer-pre``.
"""

from __future__ import annotations

from hashlib import sha256
from pathlib import Path
from typing import Any

import gguf

from .errors import ConvertError, read_json

# Probe text (from llama.cpp's convert_hf_to_gguf_update.py): whitespace runs, emoji, digit groups,
# scripts and contractions - everything where pre-tokenizers differ. Hashing the ids of its encoding
# gives the same identifier upstream uses.
_PROBE_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ "
    "🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
    "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)

#: sha256(str(ids of the probe text)) -> llama.cpp pre-tokenizer name, for the supported families.
KNOWN_PRE_TOKENIZERS: dict[str, str] = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Llama 3 / 3.1 / 3.2
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM / SmolLM2
}


def _looks_special(token: str) -> bool:
    """Added tokens some models forget to flag as special (llama.cpp treats these as CONTROL)."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _load_tokenizer(model_dir: Path) -> Any:
    if (model_dir / "tokenizer.model").is_file() and not (model_dir / "tokenizer.json").is_file():
        raise ConvertError(f"{model_dir}: SentencePiece tokenizers (tokenizer.model) are not supported; "
                           "this converter handles byte-level BPE tokenizers (tokenizer.json)")
    if not (model_dir / "tokenizer.json").is_file():
        raise ConvertError(f"{model_dir}: tokenizer.json is missing (needed for the GGUF vocabulary)")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise ConvertError(f"{model_dir}: cannot load the tokenizer: {type(e).__name__}: {e}") from e


def detect_pre_tokenizer(tokenizer: Any) -> str | None:
    """llama.cpp's name for the tokenizer's pre-tokenizer, or None when it is not a known family."""
    ids = tokenizer.encode(_PROBE_TEXT)
    return KNOWN_PRE_TOKENIZERS.get(sha256(str(ids).encode()).hexdigest())


def bpe_vocab(model_dir: Path, vocab_size: int | None) -> tuple[list[str], list[int], Any]:
    """Token strings and llama.cpp token types for ids ``0..vocab_size-1``, plus the tokenizer."""
    tok = _load_tokenizer(model_dir)
    vocab: dict[str, int] = tok.vocab
    n = vocab_size if vocab_size is not None else len(vocab)
    if max(vocab.values()) >= n:
        raise ConvertError(f"{model_dir}: tokenizer has ids up to {max(vocab.values())} but vocab_size is {n}")
    by_id = {i: t for t, i in vocab.items()}
    added: dict[str, int] = tok.get_added_vocab()
    added_decoder = tok.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for i in range(n):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        if t in added:
            if not added_decoder[i].normalized:
                t = tok.decode(tok.encode(t, add_special_tokens=False))
            if added_decoder[i].special or _looks_special(t):
                types.append(int(gguf.TokenType.CONTROL))
            else:
                t = t.replace("\u2581", " ")
                types.append(int(gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
        tokens.append(t)
    return tokens, types, tok


def add_bpe_vocab(writer: gguf.GGUFWriter, model_dir: Path, vocab_size: int | None,
                  tokenizer_pre: str | None = None) -> None:
    """Add the ``tokenizer.*`` keys for a byte-level BPE tokenizer found in ``model_dir``."""
    cfg_path = model_dir / "tokenizer_config.json"
    if cfg_path.is_file():
        tok_cfg = read_json(cfg_path)
        if (aps := tok_cfg.get("add_prefix_space")) is not None:
            writer.add_add_space_prefix(aps)

    tokens, types, tok = bpe_vocab(model_dir, vocab_size)
    pre = tokenizer_pre or detect_pre_tokenizer(tok)
    if pre is None:
        known = ", ".join(sorted(set(KNOWN_PRE_TOKENIZERS.values())))
        raise ConvertError(f"{model_dir}: unrecognised BPE pre-tokenizer (known: {known}); "
                           "name llama.cpp's pre-tokenizer with --tokenizer-pre")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)

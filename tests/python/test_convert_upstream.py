"""The converter on upstream's shoulders: several architectures and tokenizer kinds, against upstream itself.

Tiny random checkpoints saved by transformers (``fixtures.synthetic.write_tiny_hf_model``) of

* ``LlamaForCausalLM`` with a byte-level BPE tokenizer (SmolLM2's, pre-tokenizer detected as ``smollm``), tied
  embeddings;
* ``MistralForCausalLM`` (Mistral-style SPM Llama: upstream's ``LlamaModel``) with a SentencePiece tokenizer
  trained by the ``sentencepiece`` package on the gensim Wikipedia text, untied;
* ``Qwen2ForCausalLM`` (q/k/v biases) with that SentencePiece tokenizer, untied;
* ``Gemma3ForCausalLM`` (norms stored minus one, sliding + full layers) with that tokenizer, tied;

each with hidden size 192 and ``intermediate_size`` 2048, so that ``ffn_down`` (192 x 2048) can hold S3D8 and the
other matrices (k = 192) fall back - a real S3D8 plan at a small cost. For every one:

* ``--type f16 / bf16 / q8_0``: our file is byte-identical to the one upstream's ``convert_hf_to_gguf.py``
  (``main()`` of the pinned tree's script, in this process) writes for the same checkpoint;
* ``--type s3d8 --fallback-type f16``: the file differs from upstream's F16 file only in ``general.file_type`` and
  in the S3D8 tensors' type and data (same keys, values and order; same tensors, order and bytes elsewhere), and
  the S3D8 tensors dequantise close to the weights; for Llama the container is exactly the codec's;
* the S3D8 file loads and runs in llama.cpp (``llama-perplexity`` from ``$S3D8_BIN_DIR``, finite perplexity).
"""

from __future__ import annotations

import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gguf

from fixtures import assets
from fixtures.synthetic import train_sentencepiece, write_tiny_hf_model
from convert.to_gguf import main
from convert.upstream_tree import upstream_converter
from tests.converted import gguf_kv, our_gguf, outputs  # noqa: F401  (outputs: a fixture)

REPO = Path(__file__).resolve().parents[2]

#: name -> (HF architecture, tokenizer kind, tied embeddings, hidden, heads, kv heads)
MODELS: dict[str, tuple[str, str, bool, int, int, int]] = {
    "llama-bpe": ("LlamaForCausalLM", "bpe", True, 192, 3, 1),
    "mistral-spm": ("MistralForCausalLM", "spm", False, 192, 3, 1),
    "qwen2-spm": ("Qwen2ForCausalLM", "spm", False, 192, 3, 1),
    "gemma3-spm": ("Gemma3ForCausalLM", "spm", True, 192, 3, 1),
}
FFN = 2048


def bin_dir() -> Path:
    return Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin"))


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_sentencepiece(assets.wiki_text("train")[:300_000], tmp_path_factory.mktemp("spm"), vocab_size=1000)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, spm_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, (name, (arch, kind, tied, hidden, heads, kv)) in enumerate(MODELS.items()):
        tok = assets.smollm2_hf_dir() if kind == "bpe" else spm_dir
        vocab = 49152 if kind == "bpe" else 1000
        out[name] = write_tiny_hf_model(root / name, arch, tok, vocab=vocab, hidden=hidden, heads=heads,
                                        kv_heads=kv, ffn=FFN, tied=tied, seed=i)
    return out


def upstream_file(model_dir: Path, out_type: str, outputs: Path) -> Path:
    """What upstream's convert_hf_to_gguf.py writes (its main(), run here; its logging set-up left out)."""
    out = outputs / f"upstream-{model_dir.name}-{out_type}.gguf"
    if not out.exists():
        up = upstream_converter()
        argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", out_type, "--outfile", str(out)]
        mp = pytest.MonkeyPatch()
        try:
            mp.setattr(sys, "argv", argv)
            mp.setattr(logging, "basicConfig", lambda **kw: None)
            up.main()
        finally:
            mp.undo()
    return out


def _explain_difference(a: Path, b: Path) -> str:
    ra, rb = gguf.GGUFReader(a), gguf.GGUFReader(b)
    ka, kb = gguf_kv(ra), gguf_kv(rb)
    if list(ka) != list(kb):
        return f"keys differ: only ours {sorted(set(ka) - set(kb))}, only upstream {sorted(set(kb) - set(ka))}"
    for k in ka:
        if ka[k] != kb[k]:
            return f"metadata {k}: ours {str(ka[k])[:200]} != upstream {str(kb[k])[:200]}"
    for x, y in zip(ra.tensors, rb.tensors):
        if (x.name, x.tensor_type, x.shape.tolist()) != (y.name, y.tensor_type, y.shape.tolist()):
            return f"tensor {x.name} {x.tensor_type.name} {x.shape.tolist()} != {y.name} {y.tensor_type.name} {y.shape.tolist()}"
        if np.asarray(x.data).tobytes() != np.asarray(y.data).tobytes():
            return f"tensor data differs: {x.name}"
    return "files differ outside metadata and tensors"


@pytest.mark.parametrize("out_type", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("model", list(MODELS))
def test_byte_identical_to_upstream(model: str, out_type: str, checkpoints: dict[str, Path], outputs: Path) -> None:
    d = checkpoints[model]
    ours, theirs = our_gguf(d, out_type, outputs), upstream_file(d, out_type, outputs)
    assert ours.read_bytes() == theirs.read_bytes(), _explain_difference(ours, theirs)


def _vocab_kind(path: Path) -> tuple[str, str, int, bool]:
    r = gguf.GGUFReader(path)
    names = {t.name for t in r.tensors}
    return (r.fields["tokenizer.ggml.model"].contents(), r.fields["tokenizer.ggml.pre"].contents(),
            len(r.fields["tokenizer.ggml.tokens"].contents()), "output.weight" in names)


def test_tokenizer_kinds_and_embeddings(checkpoints: dict[str, Path], outputs: Path) -> None:
    """SentencePiece and byte-level BPE vocabularies, tied and untied embeddings, as upstream writes them."""
    got = {m: _vocab_kind(our_gguf(checkpoints[m], "f16", outputs)) for m in MODELS}
    assert got["llama-bpe"] == ("gpt2", "smollm", 49152, False)
    assert got["mistral-spm"][0] == "llama" and got["mistral-spm"][2] == 1000 and got["mistral-spm"][3]
    assert got["qwen2-spm"][0] == "llama" and got["qwen2-spm"][3]
    assert got["gemma3-spm"][0] == "llama" and not got["gemma3-spm"][3]
    r = gguf.GGUFReader(our_gguf(checkpoints["mistral-spm"], "f16", outputs))
    assert len(r.fields["tokenizer.ggml.scores"].contents()) == 1000  # SentencePiece scores are there


def _dequantised(t: Any) -> np.ndarray:
    import gguf_s3d8

    return gguf_s3d8.dequantize_s3d8(np.asarray(t.data), name=t.name)


@pytest.mark.parametrize("model", list(MODELS))
def test_s3d8_differs_only_in_s3d8_tensors(model: str, checkpoints: dict[str, Path], outputs: Path) -> None:
    import gguf_s3d8  # noqa: F401  (S3D8 for the reader)

    d = checkpoints[model]
    ours = gguf.GGUFReader(our_gguf(d, "s3d8", outputs, "--fallback-type", "f16"))
    theirs = gguf.GGUFReader(upstream_file(d, "f16", outputs))
    ka, kb = gguf_kv(ours), gguf_kv(theirs)
    assert list(ka) == list(kb)
    assert ka.pop("general.file_type")[1] == 96 and kb.pop("general.file_type")[1] == 1
    assert ka == kb
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    n_s3d8 = 0
    for x, y in zip(ours.tensors, theirs.tensors):
        assert x.shape.tolist() == y.shape.tolist(), x.name
        if x.tensor_type == gguf.GGMLQuantizationType.S3D8:
            n_s3d8 += 1
            assert y.tensor_type == gguf.GGMLQuantizationType.F16 and x.name.endswith("ffn_down.weight"), x.name
            ref = np.asarray(y.data).astype(np.float64)
            err = _dequantised(x).astype(np.float64) - ref
            assert 10 * math.log10((ref**2).sum() / (err**2).sum()) > 8, x.name
        else:
            assert x.tensor_type == y.tensor_type, x.name
            assert np.asarray(x.data).tobytes() == np.asarray(y.data).tobytes(), x.name
    assert n_s3d8 == 2  # ffn_down of both layers; every other matrix has k = hidden, too short for S3D8


def test_s3d8_container_is_the_codecs(checkpoints: dict[str, Path], outputs: Path) -> None:
    """The stored container is the iw1 encoder's output (uniform importance, seed 0) for the HF weight."""
    from safetensors.numpy import load_file

    import gguf_s3d8  # noqa: F401
    from gguf_s3d8.importance import quantize_s3d8_importance

    d = checkpoints["llama-bpe"]
    w = load_file(str(d / "model.safetensors"))["model.layers.1.mlp.down_proj.weight"]
    ts = {t.name: t for t in gguf.GGUFReader(our_gguf(d, "s3d8", outputs, "--fallback-type", "f16")).tensors}
    want = quantize_s3d8_importance(np.asarray(w, np.float32), None, seed=0, name="blk.1.ffn_down.weight")
    np.testing.assert_array_equal(np.asarray(ts["blk.1.ffn_down.weight"].data), want)


@pytest.mark.parametrize("model", list(MODELS))
def test_s3d8_runs_in_llama_cpp(model: str, checkpoints: dict[str, Path], outputs: Path, tmp_path: Path) -> None:
    exe = bin_dir() / "llama-perplexity"
    if not exe.is_file():
        pytest.fail(f"{exe} not found: build llama.cpp first (`bash ci/build.sh host`) or set S3D8_BIN_DIR")
    path = our_gguf(checkpoints[model], "s3d8", outputs, "--fallback-type", "f16")
    text = tmp_path / "eval.txt"
    text.write_text(assets.wiki_text("eval")[:6000], encoding="utf-8")
    # the running estimate per chunk ("[1]1117.97,[2]1080.94,") and the "Final estimate" line go through llama.cpp's
    # asynchronous logger, whose last lines a process exiting on a loaded machine can lose: up to three runs
    for _ in range(3):
        r = subprocess.run([str(exe), "-m", str(path), "-f", str(text), "-c", "64", "-b", "64", "--chunks", "2",
                            "-t", "2"], capture_output=True, text=True, timeout=300)
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-3000:]
        ppl = re.findall(r"\[\d+\](-?[0-9.]+|-?nan|-?inf),", log)
        if len(ppl) == 2:
            break
    assert len(ppl) == 2, log[-3000:]
    # random weights: about the vocabulary size, and finite (a misplaced container byte gives nan or inf)
    assert math.isfinite(float(ppl[-1])) and float(ppl[-1]) > 1, log[-2000:]


def test_reference_rope_rows_are_upstreams() -> None:
    """The tests' reference of llama.cpp's q/k row order (``tests.llama_reference.meta_rope_rows``) reorders rows
    exactly as upstream's ``LlamaModel.permute``."""
    import torch

    upstream_converter()
    from conversion.llama import LlamaModel

    from tests.llama_reference import meta_rope_rows

    w = torch.randn(3 * 64, 40, generator=torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(meta_rope_rows(w.numpy(), 3), LlamaModel.permute(w, 3, 3).numpy())
    k = torch.randn(64, 40, generator=torch.Generator().manual_seed(1))
    np.testing.assert_array_equal(meta_rope_rows(k.numpy(), 1), LlamaModel.permute(k, 3, 1).numpy())


def _check_placements(d: Path, files: list[tuple[Path, Any]], tmp_path: Path) -> int:
    """Every checkpoint tensor's placement (QAT's and GPTQ's plan) is where the written F32 files hold it: same
    name and shape, the data the checkpoint's rows in the placement's order; returns how many were reordered."""
    from safetensors import safe_open

    from convert.upstream_source import checkpoint_placements

    place = checkpoint_placements(d, vision_type="f32")
    stored = {t.name: t for path, _ in files for t in gguf.GGUFReader(path).tensors}
    n_reordered = 0
    with safe_open(d / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        for hf in names:
            p = place(hf)
            assert p is not None, hf
            t = stored[p.gguf_name]
            assert tuple(int(x) for x in reversed(t.shape.tolist())) == p.shape, hf
            w = f.get_tensor(hf).float().numpy().reshape(p.shape)
            if p.rows is not None:
                w, n_reordered = w[p.rows], n_reordered + 1
            np.testing.assert_array_equal(np.asarray(t.data).reshape(p.shape), w, err_msg=hf)
    assert len({place(n).gguf_name for n in names}) == len(names)  # type: ignore[union-attr]
    return n_reordered


def _check_placement_types(sources: list[tuple[Any, str]]) -> None:
    """The placements' types at --type s3d8 are the conversion's own plan (what --dry-run reports)."""
    from convert.common import ConversionOptions

    for src, out_type in sources:
        planned = {n: q for n, _, q in src.planned_tensors(ConversionOptions(out_type=out_type))}
        placed = {p.gguf_name: p.qtype for p in src.weight_placements(out_type, "q8_0").values()}
        assert placed and all(planned[n] == q for n, q in placed.items()), src.model_dir


def test_placements_of_text_models(checkpoints: dict[str, Path], outputs: Path, tmp_path: Path) -> None:
    """QAT and GPTQ plan a Llama (q/k rows permuted for RoPE, tied embeddings) and a Qwen2 (q/k/v biases) with
    upstream's own plan: names, shapes, row order and types are those of the files the converter writes."""
    from convert.upstream_source import UpstreamSource

    for model in ("llama-bpe", "qwen2-spm"):
        d = checkpoints[model]
        assert _check_placements(d, [(our_gguf(d, "f32", outputs), None)], tmp_path) == (2 * 2 if model == "llama-bpe" else 0)  # 2 layers x (q, k)
        _check_placement_types([(UpstreamSource(d), "s3d8")])


def test_placements_of_mllama(tmp_path: Path) -> None:
    """Llama 3.2 Vision: the placements cover both files the series' classes write (text: self-attention q/k
    rows permuted, cross-attention q/k not; vision: HF's layout), and their types are the conversions' plans."""
    from convert.upstream_source import UpstreamSource
    from fixtures.tiny_model import get

    d = get()
    text, mmproj = tmp_path / "text.gguf", tmp_path / "mmproj.gguf"
    assert main([str(d), "--type", "f32", "-o", str(text), "--mmproj", str(mmproj), "--no-progress",
                 "--tokenizer-pre", "llama-bpe"]) == 0
    n_self_attn_layers = 3  # 5 layers, cross-attention at 1 and 3
    assert _check_placements(d, [(text, None), (mmproj, None)], tmp_path) == 2 * n_self_attn_layers
    _check_placement_types([(UpstreamSource(d, tokenizer_pre="llama-bpe"), "s3d8"),
                            (UpstreamSource(d, mmproj=True), "s3d8"), (UpstreamSource(d, mmproj=True), "q8_0")])


# ---------------------------------------------------------------------------------------------------
# every BPE pre-tokenizer upstream knows


def _known_pre_tokenizers() -> list[str]:
    """Every ``res`` name upstream's ``TextModel.get_vocab_base_pre`` (the table ``convert_hf_to_gguf_update.py``
    generates) can return, read from the pinned tree's source."""
    from convert.upstream_tree import tree_dir

    src = (tree_dir() / "conversion" / "base.py").read_text(encoding="utf-8")
    start = src.index("    def get_vocab_base_pre(")
    body = src[start:src.index("\n    def ", start + 1)]
    return sorted(set(re.findall(r'\bres = "([^"]+)"', body)))


PRE_TOKENIZERS = _known_pre_tokenizers()

#: Names upstream's table gives WordPiece (BERT) tokenizers: upstream writes them with tokenizer.ggml.model "bert",
#: whose llama.cpp vocabulary (WPM) has no pre-tokenizer switch, so a byte-level BPE file cannot carry them.
WORDPIECE_PRE = {"bert-bge", "bert-bge-large", "jina-v2-en"}


def _llama_cpp_bpe_pre_tokenizers() -> set[str]:
    """The pre-tokenizer names llama.cpp's loader knows for BPE vocabularies (src/llama-vocab.cpp)."""
    from convert.upstream_tree import tree_dir

    src = (tree_dir() / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    return set(re.findall(r'tokenizer_pre == "([^"]+)"', src))


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a byte-level BPE tokenizer of its own (trained on the gensim text; its probe encoding is
    none upstream knows, so the pre-tokenizer must be named)."""
    from fixtures.synthetic import train_byte_level_bpe

    tok = train_byte_level_bpe(assets.wiki_text("train")[:100_000], tmp_path_factory.mktemp("bpe-tok"), vocab_size=400)
    return write_tiny_hf_model(tmp_path_factory.mktemp("bpe") / "llama-own-bpe", "LlamaForCausalLM", tok, vocab=400,
                               hidden=64, heads=2, kv_heads=1, ffn=128, layers=1, bos_token_id=0, eos_token_id=0)


def test_pre_tokenizer_table_is_read() -> None:
    assert len(PRE_TOKENIZERS) > 50 and {"llama-bpe", "smollm", "qwen2", "gpt-2", "tekken"} <= set(PRE_TOKENIZERS)
    # every name of the table but the WordPiece ones is one llama.cpp's BPE loader knows
    assert set(PRE_TOKENIZERS) - _llama_cpp_bpe_pre_tokenizers() == WORDPIECE_PRE


def test_unknown_pre_tokenizer_needs_a_name(bpe_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(bpe_model), "--type", "f16", "-o", str(tmp_path / "x.gguf"), "--no-progress"]) == 2
    assert "--tokenizer-pre" in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("pre", PRE_TOKENIZERS)
def test_every_pre_tokenizer_round_trips(pre: str, bpe_model: Path, tmp_path: Path) -> None:
    """``--tokenizer-pre NAME`` for each name upstream's table can return: ``tokenizer.ggml.pre`` is NAME, the file
    is byte-identical to the one upstream's converter writes when its table answers NAME, and llama.cpp's loader
    accepts it (``llama-tokenize`` loads the vocabulary and tokenizes a sentence) - or, for the names of WordPiece
    tokenizers (:data:`WORDPIECE_PRE`), refuses it with a clear message, as it must for a BPE vocabulary."""
    ours, theirs = tmp_path / "ours.gguf", tmp_path / "upstream.gguf"
    assert main([str(bpe_model), "--type", "f16", "-o", str(ours), "--tokenizer-pre", pre, "--no-progress"]) == 0
    assert gguf.GGUFReader(ours).fields["tokenizer.ggml.pre"].contents() == pre

    up = upstream_converter()
    from conversion.base import TextModel

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(TextModel, "get_vocab_base_pre", lambda self, tokenizer: pre)
        mp.setattr(sys, "argv", ["convert_hf_to_gguf.py", str(bpe_model), "--outtype", "f16", "--outfile", str(theirs)])
        mp.setattr(logging, "basicConfig", lambda **kw: None)
        up.main()
    finally:
        mp.undo()
    assert ours.read_bytes() == theirs.read_bytes(), _explain_difference(ours, theirs)

    tool = bin_dir() / "llama-tokenize"
    assert tool.is_file(), f"{tool} is missing: build it with `bash ci/build.sh host`"
    p = subprocess.run([str(tool), "-m", str(ours), "-p", "Hello world, 12345!", "--ids"],
                       capture_output=True, text=True, timeout=60)
    if pre in WORDPIECE_PRE:
        assert p.returncode != 0 and f"unknown pre-tokenizer type: '{pre}'" in p.stderr, p.stderr[-2000:]
        return
    assert p.returncode == 0, p.stderr[-2000:]
    ids = [int(x) for x in re.findall(r"\d+", p.stdout.strip().splitlines()[-1])]
    assert ids and all(0 <= i < 400 for i in ids), p.stdout[-500:]

"""Converter tests on tiny synthetic Llama checkpoints (real SmolLM2 tokenizer, random weights).

Covers: the q/k row permutation, llama3 RoPE factors, the type rules and fallbacks, every encoding read
back through gguf-py, S3D8 end to end, the GGUF-input path, atomic output (a failure or interruption
mid-way leaves no file and no temporary file, and never clobbers an existing output), and one-line
errors with exit status 2 for bad input. The tests against upstream's converter and llama.cpp on the
real SmolLM2 weights are in ``test_convert_smollm2.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as QT

from fixtures import assets
from convert.common import ConversionOptions, write_gguf
from fixtures.synthetic import llama_tensors, write_tiny_llama
from convert.tensor_types import choose_type
from convert.to_gguf import main, open_source
from tests.llama_reference import llama3_rope_factors, meta_rope_rows

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


# ---------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The SmolLM2 HF export (tokenizer files reused by the tiny models); built once, cached."""
    return assets.smollm2_hf_dir()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A 2-layer Llama: hidden 64, 4 heads / 2 kv heads, ffn 128, SmolLM2 tokenizer (vocab 49152)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", tokenizer_dir)


def _hf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's conversion-script permutation (Meta -> HF rotate-half order), the inverse of ours."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(path: Path) -> dict[str, Any]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _as_f32(t) -> np.ndarray:  # a ReaderTensor dequantised to numpy order
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


def _leftovers(directory: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


# ---------------------------------------------------------------------------------------------------
# building blocks


def test_rope_rows_hand_checked() -> None:
    # one head of 4 rows: HF stores Meta's rows (r0, r1 | r2, r3) as r0, r2, r1, r3
    hf = np.array([[0.0], [2.0], [1.0], [3.0]], dtype=np.float32)
    np.testing.assert_array_equal(meta_rope_rows(hf, 1)[:, 0], [0, 1, 2, 3])
    # two heads of 4 rows each are permuted independently
    hf2 = np.array([0, 2, 1, 3, 4, 6, 5, 7], dtype=np.float32)[:, None]
    np.testing.assert_array_equal(meta_rope_rows(hf2, 2)[:, 0], np.arange(8))


def test_rope_rows_inverse_of_hf_permute() -> None:
    rng = np.random.default_rng(1)
    for n_head, hd, k in ((4, 16, 8), (3, 64, 5), (1, 2, 1)):
        meta = rng.standard_normal((n_head * hd, k)).astype(np.float32)
        np.testing.assert_array_equal(meta_rope_rows(_hf_permute(meta, n_head), n_head), meta)
    bias = rng.standard_normal(32).astype(np.float32)  # 1-D (q/k biases) works too
    np.testing.assert_array_equal(meta_rope_rows(_hf_permute(bias, 4), 4), bias)
    with pytest.raises(ValueError):
        meta_rope_rows(np.zeros((6, 2), np.float32), 4)


def test_llama3_rope_factors_bands() -> None:
    # Llama 3.2 values: theta 5e5, factor 32, low 1, high 4, original context 8192, head_dim 64
    rope = {"rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    f = llama3_rope_factors(rope, 64)
    assert f.dtype == np.float32 and f.shape == (32,)
    assert f[0] == 1.0  # highest frequency (wavelength 2*pi) is not scaled
    assert f[-1] == 32.0  # lowest frequency: wavelength > 8192 -> divided by the full factor
    assert np.all(np.diff(f) >= 0) and np.all((f >= 1) & (f <= 32))
    wl = 2 * np.pi * 500000.0 ** (np.arange(0, 64, 2) / 64)
    mid = (wl >= 8192 / 4) & (wl <= 8192)
    assert mid.any() and np.all((f[mid] > 1) & (f[mid] < 32))


@pytest.mark.parametrize("name, shape, req, fb, want, reason_has", [
    ("blk.0.attn_norm.weight", (576,), "s3d8", "q8_0", QT.F32, None),
    ("output_norm.weight", (64,), "q8_0", "q8_0", QT.F32, None),
    ("blk.0.attn_q.bias", (576,), "f16", "q8_0", QT.F32, None),
    ("rope_freqs.weight", (32,), "q8_0", "q8_0", QT.F32, None),
    ("blk.0.attn_q.weight", (576, 576), "f16", "q8_0", QT.F16, None),
    ("blk.0.attn_q.weight", (576, 576), "bf16", "q8_0", QT.BF16, None),
    ("blk.0.attn_q.weight", (576, 576), "f32", "q8_0", QT.F32, None),
    ("blk.0.attn_q.weight", (576, 576), "q8_0", "q8_0", QT.Q8_0, None),
    ("blk.0.attn_q.weight", (64, 48), "q8_0", "q8_0", QT.F16, "multiple of 32"),
    ("blk.0.ffn_down.weight", (576, 1536), "s3d8", "q8_0", "S3D8", None),
    ("blk.0.attn_q.weight", (576, 576), "s3d8", "q8_0", QT.Q8_0, "multiple of 128"),
    ("blk.0.attn_q.weight", (576, 576), "s3d8", "bf16", QT.BF16, "multiple of 128"),
    ("blk.0.attn_q.weight", (64, 48), "s3d8", "q8_0", QT.F16, "Q8_0"),
    ("blk.0.attn_k.weight", (4, 1024), "s3d8", "q8_0", QT.Q8_0, "S3D8"),  # k fits, too few rows
])
def test_type_rules(name, shape, req, fb, want, reason_has) -> None:
    ch = choose_type(name, shape, req, fb)
    assert ch.qtype == (QT.S3D8 if want == "S3D8" else want)
    if reason_has is None:
        assert ch.reason is None
    else:
        assert ch.reason is not None and reason_has in ch.reason


# ---------------------------------------------------------------------------------------------------
# conversions read back


@pytest.mark.parametrize("out_type, want, rtol", [
    ("f32", QT.F32, 0.0), ("f16", QT.F16, 1e-3), ("bf16", QT.BF16, 8e-3), ("q8_0", QT.Q8_0, None)])
def test_tiny_roundtrip(tiny: Path, tmp_path: Path, out_type: str, want: QT, rtol: float | None) -> None:
    out = tmp_path / "out.gguf"
    assert main([str(tiny), "--type", out_type, "-o", str(out), "--no-progress"]) == 0
    ts = _tensors(out)
    src = llama_tensors(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=49152)
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "blk.1.attn_q.weight": "model.layers.1.self_attn.q_proj.weight",
             "blk.1.attn_k.weight": "model.layers.1.self_attn.k_proj.weight", "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
             "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight", "output_norm.weight": "model.norm.weight"}
    for gname, hname in pairs.items():
        ref = src[hname]
        if "attn_q" in gname:
            ref = meta_rope_rows(ref, 4)
        if "attn_k" in gname:
            ref = meta_rope_rows(ref, 2)
        got = _as_f32(ts[gname])
        if ref.ndim == 1:
            assert ts[gname].tensor_type == QT.F32
            np.testing.assert_array_equal(got, ref)
            continue
        assert ts[gname].tensor_type == want
        if rtol == 0.0:
            np.testing.assert_array_equal(got, ref)
        elif rtol is not None:
            np.testing.assert_allclose(got, ref, rtol=rtol, atol=1e-7)
        else:  # Q8_0: half a step, plus the f16 rounding of the scale (<= 127 * 2^-11 steps)
            step = np.abs(ref.reshape(-1, 32)).max(1, keepdims=True) / 127
            assert np.all(np.abs(got - ref).reshape(-1, 32) <= step * (0.5 + 127 * 2.0**-11) + 1e-9)
    assert "output.weight" not in ts  # tied embeddings: llama.cpp reuses token_embd
    r = gguf.GGUFReader(out)
    assert r.fields["general.file_type"].contents() == {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[out_type]
    assert r.fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert r.fields["llama.rope.dimension_count"].contents() == 16


def test_untied_output_and_llama3_rope(tmp_path: Path, tokenizer_dir: Path) -> None:
    rope = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    d = write_tiny_llama(tmp_path / "m", tokenizer_dir, tied=False, rope=rope)
    out = tmp_path / "o.gguf"
    assert main([str(d), "--type", "f16", "-o", str(out), "--no-progress"]) == 0
    ts = _tensors(out)
    assert ts["output.weight"].tensor_type == QT.F16
    assert ts["rope_freqs.weight"].tensor_type == QT.F32
    np.testing.assert_array_equal(_as_f32(ts["rope_freqs.weight"]), llama3_rope_factors(rope, 16))


def test_s3d8_tiny(tmp_path: Path, tokenizer_dir: Path) -> None:
    """hidden 192 / ffn 1024: only ffn_down (192 x 1024) can hold an S3D8 container."""
    import gguf_s3d8

    d = write_tiny_llama(tmp_path / "m", tokenizer_dir, hidden=192, heads=3, kv_heads=3, ffn=1024, layers=1)
    out = tmp_path / "o.gguf"
    rep_json = tmp_path / "report.json"
    assert main([str(d), "--type", "s3d8", "--seed", "3", "-o", str(out), "--no-progress",
                 "--report-json", str(rep_json)]) == 0
    ts = _tensors(out)
    assert ts["blk.0.ffn_down.weight"].tensor_type == QT.S3D8
    # llama.cpp's LLAMA_FTYPE_MOSTLY_S3D8, so its loader names the file type instead of guessing
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 96
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_up.weight", "token_embd.weight"):
        assert ts[name].tensor_type == QT.Q8_0, name
    report = json.loads(rep_json.read_text())
    fb = {r["name"]: r["fallback_reason"] for r in report["tensors"] if r["fallback_reason"]}
    assert "blk.0.ffn_down.weight" not in fb
    assert set(fb) == {"token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
                       "blk.0.attn_output.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"}
    assert all("128" in why for why in fb.values())
    # the stored container is exactly the codec's output for the same seed: the iw1 encoder by default
    # (uniform importance without --imatrix), the reference encoder with --encoder reference
    from gguf_s3d8.importance import quantize_s3d8_importance

    w = llama_tensors(hidden=192, layers=1, heads=3, kv_heads=3, ffn=1024, vocab=49152)["model.layers.0.mlp.down_proj.weight"]
    want = quantize_s3d8_importance(w, None, seed=3, name="blk.0.ffn_down.weight")
    np.testing.assert_array_equal(np.asarray(ts["blk.0.ffn_down.weight"].data), want)
    ref_out = tmp_path / "ref.gguf"
    assert main([str(d), "--type", "s3d8", "--seed", "3", "--encoder", "reference", "-o", str(ref_out),
                 "--no-progress"]) == 0
    np.testing.assert_array_equal(np.asarray(_tensors(ref_out)["blk.0.ffn_down.weight"].data),
                                  gguf_s3d8.quantize_s3d8(w, seed=3, name="blk.0.ffn_down.weight"))
    deq = gguf_s3d8.dequantize_s3d8(np.asarray(ts["blk.0.ffn_down.weight"].data))
    # an S3D8 GGUF is also valid converter input: its containers are dequantised by the codec
    back = tmp_path / "back.gguf"
    assert main([str(out), "--type", "f32", "-o", str(back), "--no-progress"]) == 0
    np.testing.assert_array_equal(_as_f32(_tensors(back)["blk.0.ffn_down.weight"]), deq)
    assert 10 * np.log10((w.astype(np.float64) ** 2).sum() / ((w - deq).astype(np.float64) ** 2).sum()) > 8
    # --fallback-type changes the fallbacks only; the same seed gives the same bytes
    out2 = tmp_path / "o2.gguf"
    assert main([str(d), "--type", "s3d8", "--seed", "3", "--fallback-type", "f16", "-o", str(out2), "--no-progress"]) == 0
    ts2 = _tensors(out2)
    assert ts2["blk.0.attn_q.weight"].tensor_type == QT.F16
    np.testing.assert_array_equal(np.asarray(ts2["blk.0.ffn_down.weight"].data), want)
    assert gguf.GGUFReader(out2).fields["general.file_type"].contents() == gguf.GGUFReader(out).fields["general.file_type"].contents()


def test_gguf_input_matches_hf_input(tiny: Path, tmp_path: Path) -> None:
    """Re-encoding a GGUF gives the same tensors as converting the HF checkpoint; metadata is kept."""
    f32 = tmp_path / "f32.gguf"
    direct = tmp_path / "direct.gguf"
    via = tmp_path / "via.gguf"
    assert main([str(tiny), "--type", "f32", "-o", str(f32), "--no-progress"]) == 0
    assert main([str(tiny), "--type", "q8_0", "-o", str(direct), "--no-progress"]) == 0
    assert main([str(f32), "--type", "q8_0", "-o", str(via), "--no-progress"]) == 0
    a, b = gguf.GGUFReader(direct), gguf.GGUFReader(via)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors):
        assert x.tensor_type == y.tensor_type and np.asarray(x.data).tobytes() == np.asarray(y.data).tobytes(), x.name
    ka = {k: f.contents() for k, f in a.fields.items() if not k.startswith("GGUF.")}
    kb = {k: f.contents() for k, f in b.fields.items() if not k.startswith("GGUF.")}
    assert ka == kb


# ---------------------------------------------------------------------------------------------------
# atomic output


def test_failure_midway_leaves_nothing(tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.gguf"
    src = open_source(tiny)
    seen: list[int] = []

    def boom(i: int, job) -> None:
        seen.append(i)
        partial = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
        if i == 10:
            assert len(partial) == 1 and partial[0].stat().st_size > 0  # really mid-way through a file
            raise RuntimeError("injected failure")

    with pytest.raises(RuntimeError, match="injected"):
        write_gguf(src, out, ConversionOptions(out_type="q8_0"), progress=False, before_tensor=boom)
    assert seen[-1] == 10
    assert _leftovers(tmp_path, set()) == []


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_interrupt_keeps_existing_output(tiny: Path, tmp_path: Path, exc: type[BaseException]) -> None:
    out = tmp_path / "out.gguf"
    out.write_bytes(b"previous good file")

    def stop(i: int, job) -> None:
        if i == 3:
            raise exc()

    with pytest.raises(exc):
        write_gguf(open_source(tiny), out, ConversionOptions(out_type="f16"), progress=False, before_tensor=stop)
    assert out.read_bytes() == b"previous good file"
    assert _leftovers(tmp_path, {"out.gguf"}) == []


def test_nan_in_last_layer_cli(tmp_path: Path, tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t = llama_tensors(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=49152)
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    t["model.layers.1.mlp.up_proj.weight"][0, 0] = np.inf
    d = write_tiny_llama(tmp_path / "m", tokenizer_dir, tensors=t)
    outdir = tmp_path / "out"
    outdir.mkdir()
    assert main([str(d), "--type", "f16", "-o", str(outdir / "x.gguf"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert "blk.1.ffn_up.weight" in err[0] and "model.layers.1.mlp.up_proj.weight" in err[0]
    assert "1 NaN, 1 inf" in err[0]
    assert list(outdir.iterdir()) == []


def test_sigterm_midway_leaves_nothing(tmp_path: Path) -> None:
    """A real process killed with SIGTERM while writing removes its temporary file and exits 143."""
    hf = assets.smollm2_hf_dir()
    out = tmp_path / "out.gguf"
    proc = subprocess.Popen([PY, "-m", "convert.to_gguf", str(hf), "--type", "f32", "-o", str(out), "--no-progress"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        parts = [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
        if parts and parts[0].stat().st_size > 1 << 20:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "conversion finished before it could be interrupted"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "terminated" in err and "Traceback" not in err
    assert _leftovers(tmp_path, set()) == []


# ---------------------------------------------------------------------------------------------------
# bad input: one line, exit status 2, nothing written


def _gguf_other_arch(path: Path) -> Path:
    w = gguf.GGUFWriter(path, arch="gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _bad_inputs(tmp: Path, tok: Path) -> dict[str, tuple[list[str], str]]:
    cases: dict[str, tuple[list[str], str]] = {}
    cases["missing"] = ([str(tmp / "nope")], "no such file or directory")
    (tmp / "empty").mkdir()
    cases["no-config"] = ([str(tmp / "empty")], "config.json is missing")
    bad_json = write_tiny_llama(tmp / "badjson", tok)
    (bad_json / "config.json").write_text("{not json")
    cases["bad-json"] = ([str(bad_json)], "not valid JSON")
    other = write_tiny_llama(tmp / "other", tok, config_overrides={"architectures": ["NoSuchModelForCausalLM"]})
    cases["arch"] = ([str(other)], "unsupported architecture 'NoSuchModelForCausalLM'")
    no_tok = write_tiny_llama(tmp / "notok", tok)
    (no_tok / "tokenizer.json").unlink()
    cases["no-tokenizer"] = ([str(no_tok)], "no tokenizer (tokenizer.json / tokenizer.model")
    trunc = write_tiny_llama(tmp / "trunc", tok)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = ([str(trunc)], "truncated or corrupt")
    no_weights = write_tiny_llama(tmp / "noweights", tok)
    (no_weights / "model.safetensors").unlink()
    cases["no-weights"] = ([str(no_weights)], "no model.safetensors")
    garbage = tmp / "garbage.gguf"
    garbage.write_bytes(b"PK\x03\x04 not a gguf")
    cases["not-gguf"] = ([str(garbage)], "not a GGUF file")
    cases["gguf-arch"] = ([str(_gguf_other_arch(tmp / "gpt2.gguf"))], "unsupported architecture 'gpt2'")
    bad_rope = write_tiny_llama(tmp / "rope", tok, rope={"rope_theta": 1e4, "rope_type": "longrope"})
    cases["rope"] = ([str(bad_rope)], "longrope")  # longrope without its factors
    good = write_tiny_llama(tmp / "good", tok)
    cases["outdir"] = ([str(good), "-o", str(tmp / "no" / "such" / "dir" / "x.gguf")], "does not exist")
    cases["outfile-is-dir"] = ([str(good), "-o", str(tmp / "empty")], "is a directory")
    unknown_pre = write_tiny_llama(tmp / "pre", tok)
    tj = json.loads((unknown_pre / "tokenizer.json").read_text())
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    (unknown_pre / "tokenizer.json").write_text(json.dumps(tj))
    cases["pre-tokenizer"] = ([str(unknown_pre)], "--tokenizer-pre")
    return cases


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("bad")
    return tmp, _bad_inputs(tmp, tokenizer_dir)


CASES = ["missing", "no-config", "bad-json", "arch", "no-tokenizer", "truncated", "no-weights", "not-gguf",
         "gguf-arch", "rope", "outdir", "outfile-is-dir", "pre-tokenizer"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input(case: str, bad_inputs, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    _, cases = bad_inputs
    argv, needle = cases[case]
    monkeypatch.chdir(tmp_path)  # default output location: must stay empty
    if "-o" not in argv:
        argv = [*argv, "-o", str(tmp_path / "out.gguf")]
    rc = main([*argv, "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert needle in err[0]
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_traceback(bad_inputs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, cases = bad_inputs
    argv, _ = cases["arch"]
    assert main([*argv, "-o", str(tmp_path / "x.gguf"), "--debug"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_bad_option_is_usage_error(tiny: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main([str(tiny), "--type", "q4_0"])
    assert e.value.code == 2


def test_tokenizer_pre_override(bad_inputs, tmp_path: Path) -> None:
    _, cases = bad_inputs
    argv, _ = cases["pre-tokenizer"]
    out = tmp_path / "x.gguf"
    assert main([*argv, "--tokenizer-pre", "smollm", "--type", "f16", "-o", str(out), "--no-progress"]) == 0
    assert gguf.GGUFReader(out).fields["tokenizer.ggml.pre"].contents() == "smollm"


@pytest.mark.parametrize("how, cwd", [([str(REPO / "convert" / "to_gguf.py")], None), (["-m", "convert.to_gguf"], REPO)])
def test_entry_points(how: list[str], cwd: Path | None, tmp_path: Path, tiny: Path) -> None:
    """``python convert/to_gguf.py`` (from any directory) and ``python -m convert.to_gguf``."""
    cwd = cwd or tmp_path
    h = subprocess.run([PY, *how, "--help"], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "--fallback-type" in h.stdout and "--centroid-rule" in h.stdout
    out = tmp_path / "x.gguf"
    r = subprocess.run([PY, *how, str(tiny), "--type", "q8_0", "-o", str(out), "--dry-run"], cwd=cwd,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "dry run" in r.stdout and not out.exists()
    bad = subprocess.run([PY, *how, str(tmp_path / "missing")], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr

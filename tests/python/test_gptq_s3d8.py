"""GPTQ into the S3D8 GGUF (qat.gptq_s3d8 -> convert --gptq-checkpoint) and QAT from that start
(qat.train --init-from), on random matrices and on the tiny random Llama of fixtures.tiny_llama (S3D8 q/k/v/gate/up with the
RoPE row permutation, tied S3D8 embedding)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf_s3d8
from gguf_s3d8.container import read_container
from gguf_s3d8.importance import quantize_s3d8_importance, quantize_s3d8_with_scales, weight_space_values
from gguf_s3d8.scales import scales_to_fp32
from gguf_s3d8.tensor_file import (S3D8TensorFile, S3D8TensorFileError, read_s3d8_tensors, weight_fingerprint,
                                   write_s3d8_tensors)
from fixtures import tiny_llama as tiny
from qat.gptq import GPTQConfig
from qat.gptq_s3d8 import gptq_s3d8_matrix
from qat.s3d8_torch import s3d8_weight_space_values

REPO = Path(__file__).resolve().parents[2]
N, K = 192, 1024  # the smallest row count a k = 1024 container holds


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _matrix(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(4, size=(N, K)) * 0.02).astype(np.float32)
    w[4] = 0.0  # a zero row: scale 0 inside a triple
    w[7, :5] = -0.0
    return w


@pytest.fixture(scope="module")
def start() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A matrix and its iw1 container with a random importance."""
    w = _matrix(0)
    imp = np.random.default_rng(1).gamma(0.5, size=K).astype(np.float32)
    return w, imp, quantize_s3d8_importance(w, imp)


def test_weight_space_values_are_what_the_container_stores(start) -> None:
    w, _, c = start
    parts = read_container(c)
    alpha = scales_to_fp32(parts.scales_bf16)
    ref = gguf_s3d8.dequantize_s3d8(c)
    assert np.array_equal(_bits(weight_space_values(w, alpha, parts.codebook)), _bits(ref))
    # the torch twin (GPTQ's column quantiser, QAT's frozen-scale fake quantiser), whole matrix and single columns
    t = s3d8_weight_space_values(torch.from_numpy(w), torch.from_numpy(parts.codebook.copy()), torch.from_numpy(alpha))
    assert np.array_equal(_bits(t.numpy()), _bits(ref))
    for j in (0, 5, K - 1):
        col = s3d8_weight_space_values(torch.from_numpy(w[:, j:j + 1].copy()), torch.from_numpy(parts.codebook.copy()),
                                       torch.from_numpy(alpha))
        assert np.array_equal(_bits(col.numpy()), _bits(ref[:, j:j + 1]))


def test_encoding_with_given_scales_reproduces_stored_values(start) -> None:
    w, _, c = start
    parts = read_container(c)
    assert np.array_equal(quantize_s3d8_with_scales(w, parts.codebook, parts.scales_bf16), c)  # iw1's step 5
    values = gguf_s3d8.dequantize_s3d8(c)
    again = quantize_s3d8_with_scales(values, parts.codebook, parts.scales_bf16)
    assert np.array_equal(_bits(gguf_s3d8.dequantize_s3d8(again)), _bits(values))


@pytest.mark.parametrize("bad", ["shape", "negative", "nan", "dtype"])
def test_encoding_with_bad_scales_is_refused(start, bad: str) -> None:
    w, _, c = start
    parts = read_container(c)
    sc = parts.scales_bf16.copy()
    if bad == "shape":
        sc = sc[:-1]
    elif bad == "negative":
        sc[3] |= 0x8000
    elif bad == "nan":
        sc[3] = 0x7FC0
    else:
        sc = sc.astype(np.int32)
    with pytest.raises(gguf_s3d8.S3D8Error, match="scales"):
        quantize_s3d8_with_scales(w, parts.codebook, sc, name="t")


def test_gptq_with_identity_hessian_is_the_importance_aware_encoding() -> None:
    """H = I: no error feedback between columns, so GPTQ assigns each column as iw1's last step does (with the
    uniform importance diag(I) = 1)."""
    w = _matrix(2)
    got = gptq_s3d8_matrix(w, torch.eye(K), cfg=GPTQConfig(act_order=False))
    assert np.array_equal(got.container, quantize_s3d8_importance(w, np.ones(K, dtype=np.float32)))
    assert got.fingerprint == weight_fingerprint(w)


@pytest.mark.parametrize("importance", [None, "imatrix"])
def test_gptq_start_is_the_same_in_c_and_numpy(monkeypatch, importance) -> None:
    """GPTQ's iw1 start runs in libs3d8-native when it is built (CI builds it): the same container as numpy's iw1,
    with and without importance, and a broken library is GPTQError, not a silent fallback."""
    import convert.encoders
    from gguf_s3d8.native import load_native
    from qat.gptq_s3d8 import GPTQError, iw1_container

    load_native()  # the library of this build: a missing one fails the test
    w = _matrix(3)
    imp = None if importance is None else (np.random.default_rng(4).random(K) + 0.1).astype(np.float32)
    c = iw1_container(w, imp, name="t", seed=2)
    assert np.array_equal(c, quantize_s3d8_importance(w, imp, name="t", seed=2))
    monkeypatch.setattr(convert.encoders, "load_backend", lambda *a, **k: None)
    assert np.array_equal(iw1_container(w, imp, name="t", seed=2), c)  # the numpy path

    def broken(*a, **k):
        raise convert.encoders.ConvertError("--backend auto: the C encoder library is unusable: other build")
    monkeypatch.setattr(convert.encoders, "load_backend", broken)
    with pytest.raises(GPTQError, match="other build"):
        iw1_container(w, imp, name="t")


def test_gptq_lowers_the_output_error_on_correlated_inputs() -> None:
    """On inputs with strongly correlated columns GPTQ's output error tr((W-Q) H (W-Q)^T) is well below the start's
    (the same codebook and scales, no feedback). Measured here: 0.033x (inputs of rank ~64 plus noise);
    asserted: below 0.5x."""
    rng = np.random.default_rng(3)
    w = _matrix(3)
    mix = rng.standard_normal((K, K)).astype(np.float32) * 0.1 + np.eye(K, dtype=np.float32)
    x = rng.standard_normal((4096, 64)).astype(np.float32) @ rng.standard_normal((64, K)).astype(np.float32)
    x = x + 0.1 * rng.standard_normal((4096, K)).astype(np.float32) @ mix
    h = torch.from_numpy((2.0 / x.shape[0]) * (x.T @ x)).float()
    got = gptq_s3d8_matrix(w, h)
    start = quantize_s3d8_importance(w, np.diag(h.numpy()).astype(np.float32))

    def out_err(c: np.ndarray) -> float:
        d = (w - gguf_s3d8.dequantize_s3d8(c)).astype(np.float64)
        return float(np.einsum("ij,jk,ik->", d, h.numpy().astype(np.float64), d))

    ratio = out_err(got.container) / out_err(start)
    assert ratio < 0.5, f"GPTQ / start output error {ratio:.3f}"
    # same codebook and scales as the start: only the indices move
    a, b = read_container(got.container), read_container(start)
    assert np.array_equal(a.codebook, b.codebook) and np.array_equal(a.scales_bf16, b.scales_bf16)


def test_tensor_file_round_trip_and_damage(tmp_path: Path, start) -> None:
    w, _, c = start
    f = tmp_path / "g.safetensors"
    write_s3d8_tensors(f, S3D8TensorFile({"blk.0.x.weight": c}, {"blk.0.x.weight": weight_fingerprint(w)}, "test",
                                         {"note": 1}))
    back = read_s3d8_tensors(f)
    assert np.array_equal(back.containers["blk.0.x.weight"], c) and back.info == {"note": 1}
    assert not list(tmp_path.glob("*.partial"))
    raw = bytearray(f.read_bytes())
    off = len(raw) - c.size + 3  # a byte of the container's magic ("S3D8" at offset 0 of the container)
    raw[off] ^= 0xFF
    (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
    with pytest.raises(S3D8TensorFileError, match="blk.0.x.weight"):
        read_s3d8_tensors(tmp_path / "bad.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(S3D8TensorFileError, match="not a safetensors file"):
        read_s3d8_tensors(tmp_path / "junk.safetensors")


def test_tensor_file_version_2_holds_plain_tensors(tmp_path: Path, start) -> None:
    """Plain fp32 tensors (qat.export's masters) make a version-2 file; a file without them stays version 1 (the
    bytes GPTQ wrote before); an unknown version is refused naming the versions this code reads."""
    from safetensors import safe_open

    w, _, c = start
    plain = {"model.norm.weight": np.arange(4, dtype=np.float32)}
    f = tmp_path / "q.safetensors"
    write_s3d8_tensors(f, S3D8TensorFile({"blk.0.x.weight": c}, {"blk.0.x.weight": weight_fingerprint(w)}, "qat-export",
                                         {}, plain))
    back = read_s3d8_tensors(f)
    assert set(back.containers) == {"blk.0.x.weight"} and np.array_equal(back.plain["model.norm.weight"], plain["model.norm.weight"])
    with safe_open(str(f), "np") as h:
        assert h.metadata()["version"] == "2"
    one = tmp_path / "g.safetensors"
    write_s3d8_tensors(one, S3D8TensorFile({"blk.0.x.weight": c}, {"blk.0.x.weight": weight_fingerprint(w)}, "test"))
    with safe_open(str(one), "np") as h:
        assert h.metadata()["version"] == "1" and "plain" not in h.metadata()
    with pytest.raises(ValueError, match="both a container and a plain tensor"):
        write_s3d8_tensors(tmp_path / "x.safetensors", S3D8TensorFile({"a": c}, {"a": "0"}, "t", {}, {"a": plain["model.norm.weight"]}))
    from safetensors.numpy import save

    (tmp_path / "v3.safetensors").write_bytes(save({"a": c}, metadata={"format": "s3d8-tensors", "version": "3"}))
    with pytest.raises(S3D8TensorFileError, match="version '3' \\(this code reads 1 and 2\\)"):
        read_s3d8_tensors(tmp_path / "v3.safetensors")


# ---------------------------------------------------------------------------------------------------
# the tiny Llama end to end


def _run(*args: str, ok: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=900,
                       env=None if env is None else {**os.environ, **env})
    if ok:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gptq")
    teacher = tiny.write_teacher(d / "teacher")
    text = d / "calib.txt"
    words = tiny._WORDS
    rng = np.random.default_rng(0)
    text.write_text(" ".join(rng.choice(words, 3000)) + "\n")
    out = d / "gptq.safetensors"
    _run("-m", "qat.gptq_s3d8", "--model", str(teacher), "--calibration", str(text), "-o", str(out),
         "--calibration-tokens", "2048", "--calibration-seq-len", "128", "--threads", "1", "--no-progress")
    return {"teacher": teacher, "text": text, "gptq": out, "dir": d}


def _gguf_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in r.tensors}


def test_gptq_checkpoint_is_written_verbatim_and_calibration_is_its_own_command(tiny_run) -> None:
    g = read_s3d8_tensors(tiny_run["gptq"])
    assert set(g.containers) == {"token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
                                 "blk.0.attn_v.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"}
    assert g.producer == "gptq-iw1" and g.info["calibration"]["tokens"] == 2048 and not g.info["no_calibration_input"]
    out = tiny_run["dir"] / "a.gguf"
    _run("convert/to_gguf.py", str(tiny_run["teacher"]), "--type", "s3d8", "--gptq-checkpoint", str(tiny_run["gptq"]),
         "-o", str(out), "--tokenizer-pre", "llama-bpe", "--no-progress")
    got = _gguf_tensors(out)
    for name, c in g.containers.items():
        assert got[name][0] == "S3D8" and np.array_equal(got[name][1].reshape(-1), c.reshape(-1)), name
    # GPTQ is the first of two commands: the converter no longer runs it, and says so
    r = _run("convert/to_gguf.py", str(tiny_run["teacher"]), "--type", "s3d8", "--calibration", str(tiny_run["text"]),
             "-o", str(tiny_run["dir"] / "b.gguf"), ok=False)
    assert r.returncode == 2 and "python -m qat.gptq_s3d8 --model MODEL --calibration FILE" in r.stderr
    assert "--gptq-checkpoint" in r.stderr and not (tiny_run["dir"] / "b.gguf").exists()


def test_gptq_checkpoint_refuses_other_plans_and_other_weights(tiny_run) -> None:
    d = tiny_run["dir"]
    r = _run("convert/to_gguf.py", str(tiny_run["teacher"]), "--type", "q8_0", "--gptq-checkpoint", str(tiny_run["gptq"]),
             "-o", str(d / "x.gguf"), ok=False)
    assert r.returncode == 2 and "add --type s3d8" in r.stderr
    other = tiny.write_teacher(d / "other", seed=5)
    r = _run("convert/to_gguf.py", str(other), "--type", "s3d8", "--gptq-checkpoint", str(tiny_run["gptq"]),
             "-o", str(d / "y.gguf"), "--tokenizer-pre", "llama-bpe", "--no-progress", ok=False)
    assert r.returncode == 2 and "fingerprint mismatch" in r.stderr and not (d / "y.gguf").exists()
    r = _run("convert/to_gguf.py", str(tiny_run["teacher"]), "--type", "s3d8", "--gptq-checkpoint", str(tiny_run["gptq"]),
             "--imatrix", str(tiny_run["gptq"]), "-o", str(d / "z.gguf"), ok=False)
    assert r.returncode == 2 and "error:" in r.stderr


def test_gptq_calibration_errors(tiny_run) -> None:
    d = tiny_run["dir"]
    r = _run("-m", "qat.gptq_s3d8", "--model", str(tiny_run["teacher"]), "--calibration", str(d / "missing.txt"),
             "-o", str(d / "m.safetensors"), ok=False)
    assert r.returncode == 2 and "no such calibration file" in r.stderr
    (d / "short.txt").write_text("the cat")
    r = _run("-m", "qat.gptq_s3d8", "--model", str(tiny_run["teacher"]), "--calibration", str(d / "short.txt"),
             "-o", str(d / "m.safetensors"), ok=False)
    assert r.returncode == 2 and "fewer than one window" in r.stderr and not (d / "m.safetensors").exists()


def test_qat_from_the_gptq_start(tiny_run) -> None:
    """--init-from: the step-0 student computes with exactly the file's values; training keeps codebooks and
    scales frozen; the export of the trained student equals its fake-quantised weights bit for bit."""
    from qat.student import QuantEmbedding, QuantLinear, fake_quant_weight
    from qat.checkpoint import load_checkpoint
    from qat.train import main
    from qat.training.models import build_student, start_from_file, student_from_checkpoint

    g = read_s3d8_tensors(tiny_run["gptq"])
    s0 = build_student(tiny_run["teacher"], given_codebooks=set(g.containers))
    quant = [m for m in s0.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    # no codebook is fitted for the weights the file starts (they would be discarded), every other one is (a tied
    # embedding and output share one spec)
    unfitted = sorted({m.spec.gguf_name for m in quant if m.spec.qtype == "s3d8" and m.spec.codebook is None})
    assert unfitted == sorted(g.containers)
    assert sorted(start_from_file(s0, tiny_run["gptq"])) == sorted(g.containers)
    assert all(m.spec.codebook is not None for m in quant if m.spec.qtype == "s3d8")
    for m in s0.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)) and m.spec.gguf_name in g.containers:
            v = fake_quant_weight(m.weight, m.spec).detach()
            ref = torch.from_numpy(gguf_s3d8.dequantize_s3d8(g.containers[m.spec.gguf_name]))
            v_gguf = v if m.spec.perm is None else v[m.spec.perm]
            assert torch.equal(v_gguf, ref), m.spec.gguf_name
    data = tiny.write_samples(tiny_run["dir"] / "data.jsonl", n=8)
    run = tiny_run["dir"] / "qat"
    assert main(["--teacher", str(tiny_run["teacher"]), "--data", str(data), "--out", str(run), "--steps", "3",
                 "--batch", "2", "--seq-len", "40", "--threads", "1", "--lr", "3e-3", "--no-progress",
                 "--init-from", str(tiny_run["gptq"])]) == 0
    ck = load_checkpoint(run / "checkpoint.pt")
    for spec in ck["specs"].values():
        if spec["gguf_name"] in g.containers:
            parts = read_container(g.containers[spec["gguf_name"]])
            assert np.array_equal(spec["codebook"].numpy(), parts.codebook)
            assert np.array_equal(spec["scales"].numpy().astype(np.uint16), parts.scales_bf16)
    out = tiny_run["dir"] / "qat.gguf"
    _run("-m", "qat.export", str(run / "checkpoint.pt"), "-o", str(run / "student.s3d8.safetensors"))
    _run("convert/to_gguf.py", str(tiny_run["teacher"]), "--type", "s3d8", "--qat-checkpoint",
         str(run / "student.s3d8.safetensors"), "-o", str(out), "--tokenizer-pre", "llama-bpe", "--no-progress")
    got = _gguf_tensors(out)
    student = student_from_checkpoint(run / "checkpoint.pt", tiny_run["teacher"])
    moved = 0
    for m in student.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)) and m.spec.gguf_name in g.containers:
            v = fake_quant_weight(m.weight, m.spec).detach()
            v_np = (v if m.spec.perm is None else v[m.spec.perm]).numpy()
            name = m.spec.gguf_name
            assert np.array_equal(_bits(gguf_s3d8.dequantize_s3d8(got[name][1])), _bits(v_np)), name
            moved += int((v_np != gguf_s3d8.dequantize_s3d8(g.containers[name])).sum())
    assert moved > 0  # training changed some stored values (lr 3e-3: the masters start at cell centres)


def test_gptq_can_keep_the_codebooks_and_scales_of_an_existing_s3d8_gguf(tiny_run) -> None:
    """--start: the codebook and scales of each matrix come from the given S3D8 GGUF (e.g. llama-quantize's);
    only the indices are GPTQ's. A GGUF without the tensors is refused."""
    d = tiny_run["dir"]
    base = d / "iw1.gguf"
    _run("convert/to_gguf.py", str(tiny_run["teacher"]), "--type", "s3d8", "--seed", "7", "-o", str(base),
         "--tokenizer-pre", "llama-bpe", "--no-progress")
    out = d / "started.safetensors"
    _run("-m", "qat.gptq_s3d8", "--model", str(tiny_run["teacher"]), "--calibration", str(tiny_run["text"]), "-o",
         str(out), "--calibration-tokens", "1024", "--calibration-seq-len", "128", "--threads", "1", "--no-progress",
         "--start", str(base))
    start = _gguf_tensors(base)
    got = read_s3d8_tensors(out)
    for name, c in got.containers.items():
        a, b = read_container(c), read_container(start[name][1])
        assert np.array_equal(a.codebook, b.codebook) and np.array_equal(a.scales_bf16, b.scales_bf16), name
    q8 = d / "q8.gguf"
    _run("convert/to_gguf.py", str(tiny_run["teacher"]), "--type", "q8_0", "-o", str(q8), "--tokenizer-pre",
         "llama-bpe", "--no-progress")
    r = _run("-m", "qat.gptq_s3d8", "--model", str(tiny_run["teacher"]), "--calibration", str(tiny_run["text"]), "-o",
             str(d / "bad.safetensors"), "--calibration-tokens", "1024", "--calibration-seq-len", "128",
             "--no-progress", "--start", str(q8), ok=False)
    assert r.returncode == 2 and "no S3D8 tensor" in r.stderr

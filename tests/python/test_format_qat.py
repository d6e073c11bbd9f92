"""Simulation students (qat.train --format): the baseline formats of qat/formats.py trained by QAT.

For each format family (INT, Student-t, Lloyd-Max, S3D8) on a small random Llama: the student at step 0 is the
baseline sweep's direct cast bit for bit, a few steps lower the loss, a resume is bit-exact, and the converter
refuses the checkpoint. The teacher is smaller than fixtures.tiny_llama's (hidden 192) so that the four S3D8 codebook fits
per run stay cheap; hidden 192 also makes every matrix with k = 192 S3D8-ineligible (simulated with the codec's
pieces in the sweep, with qat.s3d8_torch in the student) while down_proj (k = 256) is eligible.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures import tiny_llama as tiny
from qat.formats import format_from_id, format_id
from qat.checkpoint import load_checkpoint
from qat.train import main
from qat.training.models import build_student, load_teacher
from test_qat_train import COMMON, _assert_identical

FORMATS = ("int6_g128", "studentt6_g128", "lloydmax6", "s3d8")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from fixtures.synthetic import llama_tensors, write_tiny_llama
    from fixtures.tiny_model import build_tokenizer

    d = tmp_path_factory.mktemp("format_qat")
    dims: dict[str, Any] = dict(hidden=192, layers=1, heads=2, kv_heads=1, ffn=256, vocab=tiny.VOCAB, tied=True)
    t = llama_tensors(**dims, seed=0, head_dim=96, std=0.03)
    build_tokenizer().save_pretrained(d / "tokenizer")
    teacher = write_tiny_llama(d / "teacher", d / "tokenizer", **dims, tensors=t, config_overrides={"head_dim": 96})
    return teacher, tiny.write_samples(d / "data.jsonl", n=8)


def _args(small: tuple[Path, Path], out: Path, fmt: str, *extra: str) -> list[str]:
    teacher, data = small
    return ["--teacher", str(teacher), "--data", str(data), "--out", str(out), *COMMON, "--format", fmt, *extra]


@pytest.fixture(scope="module", params=FORMATS)
def run(request, small, tmp_path_factory) -> tuple[str, Path]:
    """4 uninterrupted steps of one format: (format id, checkpoint)."""
    out = tmp_path_factory.mktemp(request.param)
    assert main(_args(small, out, request.param)) == 0
    return request.param, out / "checkpoint.pt"


def test_format_ids_round_trip_and_match_the_sweep() -> None:
    from research.baselines_smollm2 import plan

    for sid in ("int6_g128", "int16_g32_affine", "studentt6_g128", "lloydmax6", "s3d8"):
        assert format_id(format_from_id(sid)) == sid
    for spec, _ in plan():
        assert format_from_id(spec.id.removesuffix("_head8")) == spec.fmt, spec.id
    for bad in ("int6", "int6_g128_x", "lloydmax", "s3d8_round", ""):
        with pytest.raises(ValueError):
            format_from_id(bad)


def test_step0_student_is_the_direct_cast(small, run) -> None:
    """The student with the run's frozen fits and the teacher's weights (step 0) computes exactly what the sweep's
    direct cast (``quantise_model(..., method="direct")``, every Linear/Embedding with ``fmt.quantise``) computes:
    the same weight values bit for bit, hence the same logits bit for bit (same torch operations on the same
    values; activations are not quantised in either)."""
    from qat.gptq import quantise_model
    from qat.student import _dequantised, student_specs

    fmt_id, ck = run
    ckd = load_checkpoint(ck)
    assert ckd["weight_format"] == fmt_id
    student = build_student(small[0], specs_state=ckd["specs"]).eval()
    ref = load_teacher(small[0])
    quantise_model(ref, format_from_id(fmt_id), method="direct")
    params, ref_params = dict(student.named_parameters()), dict(ref.named_parameters())
    specs = student_specs(student)
    assert len(specs) == 8  # 7 Linears + the tied embedding / lm_head, once
    for name, spec in specs.items():
        assert torch.equal(_dequantised(params[name], spec), ref_params[name]), name
    ids = torch.tensor([[504, 40, 41, 42, 100, 200, 300, 43, 44, 45]])
    with torch.no_grad():
        assert torch.equal(student(ids).logits, ref(ids).logits)


def test_training_lowers_the_loss(run) -> None:
    losses = load_checkpoint(run[1])["losses"]
    assert len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_resume_is_bitwise_identical(small, run, tmp_path, capsys) -> None:
    fmt_id, ck = run
    assert main(_args(small, tmp_path, fmt_id, "--stop-after", "2")) == 0
    assert load_checkpoint(tmp_path / "checkpoint.pt")["step"] == 2
    other = "s3d8" if fmt_id != "s3d8" else "int6_g128"
    assert main(_args(small, tmp_path, other)) == 2  # another format does not resume this run
    assert f"written for --format {fmt_id}, not --format {other}" in capsys.readouterr().err
    assert main(_args(small, tmp_path, fmt_id)) == 0  # resumes from step 2
    _assert_identical(tmp_path / "checkpoint.pt", ck)


def test_export_refuses_a_simulation_checkpoint(small, run, tmp_path, capsys) -> None:
    from qat.export import main as export_main

    rc = export_main([str(run[1]), "-o", str(tmp_path / "x.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and f"qat.train --format {run[0]}" in err and "no GGUF form" in err
    assert not (tmp_path / "x.safetensors").exists()


def test_format_cli_errors(small, tmp_path, capsys) -> None:
    teacher, data = small
    base = ["--teacher", str(teacher), "--data", str(data), "--out", str(tmp_path), *COMMON]
    assert main([*base, "--format", "int6"]) == 2
    assert "unknown format id" in capsys.readouterr().err
    assert main([*base, "--format", "int6_g128", "--train-only", "s3d8"]) == 2
    assert "only apply to the GGUF S3D8 student" in capsys.readouterr().err
    assert not (tmp_path / "checkpoint.pt").exists()

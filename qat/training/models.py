"""QAT training, models and loading: the teacher's model type, the teacher, the fake-quantised student (fresh,
from a checkpoint, or started from an S3D8 tensor file: ``--init-from``), and the student's trainable parameters.

The lowest of the training modules (:mod:`qat.training`); imports no other of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Collection

import torch
from torch import nn

from gguf_s3d8.ggml_types import S3D8
from gguf_s3d8.tensor_file import S3D8TensorFileError, read_s3d8_tensors
from qat.checkpoint import load_checkpoint
from qat.errors import TrainError
from qat.student import (QuantEmbedding, QuantLinear, plan_format, plan_weights, quantise_student, spec_from_state,
                         start_from_containers)


SUPPORTED_MODEL_TYPES = ("llama", "mllama")


def model_type(path: Path) -> str:
    """The checkpoint's ``model_type`` (raises TrainError unless it is one qat.train supports)."""
    cfg_path = Path(path) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TrainError(f"{path}: not an HF checkpoint directory (config.json missing)") from None
    except (OSError, ValueError) as e:
        raise TrainError(f"{cfg_path}: cannot read ({e})") from e
    mt = cfg.get("model_type") if isinstance(cfg, dict) else None
    if mt not in SUPPORTED_MODEL_TYPES:
        raise TrainError(f"{path}: model_type {mt!r}; qat.train supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    return mt


def load_teacher(path: Path) -> nn.Module:
    if model_type(path) == "mllama":
        from transformers import MllamaForConditionalGeneration as Model  # heavy, optional: transformers
    else:
        from transformers import AutoModelForCausalLM as Model  # heavy, optional: transformers
    model = Model.from_pretrained(path, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


def build_student(teacher_dir: Path, *, specs_state: dict[str, Any] | None = None, fallback_type: str = "q8_0",
                  centroid_rule: str | None = None, seed: int = 0, act_quant: bool = True,
                  progress: bool = False, vision_type: str = "s3d8", weight_format: str | None = None,
                  given_codebooks: Collection[str] = ()) -> nn.Module:
    """A fresh fp32 copy of the teacher with every Linear/Embedding fake-quantised.

    Codebooks are fitted here (once) unless ``specs_state`` (from a checkpoint) provides them; not for the GGUF
    names in ``given_codebooks`` (``--init-from``: :func:`start_from_file` sets them). ``vision_type``:
    the type of the mllama vision encoder and projector matrices (the converter's ``--mmproj-type``).
    ``weight_format``: a simulation student of that ``qat.formats`` id (:func:`qat.student.plan_format`; the
    tables / codebooks fitted here unless ``specs_state`` has them) instead of the GGUF student.
    """
    model: Any = load_teacher(teacher_dir)  # an HF PreTrainedModel (.config)
    model.requires_grad_(True)
    if specs_state is None and weight_format is not None:
        if model.config.model_type != "llama":
            raise TrainError(f"--format: simulation students need a text Llama teacher, not {model.config.model_type}")
        specs: dict[str, Any] = plan_format(model, weight_format, progress=progress)
    elif specs_state is None:
        specs = plan_weights(model, teacher_dir, vision_type=vision_type if model.config.model_type == "mllama" else None,
                             fallback_type=fallback_type, centroid_rule=centroid_rule, seed=seed, progress=progress,
                             given_codebooks=given_codebooks)
    else:
        specs = {k: spec_from_state(v) for k, v in specs_state.items()}
    return quantise_student(model, specs, act_quant=act_quant)


def read_start_file(path: Path) -> Any:
    """The S3D8 tensor file of ``--init-from`` (``gguf_s3d8.tensor_file``), or a TrainError naming it."""
    try:
        return read_s3d8_tensors(path)
    except S3D8TensorFileError as e:
        raise TrainError(f"--init-from {path}: {e}") from e


def start_from_file(student: nn.Module, path: Path, *, announce: bool = True, tensors: Any = None) -> list[str]:
    """``--init-from``: start the S3D8 weights from the containers of an S3D8 tensor file (qat.student);
    ``tensors``: the file already read (:func:`read_start_file`)."""
    tensors = read_start_file(path) if tensors is None else tensors
    try:
        done, other = start_from_containers(student, tensors)
    except ValueError as e:
        raise TrainError(f"--init-from {path}: {e}") from e
    unused = sorted(set(tensors.containers) - set(done))
    if unused:
        raise TrainError(f"--init-from {path}: {', '.join(unused[:5])} are not S3D8 weights of this student")
    if announce:
        print(f"started {len(done)} S3D8 weights from {path} ({tensors.producer})", file=sys.stderr)
        if other:
            print(f"note: {len(other)} of them were computed from other weights than the teacher's (e.g. rounded to "
                  f"f16): {', '.join(other[:3])}{', ...' if len(other) > 3 else ''}", file=sys.stderr)
    return done


def s3d8_weights(student: nn.Module) -> list[torch.Tensor]:
    """The master weights of the student's S3D8 matrices (a tied embedding / LM head once)."""
    found: dict[int, torch.Tensor] = {}
    for m in student.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)) and m.spec.qtype == S3D8.name:
            found.setdefault(id(m.weight), m.weight)
    return list(found.values())


def freeze_all_but_s3d8(student: nn.Module) -> int:
    """Keep only the S3D8 weights trainable (a cheaper ablation of the recipe, which trains every parameter).

    Frozen fake-quantised weights are computed once and cached, so a step costs the S3D8 matrices' fake
    quantisation plus the forward/backward; the export is unchanged (frozen weights are the teacher's).
    Returns the number of trainable parameters.
    """
    student.requires_grad_(False)
    n = 0
    for w in s3d8_weights(student):
        w.requires_grad_(True)
        n += w.numel()
    if n == 0:
        raise TrainError("--train-only s3d8: the student has no S3D8 weight")
    return n


def param_groups(student: nn.Module, lr: float, s3d8_lr_scale: float = 1.0) -> list[dict[str, Any]]:
    """The optimiser's parameter groups: the S3D8 master weights at ``lr * s3d8_lr_scale``, every other trainable
    parameter at ``lr`` (one group when the scale is 1). A master moves by about the learning rate per Adam step,
    and an S3D8 entry changes only when its weight vector crosses into another codebook cell, so from a start at
    the cells' centres (``--init-from``) a larger step for the masters alone is what lets the indices move."""
    trainable = [p for p in student.parameters() if p.requires_grad]
    if s3d8_lr_scale == 1.0:  # the parameters' own order, as checkpoints written before this option have it
        return [{"params": trainable, "lr": lr}]
    s3d8 = {id(w) for w in s3d8_weights(student)}
    masters = [p for p in trainable if id(p) in s3d8]
    rest = [p for p in trainable if id(p) not in s3d8]
    return [g for g in ({"params": masters, "lr": lr * s3d8_lr_scale}, {"params": rest, "lr": lr}) if g["params"]]


def student_from_checkpoint(path: Path | dict[str, Any], teacher_dir: Path | None = None, *,
                            act_quant: bool = True) -> nn.Module:
    """The student of a checkpoint file or of one already loaded by :func:`load_checkpoint` (frozen codebooks,
    master weights), e.g. for evaluation (an mllama student computes with llama.cpp's vision semantics inside
    :func:`qat.mllama_hf.meta_taps`)."""
    ck = path if isinstance(path, dict) else load_checkpoint(path)  # a simulation checkpoint rebuilds its student
    student = build_student(Path(teacher_dir or ck["teacher"]), specs_state=ck["specs"], act_quant=act_quant)
    student.load_state_dict(ck["model"])
    return student

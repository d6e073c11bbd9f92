"""Self-distillation QAT of an HF Llama or Llama 3.2 Vision (mllama) to S3D8 (reference recipe §4), on CPU or
under ``torchrun``.

``python -m qat.train --help`` explains every option. The student (:mod:`qat.student`) computes with exactly
the weights and activation quantisation the exported GGUF (``convert/to_gguf.py --type s3d8 --qat-checkpoint``)
will use; the loss is the forward KL(teacher || student) over the full vocabulary at the positions that predict
response tokens (with a ``.txt`` file of plain text as ``--data``: every next token of its windows), summed and
divided by the number of such tokens in the global batch. AdamW (0.9, 0.95, no
weight decay), cosine schedule without warm-up, no gradient clipping; every parameter is trained, in fp32.

mllama: every sample has one image (``qat.generate`` output); the student fake-quantises the text model to S3D8
and the vision encoder and projector to ``--vision-type`` (the converter's ``--mmproj-type``), types and layouts
planned from the converter's own sources; teacher and student take the vision features as llama.cpp does
(:func:`qat.mllama_hf.meta_taps`). The patch-embedding convolution, norms, gates and position tables are trained
unquantised, as in the recipe (the GGUF stores the convolution in F16).

Simulation students (``--format ID``, an id of the baseline sweep such as ``int6_g128``, ``studentt6_g128``,
``lloydmax6``, ``s3d8``): instead of the GGUF student, every Linear and Embedding weight (a tied lm_head /
embedding once) computes with that ``qat.formats`` format - the sweep's scope; activations unquantised. The
format's per-matrix part (tables, codebook) is fitted once on the teacher's weights and frozen, block / row
scales come from the current fp32 masters every step, the gradient is straight-through (identity). Everything
else (loss, data, optimiser, schedule, checkpoints, torchrun) is the same; the checkpoint records the format, a
resume refuses another one, and the converter refuses such checkpoints (no GGUF form). Text Llama teachers only.

Determinism: the global batch of step s is a pure function of (seed, s) (a seeded permutation per epoch), so a
run resumed from a checkpoint continues with the same batches; on CPU the loss curve of a resumed run equals
the uninterrupted one bit for bit. Under ``torchrun`` (gloo on CPU, nccl on GPUs) each rank takes a contiguous
slice of the global batch and its loss is scaled by the world size, so that the gradient average of DDP or
FSDP2 (``--parallel``) equals the single-process gradient of the global batch. Checkpoints have one format
(full fp32 masters and optimiser state, written by rank 0) whatever wrote them; any run resumes from any.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Collection, NoReturn, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from qat.checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_NAME, CHECKPOINT_VERSION, load_checkpoint,
                            remove_stale_checkpoint_tmps, save_checkpoint)
from qat.errors import TrainError


# ---------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class Example:
    """Token ids of prompt + response (truncated to the sequence length) and the positions the loss uses."""

    ids: list[int]
    first_loss_pos: int  # positions first_loss_pos .. len(ids) - 2 predict response tokens
    image: str | None = None  # path of the sample's image (mllama)


def tokenise_samples(samples: Sequence[Any], tokenizer: Any, seq_len: int,
                     image_token_id: int | None = None) -> list[Example]:
    """Training examples of ``qat.data.Sample`` s: ``prompt_text + response`` (+ EOS when the teacher stopped).

    Prompt and response are tokenised separately (``add_special_tokens=False``), so the boundary is exact; the
    loss positions are those whose next token is a response token. Samples whose prompt leaves no response
    token within ``seq_len`` are dropped. With ``image_token_id`` (mllama) every sample must have an image and
    exactly one image token in its prompt; without it (text models) no sample may have an image.
    """
    out: list[Example] = []
    for s in samples:
        if image_token_id is None and s.image is not None:
            raise TrainError(f"sample {s.id} has an image; a text model trains on text-only data")
        if image_token_id is not None and s.image is None:
            raise TrainError(f"sample {s.id} has no image; mllama training needs an image per sample")
        p = tokenizer(s.prompt_text, add_special_tokens=False)["input_ids"]
        if image_token_id is not None and p.count(image_token_id) != 1:
            raise TrainError(f"sample {s.id}: the prompt has {p.count(image_token_id)} image tokens, expected 1")
        r = tokenizer(s.response, add_special_tokens=False)["input_ids"]
        if s.finish_reason == "stop" and tokenizer.eos_token_id is not None:
            r = r + [tokenizer.eos_token_id]
        ids = (p + r)[:seq_len]
        if len(p) >= 1 and len(ids) > len(p):
            out.append(Example(ids, len(p) - 1, s.image))
    return out


def text_examples(path: Path, tokenizer: Any, seq_len: int) -> list[Example]:
    """Training examples of a plain-text file: the whole text tokenised once (``add_special_tokens=False``, as
    :func:`qat.text_eval.token_windows` does for the evaluation) and cut into consecutive windows of ``seq_len``
    tokens; every position but the last predicts the next token and is a loss position (distillation on text)."""
    from qat.text_eval import token_windows

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TrainError(f"{path}: not UTF-8 text ({e}); --data takes a qat.generate JSONL or a .txt file") from e
    try:
        windows = token_windows(tokenizer, text, ctx=seq_len, max_tokens=None)
    except ValueError as e:
        raise TrainError(f"{path}: {e} (--seq-len {seq_len})") from e
    return [Example([int(t) for t in row], 0) for row in windows]


def load_examples(path: Path, tokenizer: Any, seq_len: int, image_token_id: int | None = None) -> list[Example]:
    """The training examples of ``--data``: a ``.txt`` file is plain text (:func:`text_examples`; text models
    only), anything else JSONL samples of ``qat.generate`` (:func:`tokenise_samples`)."""
    from qat.data import read_samples

    if not path.is_file():
        raise TrainError(f"{path}: no such data file")
    if path.suffix == ".txt":
        if image_token_id is not None:
            raise TrainError(f"{path}: plain-text data trains text models; mllama needs image samples (qat.generate)")
        return text_examples(path, tokenizer, seq_len)
    examples = tokenise_samples(read_samples(path), tokenizer, seq_len, image_token_id)
    if not examples:
        raise TrainError(f"{path}: no sample has a response token within --seq-len {seq_len}")
    return examples


def batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """Dataset indices of the global batch of ``step``: consecutive slots of seeded per-epoch permutations."""
    out = []
    for g in range(step * batch, (step + 1) * batch):
        epoch, i = divmod(g, n)
        out.append(int(np.random.default_rng([seed, epoch]).permutation(n)[i]))
    return out


def collate(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and the boolean loss mask (B, T)."""
    t = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), t), dtype=torch.long)
    mask = torch.zeros((len(examples), t), dtype=torch.bool)
    for b, e in enumerate(examples):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        attn[b, : len(e.ids)] = 1
        mask[b, e.first_loss_pos: len(e.ids) - 1] = True
    return ids, attn, mask


class Batcher:
    """Model inputs and loss mask of a list of examples: text only, or with the images of mllama samples."""

    def __init__(self, pad_id: int, processor: Any = None, image_token_id: int | None = None,
                 max_num_tiles: int = 4) -> None:
        self.pad_id, self.processor, self.image_token_id, self.max_num_tiles = pad_id, processor, image_token_id, max_num_tiles
        self._images: dict[str, Any] = {}

    def _image(self, path: str | None) -> Any:
        if path is None:
            raise TrainError("a sample without an image for a vision model (qat.generate writes one per sample)")
        if path not in self._images:
            from qat.generate import load_rgb

            try:
                self._images[path] = load_rgb(Path(path))
            except Exception as e:  # PIL raises assorted types for unreadable files
                raise TrainError(f"{path}: cannot read the sample's image ({e})") from e
        return self._images[path]

    def __call__(self, examples: Sequence[Example]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids, attn, mask = collate(examples, self.pad_id)
        inputs = {"input_ids": ids, "attention_mask": attn}
        if self.image_token_id is not None:
            from qat.mllama_hf import cross_attention_mask, image_batch

            img = image_batch(self.processor.image_processor, [self._image(e.image) for e in examples])
            cam = cross_attention_mask([e.ids for e in examples], self.image_token_id, img.pop("num_tiles"),
                                       self.max_num_tiles, ids.shape[1])
            inputs.update(img, cross_attention_mask=torch.from_numpy(cam))
        return inputs, mask


def sample_inputs(teacher: Path) -> tuple[Any, Batcher, int | None]:
    """The teacher's tokenizer, a :class:`Batcher` for its samples and its image token id (mllama; None for a text
    model, whose samples have no image)."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    if model_type(teacher) != "mllama":
        tokenizer = AutoTokenizer.from_pretrained(teacher)
        processor, image_token_id, max_num_tiles = None, None, 4
    else:
        processor = AutoProcessor.from_pretrained(teacher)
        tokenizer = processor.tokenizer
        cfg = AutoConfig.from_pretrained(teacher)
        image_token_id, max_num_tiles = int(cfg.image_token_index), int(cfg.vision_config.max_num_tiles)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return tokenizer, Batcher(pad_id, processor, image_token_id, max_num_tiles), image_token_id


def n_loss_tokens(examples: Sequence[Example]) -> int:
    return sum(len(e.ids) - 1 - e.first_loss_pos for e in examples)


# ---------------------------------------------------------------------------------------------------
# model


class SelectedLogits(nn.Module):
    """Logits of a causal LM at the masked positions only (the LM head is the costly part at 49k vocab)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm: Any = lm  # an HF causal LM (.model, .lm_head)

    def forward(self, mask: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(**inputs).last_hidden_state
        return self.lm.lm_head(hidden[mask])


def kl_sum(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Sum over rows of KL(p_T || p_S) = sum_v p_T (log p_T - log p_S), full vocabulary, fp32."""
    lt = F.log_softmax(teacher_logits.float(), dim=-1)
    ls = F.log_softmax(student_logits.float(), dim=-1)
    return (lt.exp() * (lt - ls)).sum()


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
        from transformers import MllamaForConditionalGeneration as Model
    else:
        from transformers import AutoModelForCausalLM as Model
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
    from qat.student import plan_format, plan_weights, quantise_student, spec_from_state

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
    from gguf_s3d8.tensor_file import S3D8TensorFileError, read_s3d8_tensors

    try:
        return read_s3d8_tensors(path)
    except S3D8TensorFileError as e:
        raise TrainError(f"--init-from {path}: {e}") from e


def start_from_file(student: nn.Module, path: Path, *, announce: bool = True, tensors: Any = None) -> list[str]:
    """``--init-from``: start the S3D8 weights from the containers of an S3D8 tensor file (qat.student);
    ``tensors``: the file already read (:func:`read_start_file`)."""
    from qat.student import start_from_containers

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
    from qat.student import QuantEmbedding, QuantLinear

    found: dict[int, torch.Tensor] = {}
    for m in student.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)) and m.spec.qtype == "s3d8":
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


def _renumbered(osd: dict[str, Any], keys: Sequence[Any]) -> dict[str, Any]:
    """An optimiser state dict with its parameters renamed in order (torch.optim's indices <-> DCP's names)."""
    old = [k for g in osd["param_groups"] for k in g["params"]]
    new = dict(zip(old, keys, strict=True))
    return {"state": {new[k]: v for k, v in osd["state"].items()},
            "param_groups": [{**g, "params": [new[k] for k in g["params"]]} for g in osd["param_groups"]]}


def full_state_dicts(student: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimiser state dicts of an FSDP2 student, gathered on rank 0 (in CPU memory; empty on the
    other ranks, every rank must call), in the single-process format: tied weights share one tensor, the
    optimiser state is keyed by parameter index."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(student, options=options)
    opt_sd: dict[str, Any] = get_optimizer_state_dict(student, opt, options=options)
    if torch.distributed.get_rank() != 0:
        return {}, {}
    first: dict[int, str] = {}
    for name, p in student.named_parameters(remove_duplicate=False):
        model_sd[name] = model_sd[first.setdefault(id(p), name)]
    n_params = sum(len(g["params"]) for g in opt_sd["param_groups"])
    return model_sd, _renumbered(opt_sd, range(n_params))


def load_full_optimizer_state(student: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a checkpoint's (full, index-keyed) optimiser state into the optimiser of an FSDP2 student: each rank
    keeps its shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in student.named_parameters()}
    by_name = _renumbered(state, [names[id(p)] for g in opt.param_groups for p in g["params"]])
    set_optimizer_state_dict(student, opt, by_name, options=StateDictOptions(full_state_dict=True))


# ---------------------------------------------------------------------------------------------------
# training loop


def default_lr(bits: float) -> float:
    """The recipe's learning rate for a b-bit format: 2^-(b + 14) (S3D8, b = 3: 2^-17)."""
    return 2.0 ** -(bits + 14)


#: Timeout of every collective (and of the rendezvous). Ranks legitimately wait on each other for long: rank 0
#: gathers and writes the checkpoint (an 11B student with its optimiser state is ~130 GB) while the others wait in
#: the next collective, and on a loaded machine one rank can be descheduled for minutes. NCCL's default (10 min)
#: is too short for that; a real hang still ends (and under torchrun a crashed rank stops the others at once).
DIST_TIMEOUT = timedelta(hours=2)

#: Whether this process created the default process group (and so must tear it down, see :func:`_leave_dist`).
_created_process_group = False
#: Whether this process ran as one rank of several (then ``python -m qat.train`` ends with :func:`_end_rank`).
_ran_as_rank = False


def _dist() -> tuple[int, int]:
    global _created_process_group, _ran_as_rank
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        if torch.cuda.is_available():  # before any CUDA use: NCCL and FSDP2 work on the current device
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=DIST_TIMEOUT)
        _created_process_group = _ran_as_rank = True
    rank = torch.distributed.get_rank() if world > 1 else 0
    return rank, world


def _leave_dist(ok: bool) -> None:
    """Tear down the process group this process created: after a successful run, a barrier (no rank leaves while
    another still has a collective to do), then ``destroy_process_group`` (the documented teardown; for NCCL it
    frees the communicators). After an error nothing: another rank may be stuck in a collective this one will never
    join, and a teardown (an NCCL abort in particular) could then block; the exit status reports the failure.

    This does not stop gloo's threads: DDP and FSDP2 keep references to the group (its two ``pt_gloo_runloop``
    workers and the ``gloo_tcp_loop`` thread are still alive after ``destroy_process_group`` and ``gc.collect``),
    so the rank must not finalise its interpreter with them (:func:`_end_rank`)."""
    global _created_process_group
    if not _created_process_group or not torch.distributed.is_initialized():
        return
    _created_process_group = False
    if ok:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _end_rank(status: int) -> NoReturn:
    """End a rank's process without interpreter finalisation (stdout and stderr flushed; every file qat.train
    writes is closed, the checkpoint fsynced).

    Why: a gloo worker that has completed a collective still holds the work object until it re-takes its lock;
    the main thread, woken by the completion, can meanwhile reach ``Py_FinalizeEx``. When the worker then drops the
    work, freeing a tensor whose PyObject C++ keeps alive takes the GIL; CPython ends a thread that asks for the GIL
    during finalisation with ``pthread_exit``, whose forced unwind through the (noexcept) destructor calls
    ``std::terminate``: "terminate called without an active exception", SIGABRT of that rank, and torchrun kills
    the others (gdb: ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> gil_scoped_acquire -> take_gil ->
    PyThread_exit_thread -> __gxx_personality_v0 -> std::terminate). The window is the worker's delay in
    dropping the work, so it opens on loaded machines. Without finalisation no thread can ask for the GIL."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def fully_shard_student(net: nn.Module, student: nn.Module, device: torch.device, world: int) -> None:
    """FSDP2 (``fully_shard``): each transformer layer (the model's ``_no_split_modules``: Llama decoder layers;
    mllama's self- and cross-attention decoder layers and vision encoder layers) is one all-gather unit, ``net``
    the root holding the rest (embeddings and the tied LM head, norms, projector, vision stem). The specs'
    codebooks and permutations are plain attributes of the fake-quantised modules, replicated on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    hf: Any = student  # an HF PreTrainedModel
    layers = set(hf._no_split_modules)
    for m in student.modules():
        if type(m).__name__ in layers:
            fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)


def train(args: argparse.Namespace) -> list[float]:
    """Run (or resume) training as ``args`` says; returns the loss of every step done so far."""
    torch.set_num_threads(args.threads)
    if args.format is not None:
        _check_format_options(args)
    rank, world = _dist()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if torch.cuda.is_available() else torch.device("cpu")
    if args.batch % world:
        raise TrainError(f"--batch {args.batch} is not divisible by the number of ranks ({world})")
    local = args.batch // world
    micro = args.micro_batch or local
    if local % micro:
        raise TrainError(f"per-rank batch {local} is not divisible by --micro-batch {micro}")
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    ck_path = out_dir / CHECKPOINT_NAME
    if rank == 0:
        for tmp in remove_stale_checkpoint_tmps(ck_path):
            print(f"removed {tmp}, the temporary file of a run killed while saving", file=sys.stderr)

    from transformers import get_scheduler

    mllama = model_type(args.teacher) == "mllama"
    tokenizer, batcher, image_token_id = sample_inputs(args.teacher)
    examples = load_examples(args.data, tokenizer, args.seq_len, image_token_id)

    resume = args.resume and ck_path.is_file()
    ck = load_checkpoint(ck_path) if resume else None
    if ck is not None and ck["steps"] != args.steps:
        raise TrainError(f"{ck_path}: written for --steps {ck['steps']}, not {args.steps} (the schedule depends on it)")
    ck_scale = float(ck.get("args", {}).get("s3d8_lr_scale", 1.0)) if ck is not None else args.s3d8_lr_scale
    if ck_scale != args.s3d8_lr_scale:
        raise TrainError(f"{ck_path}: written for --s3d8-lr-scale {ck_scale}, not {args.s3d8_lr_scale}")
    if ck is not None and ck.get("weight_format") != args.format:
        def what(f: str | None) -> str:
            return "the GGUF S3D8 student (no --format)" if f is None else f"--format {f}"
        raise TrainError(f"{ck_path}: written for {what(ck.get('weight_format'))}, not {what(args.format)}")
    progress = not args.no_progress and rank == 0
    start = read_start_file(args.init_from) if ck is None and args.init_from is not None else None
    student: Any = build_student(args.teacher, specs_state=ck["specs"] if ck else None, fallback_type=args.fallback_type,
                            centroid_rule=args.centroid_rule, seed=args.seed, act_quant=not args.no_act_quant,
                            progress=progress, vision_type=args.vision_type, weight_format=args.format,
                            given_codebooks=set(start.containers) if start is not None else ())
    if ck is not None:
        student.load_state_dict(ck["model"])
    elif start is not None:
        start_from_file(student, args.init_from, announce=rank == 0, tensors=start)
    if args.train_only == "s3d8":
        freeze_all_but_s3d8(student)
    teacher = load_teacher(args.teacher)
    student.to(device)
    teacher.to(device)
    if args.grad_checkpointing:
        student.gradient_checkpointing_enable(  # deprecated alias, kept by transformers 5
            gradient_checkpointing_kwargs={"use_reentrant": False})
    student.train()
    net: Any = SelectedLogits(student)  # or its DDP / FSDP2 wrapper
    fsdp = world > 1 and args.parallel == "fsdp2"
    if fsdp:
        fully_shard_student(net, student, device, world)
    elif world > 1:
        net = nn.parallel.DistributedDataParallel(net)
    teacher_net = SelectedLogits(teacher)

    lr = args.lr if args.lr is not None else default_lr(args.lr_bits)
    opt = torch.optim.AdamW(param_groups(student, lr, args.s3d8_lr_scale), lr=lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    from qat.student import weights_stepped

    opt.register_step_post_hook(lambda *_: weights_stepped())  # FSDP2 does not bump the weights' versions
    sched = get_scheduler("cosine", opt, num_warmup_steps=0, num_training_steps=args.steps)
    losses: list[float] = []
    step = 0
    if ck is not None:
        if fsdp:
            load_full_optimizer_state(student, opt, ck["optimizer"])
        else:
            opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        losses, step = list(ck["losses"]), int(ck["step"])

    def state() -> dict[str, Any]:
        """The checkpoint (complete on rank 0; under FSDP2 every rank must call, the shards are gathered)."""
        from qat.student import student_specs

        model_sd, opt_sd = full_state_dicts(student, opt) if fsdp else (student.state_dict(), opt.state_dict())
        return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "teacher": str(Path(args.teacher).resolve()),
                "weight_format": args.format, "step": step, "steps": args.steps, "losses": losses, "lr": lr,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "specs": {k: s.state() for k, s in student_specs(student).items()},
                "model": model_sd, "optimizer": opt_sd, "scheduler": sched.state_dict()}

    stop_at = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)
    taps: Callable[[], AbstractContextManager[Any]] = nullcontext
    if mllama:
        from qat.mllama_hf import meta_taps

        taps = meta_taps
    from tqdm import tqdm

    bar = tqdm(total=args.steps, initial=step, desc="QAT", unit="step", disable=not progress, file=sys.stderr,
               dynamic_ncols=True)
    t0 = time.time()
    while step < stop_at:
        idx = batch_indices(step, args.batch, len(examples), args.seed)
        n_tok = n_loss_tokens([examples[i] for i in idx])
        mine = idx[rank * local:(rank + 1) * local]
        total = torch.zeros((), dtype=torch.float64, device=device)
        for m0 in range(0, local, micro):
            inputs, mask = batcher([examples[i] for i in mine[m0:m0 + micro]])
            inputs, mask = {k: v.to(device) for k, v in inputs.items()}, mask.to(device)
            with torch.no_grad(), taps():
                t_logits = teacher_net(mask, **inputs)
            last = m0 + micro >= local
            if fsdp:  # accumulate the unsharded gradients, reduce-scatter (average) after the last micro-batch
                net.set_requires_gradient_sync(last)
            ctx = net.no_sync() if world > 1 and not fsdp and not last else nullcontext()
            with ctx, taps():
                s = kl_sum(t_logits, net(mask, **inputs))
                (s * (world / n_tok)).backward()
            total += s.detach().double()
        if world > 1:
            torch.distributed.all_reduce(total)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        losses.append(float(total) / n_tok)
        if not math.isfinite(losses[-1]):
            raise TrainError(f"step {step}: loss is {losses[-1]}")
        bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{sched.get_last_lr()[0]:.3g}")
        bar.update(1)
        if step % args.save_every == 0 or step == stop_at:
            ck_state = state() if fsdp or rank == 0 else None  # FSDP2: every rank takes part in the gather
            if rank == 0:
                assert ck_state is not None
                save_checkpoint(ck_path, ck_state)
    bar.close()
    if rank == 0:
        _write_json(out_dir / "losses.json", {"steps_done": step, "steps": args.steps, "lr": lr,
                                              "seconds_this_run": time.time() - t0, "losses": losses})
    return losses


def _write_json(path: Path, obj: Any) -> None:
    from gguf_s3d8.fsio import atomic_write

    try:
        atomic_write(path, json.dumps(obj, indent=1) + "\n")
    except OSError as e:
        raise TrainError(f"{path}: cannot write: {e.strerror or e}") from e


# ---------------------------------------------------------------------------------------------------
# command line


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The training options an experiment script passes through to ``qat.train`` (see :func:`run_argv`)."""
    p.add_argument("--data", type=Path, required=True,
                   help="JSONL from python -m qat.generate --text-only, or a .txt file of plain text (seq-len windows)")
    p.add_argument("--steps", type=int, default=300, help="optimiser steps (default %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default %(default)s)")
    p.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute activations in the backward pass (default on: ~12 s per step for SmolLM2 here)")


def run_argv(a: argparse.Namespace, teacher: Path, out: Path) -> list[str]:
    """``qat.train`` arguments for the options of :func:`add_run_options` (checkpoint every 25 steps)."""
    return ["--teacher", str(teacher), "--data", str(a.data), "--out", str(out), "--steps", str(a.steps),
            "--batch", str(a.batch), "--seq-len", str(a.seq_len), "--threads", str(a.threads), "--save-every", "25",
            "--grad-checkpointing" if a.grad_checkpointing else "--no-grad-checkpointing"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m qat.train", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:]),
        epilog="example:\n  python -m qat.train --teacher .cache/models/SmolLM2-135M-Instruct-hf --data gen.jsonl "
               "--out .cache/qat/run1 --steps 300 --batch 4 --seq-len 256\n"
               "  torchrun --nproc_per_node 2 -m qat.train ... (same options; --batch is the global batch)\n"
               "  torchrun --nproc_per_node 2 -m qat.train ... --parallel fsdp2 (sharded; same checkpoints)\n"
               "exit status: 0 ok, 2 bad input/options or a failed write (disk full: the last checkpoint is intact), "
               "130 interrupted (the last checkpoint is intact)")
    p.add_argument("--teacher", type=Path, required=True, metavar="DIR",
                   help="HF checkpoint directory of the teacher (LlamaForCausalLM or MllamaForConditionalGeneration); "
                        "the student starts as its copy")
    p.add_argument("--data", type=Path, required=True, metavar="FILE",
                   help="synthetic samples (qat.data schema JSONL, e.g. from python -m qat.generate --text-only; the "
                        "loss is on the response tokens), or a .txt file of plain text for a text model: tokenised "
                        "and cut into consecutive --seq-len windows, the loss on every next token")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help=f"run folder: {CHECKPOINT_NAME} (model, codebooks, optimiser, schedule, losses) and losses.json")
    p.add_argument("--steps", type=int, default=300, help="optimiser steps of the whole run (cosine schedule length; default %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="global batch in sequences, split across ranks (default %(default)s)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per forward/backward on a rank; gradients are accumulated (default: the per-rank batch)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence, prompt included; longer ones are cut (default %(default)s)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 2^-(LR_BITS + 14))")
    p.add_argument("--s3d8-lr-scale", type=float, default=1.0, metavar="F",
                   help="learning rate of the S3D8 master weights = F x the peak learning rate (default "
                        "%(default)s; > 1 lets the S3D8 entries of an --init-from start change within a short run)")
    p.add_argument("--lr-bits", type=float, default=3.0, help="bits b of the format in the default lr 2^-(b+14) (default %(default)s: 2^-17)")
    p.add_argument("--seed", type=int, default=0, help="seed of the codebook fit and the batch order (default %(default)s)")
    p.add_argument("--format", default=None, metavar="ID",
                   help="train a simulation student of this baseline format instead of the GGUF S3D8 student: "
                        "int<K>_g<G>[_affine], studentt<K>_g<G>, lloydmax<K> or s3d8 (the sweep's ids, "
                        "qat.formats.format_from_id); every Linear/Embedding weight in that format, tables and "
                        "codebooks fitted once on the teacher and frozen, scales from the current weights, "
                        "activations unquantised; no GGUF export; --seed then only orders the batches, the fits are "
                        "the format's own, as in the sweep (default: the GGUF student)")
    p.add_argument("--fallback-type", choices=("q8_0", "f16", "bf16", "f32"), default="q8_0",
                   help="type of the matrices S3D8 cannot hold; must match the converter's --fallback-type (default %(default)s)")
    p.add_argument("--vision-type", choices=("s3d8", "q8_0", "f16", "bf16", "f32"), default="s3d8",
                   help="mllama: type of the vision encoder and projector matrices; export with the same "
                        "--mmproj-type (default %(default)s, as the recipe)")
    p.add_argument("--centroid-rule", choices=("round", "trunc"), default=None,
                   help="S3D8 centroid rule of the codebook fit (default: the codec's)")
    p.add_argument("--init-from", type=Path, default=None, metavar="FILE",
                   help="start from the S3D8 containers of FILE (python -m qat.gptq_s3d8 -o FILE: GPTQ or the "
                        "importance-aware encoder) instead of the direct cast: their codebooks and row scales stay "
                        "frozen and the masters start at their values (ignored when resuming)")
    p.add_argument("--train-only", choices=("all", "s3d8"), default="all",
                   help="all: every parameter, as the recipe (default); s3d8: only the S3D8 weights (ablation for "
                        "small CPU budgets: the other fake-quantised weights are computed once)")
    p.add_argument("--no-act-quant", action="store_true", help="keep activations in fp32 (ablation; the GGUF will not match)")
    p.add_argument("--grad-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute decoder layers in the backward pass (default: on)")
    p.add_argument("--save-every", type=int, default=50, help="write the checkpoint every N steps and at the end (default %(default)s)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help=f"continue from OUT/{CHECKPOINT_NAME} when it exists (default: on)")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="stop (checkpointed) after N steps of this invocation, keeping the full schedule")
    p.add_argument("--parallel", choices=("ddp", "fsdp2"), default="ddp",
                   help="data parallelism under torchrun with more than one rank (ignored in one process): ddp "
                        "(every rank holds the whole student, gradients all-reduced) or fsdp2 (torch's fully_shard: "
                        "parameters, gradients and optimiser state sharded, per transformer layer); the teacher is "
                        "whole on every rank either way (default %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads per process (default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return p


def _check_format_options(args: argparse.Namespace) -> None:
    """--format: a known id, and none of the options that only make sense for the GGUF student."""
    from qat.formats import format_from_id

    format_from_id(args.format)  # ValueError for an unknown id
    gguf_only = [opt for opt, bad in (("--train-only s3d8", args.train_only != "all"),
                                      ("--fallback-type", args.fallback_type != "q8_0"),
                                      ("--vision-type", args.vision_type != "s3d8"),
                                      ("--centroid-rule", args.centroid_rule is not None),
                                      ("--init-from", args.init_from is not None)) if bad]
    if gguf_only:
        raise TrainError(f"--format: {', '.join(gguf_only)} only apply to the GGUF S3D8 student")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("steps", "batch", "seq_len", "save_every", "threads"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    ok = False
    try:
        train(args)
        ok = True
        return 0
    except (TrainError, OSError, ValueError) as e:
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the last checkpoint is intact; rerun the same command to resume", file=sys.stderr)
        return 130
    finally:
        _leave_dist(ok)


if __name__ == "__main__":
    exit_status = main()
    if _ran_as_rank:
        _end_rank(exit_status)
    raise SystemExit(exit_status)

"""QAT training, the loop: :func:`train` runs (or resumes) a run as the command line says - batches, the
teacher's and the student's logits, the loss, the optimiser and schedule, checkpoints, the losses file.

Imports the other training modules (models, data, loss, distributed); :mod:`qat.train` is its command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from tqdm import tqdm

from gguf_s3d8.fsio import atomic_write
from qat.checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_NAME, CHECKPOINT_VERSION, load_checkpoint,
                            remove_stale_checkpoint_tmps, save_checkpoint)
from qat.errors import TrainError
from qat.formats import format_from_id
from qat.mllama_hf import meta_taps
from qat.student import student_specs, weights_stepped
from qat.training.data import batch_indices, load_examples, n_loss_tokens, sample_inputs
from qat.training.distributed import fully_shard_student, full_state_dicts, init_dist, load_full_optimizer_state
from qat.training.loss import SelectedLogits, default_lr, kl_sum
from qat.training.models import (build_student, freeze_all_but_s3d8, load_teacher, model_type, param_groups,
                                 read_start_file, start_from_file)


def train(args: argparse.Namespace) -> list[float]:
    """Run (or resume) training as ``args`` says; returns the loss of every step done so far."""
    torch.set_num_threads(args.threads)
    if args.format is not None:
        _check_format_options(args)
    rank, world = init_dist()
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

    from transformers import get_scheduler  # heavy, optional: transformers

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
        model_sd, opt_sd = full_state_dicts(student, opt) if fsdp else (student.state_dict(), opt.state_dict())
        return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "teacher": str(Path(args.teacher).resolve()),
                "weight_format": args.format, "step": step, "steps": args.steps, "losses": losses, "lr": lr,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "specs": {k: s.state() for k, s in student_specs(student).items()},
                "model": model_sd, "optimizer": opt_sd, "scheduler": sched.state_dict()}

    stop_at = args.steps if args.stop_after is None else min(args.steps, step + args.stop_after)
    taps: Callable[[], AbstractContextManager[Any]] = nullcontext
    if mllama:
        taps = meta_taps

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
    try:
        atomic_write(path, json.dumps(obj, indent=1) + "\n")
    except OSError as e:
        raise TrainError(f"{path}: cannot write: {e.strerror or e}") from e


def _check_format_options(args: argparse.Namespace) -> None:
    """--format: a known id, and none of the options that only make sense for the GGUF student."""
    format_from_id(args.format)  # ValueError for an unknown id
    gguf_only = [opt for opt, bad in (("--train-only s3d8", args.train_only != "all"),
                                      ("--fallback-type", args.fallback_type != "q8_0"),
                                      ("--vision-type", args.vision_type != "s3d8"),
                                      ("--centroid-rule", args.centroid_rule is not None),
                                      ("--init-from", args.init_from is not None)) if bad]
    if gguf_only:
        raise TrainError(f"--format: {', '.join(gguf_only)} only apply to the GGUF S3D8 student")

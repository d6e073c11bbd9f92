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
import sys
import traceback
from pathlib import Path
from typing import Sequence

from qat.checkpoint import CHECKPOINT_NAME
from qat.errors import TrainError
from qat.training.distributed import end_rank, leave_dist, ran_as_rank
from qat.training.loop import train


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
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the last checkpoint is intact; rerun the same command to resume", file=sys.stderr)
        return 130
    finally:
        leave_dist(ok)


if __name__ == "__main__":
    exit_status = main()
    if ran_as_rank():
        end_rank(exit_status)
    raise SystemExit(exit_status)

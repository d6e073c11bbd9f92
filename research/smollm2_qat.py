"""Proof on real weights: direct-cast S3D8 vs QAT S3D8 of SmolLM2-135M-Instruct (issue 6, item 4).

1. Data: text-only self-generated samples (``python -m qat.generate --text-only``), given as ``--data``, or a
   ``.txt`` file of plain text (e.g. the main job's ``train.txt``, Wikipedia articles disjoint from the evaluation's).
2. Direct cast: the student at step 0 (the converter's ``--type s3d8`` GGUF, bit for bit).
3. QAT: ``qat.train`` for ``--steps`` steps on that data.
4. Evaluation with ``qat.text_eval.evaluate`` (lockstep teacher) on held-out Wikipedia text
   (``fixtures.assets.wiki_text('eval')``, never trained on): KL(teacher || student) per token and perplexity.

Writes ``--json`` (results, losses, settings) and ``--plot`` (loss curve, KL and perplexity bars).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from qat.train import add_run_options, main as train_main, run_argv
from qat.training.data import load_examples
from qat.training.models import build_student, student_from_checkpoint

REPO = Path(__file__).resolve().parents[1]


def gguf_bits_per_param(teacher_dir: Path) -> float:
    """Bits per weight-matrix parameter of the student's GGUF (the converter's --type s3d8 plan, dry run):
    S3D8 where a container fits, Q8_0 elsewhere - what the KL/PPL below are paid for."""
    from convert.common import ConversionOptions
    from convert.to_gguf import convert

    report = convert(teacher_dir, Path("/dev/null"), ConversionOptions(out_type="s3d8"), progress=False, dry_run=True)
    return report.weight_bits_per_param()


def _evaluate(model: torch.nn.Module, teacher: torch.nn.Module, windows: torch.Tensor) -> dict[str, float]:
    from qat.text_eval import evaluate

    t0 = time.time()
    r = evaluate(model, teacher, windows=windows).to_dict()
    r["seconds"] = time.time() - t0
    return r


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    losses = result["losses"]
    ax[0].plot(range(1, len(losses) + 1), losses, lw=1)
    ax[0].set(xlabel="step", ylabel="train KL (nats/token)", title="QAT loss (" + ("plain text" if result["settings"]["data"].endswith(".txt") else "synthetic data") + ")")
    names = ["direct cast" if result.get("start", "direct cast") == "direct cast" else "start", "QAT"]
    ax[1].bar(names, [result["direct_cast"]["kl"], result["qat"]["kl"]], color=["tab:red", "tab:green"])
    ax[1].set(ylabel="KL to teacher (nats/token)", title="held-out wiki KL")
    ax[2].bar(["teacher"] + names, [result["direct_cast"]["ppl_teacher"], result["direct_cast"]["ppl"],
                                    result["qat"]["ppl"]], color=["tab:blue", "tab:red", "tab:green"])
    ax[2].set(ylabel="perplexity", title="held-out wiki perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    from fixtures.assets import smollm2_hf_dir, wiki_text

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p)
    p.add_argument("--run", type=Path, default=REPO / ".cache" / "qat-smollm2" / "run", help="training run folder")
    p.add_argument("--lr", type=float, default=None, help="default: qat.train's 2^-17")
    p.add_argument("--s3d8-lr-scale", type=float, default=1.0, help="passed to qat.train")
    p.add_argument("--eval-ctx", type=int, default=256)
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--train-only", choices=("all", "s3d8"), default="all", help="passed to qat.train")
    p.add_argument("--init-from", type=Path, default=None, metavar="FILE",
                   help="passed to qat.train: start from these S3D8 containers (python -m qat.gptq_s3d8) instead of "
                        "the direct cast; the step-0 evaluation is then that start")
    p.add_argument("--json", type=Path, default=REPO / "research" / "results" / "smollm2_qat.json")
    p.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "qat.png")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from qat.data import read_samples
    from qat.text_eval import token_windows
    from qat.training.models import load_teacher

    teacher_dir = smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    windows = token_windows(tok, wiki_text("eval"), ctx=a.eval_ctx, max_tokens=a.eval_tokens)
    teacher = load_teacher(teacher_dir)
    result: dict = {"model": "SmolLM2-135M-Instruct", "settings": {k: str(v) for k, v in vars(a).items()}}
    if a.data.suffix == ".txt":  # plain text: qat.train's consecutive --seq-len windows
        result["n_text_windows"] = len(load_examples(a.data, tok, a.seq_len))
    else:
        result["n_samples"] = len(read_samples(a.data))
    direct = build_student(teacher_dir)
    if a.init_from is not None:
        from qat.training.models import start_from_file

        start_from_file(direct, a.init_from)
    result["start"] = "direct cast" if a.init_from is None else str(a.init_from)
    result["direct_cast"] = _evaluate(direct, teacher, windows)  # the step-0 student (the start)
    print("direct cast:", result["direct_cast"], flush=True)
    del direct
    args = run_argv(a, teacher_dir, a.run) + ["--train-only", a.train_only]
    if a.lr is not None:
        args += ["--lr", str(a.lr)]
    if a.init_from is not None:
        args += ["--init-from", str(a.init_from)]
    if a.s3d8_lr_scale != 1.0:
        args += ["--s3d8-lr-scale", str(a.s3d8_lr_scale)]
    t0 = time.time()
    if train_main(args) != 0:
        return 2
    result["train_seconds_last_invocation"] = time.time() - t0
    ck = a.run / "checkpoint.pt"
    from qat.checkpoint import load_checkpoint

    info = load_checkpoint(ck)
    result["losses"], result["lr"], result["steps"] = info["losses"], info["lr"], info["step"]
    result["qat"] = _evaluate(student_from_checkpoint(ck, teacher_dir), teacher, windows)
    bits = gguf_bits_per_param(teacher_dir)
    result["qat"]["bits_per_param"] = result["direct_cast"]["bits_per_param"] = bits
    print("qat:", result["qat"], flush=True)
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

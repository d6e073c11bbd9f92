#!/usr/bin/env python3
"""QAT of the baseline formats on SmolLM2-135M-Instruct: the "QAT" points of the baseline sweep.

For each format id (default the ~2.7-bit ones: ``int6_g128 studentt6_g128 lloydmax6 s3d8``):

1. ``qat.train --format ID`` on self-generated data (``--data``, as ``research/smollm2_qat.py``): a
   simulation student in the baseline sweep's scope (every Linear, the tied lm_head / embedding once; activations
   unquantised), the format's tables / codebook fitted once on the teacher and frozen, scales from the current
   weights every step. Runs live in ``--run-root/ID-<hash of the settings>`` and resume from their checkpoints.
2. Evaluation exactly as ``research/baselines_smollm2.py``: ``qat.text_eval.evaluate`` against the
   sweep's ``TeacherCache`` on the same windows of ``wiki_text('eval')`` (``--ctx 512 --eval-tokens 2048``), so the
   numbers sit directly next to ``docs/data/baselines.json``. The student at step 0 (the run's frozen fits, the
   teacher's weights) is evaluated too: it is the sweep's direct cast, a check that the two agree.
3. One entry per format in ``--json`` (id, family, label, bits_per_param counted as the sweep counts it, kl,
   kl_stderr, ppl, steps, settings, losses, times), rewritten atomically after each format;
   ``baselines_smollm2.py --report-only`` then shows the points next to direct cast and GPTQ.

Incremental: formats whose entry has the same settings are skipped; ``--budget-min M`` starts no new format after
M minutes; ``--stop-after N`` trains at most N steps per format per invocation (an unfinished run is not
evaluated; rerun to continue). Learning rate: the recipe's baseline rule 2^-(log2(K) + 14) for K levels (S3D8:
2^-17, i.e. 3 bits) unless ``--lr`` sets one for all formats.

    nice -n 10 .venv/bin/python research/format_qat_smollm2.py --data .cache/qat-proof/train.jsonl \\
        --steps 300 --batch 2 --seq-len 192 --lr 1e-4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from gguf_s3d8.fsio import atomic_write, sha256_file  # noqa: E402
from qat.text_eval import load_results  # noqa: E402
from qat.train import add_run_options, run_argv  # noqa: E402

DEFAULT_FORMATS = ("int6_g128", "studentt6_g128", "lloydmax6", "s3d8")
RESULTS_VERSION = 1
#: The baseline sweep's model string (its ``config["model"]``): the points are only comparable on the same teacher.
MODEL = "SmolLM2-135M-Instruct (Q4_1 GGUF -> fp32)"


def recipe_lr_bits(fmt: Any) -> float:
    """b of the recipe's baseline learning rate 2^-(b + 14): log2 K for K levels, 3 for S3D8 (its fixed 2^-17)."""
    levels = getattr(fmt, "levels", None)
    return math.log2(levels) if levels is not None else 3.0


def bits_per_param(student: torch.nn.Module) -> dict[str, float | int]:
    """The sweep's accounting (``baselines_smollm2.run``): every distinct quantised matrix at the format's
    ``bits_per_param(shape)``, every other parameter at 16 bits, over all distinct parameters."""
    from qat.student import student_specs

    params = {n: p for n, p in student.named_parameters(remove_duplicate=False)}
    n_params = sum(p.numel() for p in {id(p): p for p in params.values()}.values())
    bits = quantised = 0.0
    for name, spec in student_specs(student).items():
        assert spec.qtype == "format", f"{name}: not a simulated weight ({spec.qtype})"
        shape = tuple(params[name].shape)
        bits += spec.fmt.bits_per_param(shape) * math.prod(shape)
        quantised += math.prod(shape)
    return {"bits_per_param": (bits + 16 * (n_params - quantised)) / n_params,
            "bits_per_quantised_param": bits / quantised, "quantised_params": int(quantised), "n_params": n_params}


def settings_of(a: argparse.Namespace, fmt_id: str, data_sha: str) -> dict[str, Any]:
    """What determines a format's result (not threads / gradient checkpointing, which only change the speed)."""
    from qat.formats import format_from_id
    from qat.training.loss import default_lr

    lr = a.lr if a.lr is not None else default_lr(recipe_lr_bits(format_from_id(fmt_id)))
    return {"data": str(a.data), "data_sha256": data_sha, "steps": a.steps, "batch": a.batch, "seq_len": a.seq_len,
            "lr": lr, "seed": a.seed, "ctx": a.ctx, "eval_tokens": a.eval_tokens}


def run_dir(root: Path, fmt_id: str, settings: dict[str, Any]) -> Path:
    training = {k: v for k, v in settings.items() if k not in ("ctx", "eval_tokens")}
    h = hashlib.sha256(json.dumps(training, sort_keys=True).encode()).hexdigest()[:10]
    return root / f"{fmt_id}-{h}"


def sweep_direct(fmt_id: str) -> dict[str, Any] | None:
    """The sweep's direct-cast entry of this format (docs/data/baselines.json), to compare the step-0 student with."""
    path = REPO / "docs" / "data" / "baselines.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return next((r for r in data.get("results", []) if r["id"] == fmt_id and r["method"] == "direct"), None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p)
    p.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), metavar="ID",
                   help="format ids (qat.formats.format_from_id; default: %(default)s)")
    p.add_argument("--run-root", type=Path, default=REPO / ".cache" / "qat-formats", help="training run folders")
    p.add_argument("--lr", type=float, default=None, help="peak lr for every format (default: 2^-(log2 K + 14))")
    p.add_argument("--seed", type=int, default=0, help="batch order (qat.train --seed)")
    p.add_argument("--ctx", type=int, default=512, help="eval window (default: the sweep's 512)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="eval token budget (default: the sweep's 2048)")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="train at most N steps per format in this invocation (rerun to continue)")
    p.add_argument("--budget-min", type=float, default=None,
                   help="start no new format after this many minutes (results so far are kept)")
    p.add_argument("--json", type=Path, default=REPO / "research" / "results" / "format_qat_smollm2.json")
    a = p.parse_args(argv)

    from qat.formats import format_family, format_from_id

    for fid in a.formats:
        format_from_id(fid)  # unknown ids fail before anything runs
    if not a.data.is_file():
        print(f"error: {a.data}: no such data file", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    from transformers import AutoTokenizer

    from fixtures.assets import smollm2_hf_dir, wiki_text
    from qat.data import read_samples
    from qat.text_eval import TeacherCache, evaluate, token_windows
    from qat.checkpoint import load_checkpoint
    from qat.training.models import build_student, load_teacher
    from qat.train import main as train_main

    teacher_dir = smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    windows = token_windows(tok, wiki_text("eval"), ctx=a.ctx, max_tokens=a.eval_tokens)
    teacher = load_teacher(teacher_dir)
    cache = TeacherCache.build(teacher, windows, progress=True)  # the sweep's cache file when the windows match
    config = {"version": RESULTS_VERSION, "ctx": a.ctx, "eval_tokens": a.eval_tokens, "model": MODEL}
    results = load_results(a.json, config)
    if results["teacher"] is None:
        r = evaluate(teacher, cache)
        results["teacher"] = {"ppl": r.ppl, "n_tokens": r.n_tokens}
        atomic_write(a.json, json.dumps(results, indent=1) + "\n", make_parents=True)
    del teacher
    data_sha = sha256_file(a.data)
    n_samples = len(read_samples(a.data))
    start = time.time()
    for fid in a.formats:
        if a.budget_min is not None and time.time() - start > 60 * a.budget_min:
            print(f"time budget of {a.budget_min} min spent; not starting {fid} (rerun to continue)", file=sys.stderr)
            break
        fmt = format_from_id(fid)
        settings = settings_of(a, fid, data_sha)
        if any(r["id"] == fid and r.get("settings") == settings for r in results["results"]):
            print(f"{fid}: already in {a.json} with these settings", file=sys.stderr)
            continue
        out = run_dir(a.run_root, fid, settings)
        argv_train = run_argv(a, teacher_dir, out) + ["--format", fid, "--lr", repr(settings["lr"]), "--seed", str(a.seed)]
        if a.stop_after is not None:
            argv_train += ["--stop-after", str(a.stop_after)]
        ck_path = out / "checkpoint.pt"
        step_before = load_checkpoint(ck_path)["step"] if ck_path.is_file() else 0
        if train_main(argv_train) != 0:
            return 2
        ck = load_checkpoint(ck_path)
        run_info = json.loads((out / "losses.json").read_text())
        n_new = ck["step"] - step_before
        per_step = run_info["seconds_this_run"] / n_new if n_new else float("nan")
        print(f"{fid}: steps {step_before} -> {ck['step']} of {ck['steps']}, {per_step:.1f} s/step", file=sys.stderr)
        if ck["step"] < ck["steps"]:
            print(f"{fid}: unfinished; rerun to continue", file=sys.stderr)
            continue
        torch.set_num_threads(a.threads)
        student = build_student(teacher_dir, specs_state=ck["specs"])  # step 0: the run's frozen fits
        t0 = time.time()
        direct = evaluate(student, cache)
        student.load_state_dict(ck["model"])
        r = evaluate(student, cache)
        t_eval = time.time() - t0
        sweep = sweep_direct(fid)
        entry = {"id": fid, "family": format_family(fmt), "label": fmt.name, "method": "qat",
                 **bits_per_param(student), "kl": r.kl, "kl_stderr": r.kl_stderr, "ppl": r.ppl, "nll": r.nll,
                 "n_tokens": r.n_tokens, "steps": ck["step"], "settings": settings, "n_samples": n_samples,
                 "direct_cast": {"kl": direct.kl, "ppl": direct.ppl,
                                 "sweep_kl": None if sweep is None else sweep["kl"]},
                 "losses": ck["losses"], "threads": a.threads,
                 "seconds_train_last_invocation": run_info["seconds_this_run"], "seconds_per_step_last_invocation":
                 per_step, "seconds_eval": t_eval}
        results["results"] = [e for e in results["results"] if e["id"] != fid] + [entry]
        atomic_write(a.json, json.dumps(results, indent=1) + "\n", make_parents=True)
        print(f"{fid}: bits {entry['bits_per_param']:.3f}  direct KL {direct.kl:.4f} (sweep "
              f"{'-' if sweep is None else format(sweep['kl'], '.4f')})  QAT KL {r.kl:.4f} PPL {r.ppl:.2f}", flush=True)
        del student
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

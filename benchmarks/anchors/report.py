"""The anchors benchmark's report: the markdown table, the plot and the results JSON (NaN as null)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import bench_common  # type: ignore[import-not-found]  # puts the repository root on sys.path
from gguf_s3d8.fsio import atomic_write

from anchors.model import log  # type: ignore[import-not-found]
from anchors.runner import Row  # type: ignore[import-not-found]

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
    return f"{row['label']} ({who})"


def timing_lines(mod: dict[str, Any]) -> list[str]:
    """The steps' wall times as recorded when each was done (cached steps keep the time of the run that made
    them): the f16 file, each project's imatrix and the median llama-perplexity run per file."""
    times = mod.get("times", {})
    parts = [f"{label} {times[k]:.0f} s" for k, label in (("f16", "f16 file"), ("imatrix:mainline", "mainline imatrix"),
                                                          ("imatrix:ik", "ik imatrix")) if k in times]
    for project in ("mainline", "ik"):
        secs = sorted(r["ppl_s"] for r in mod["rows"] if r["project"] == project and not r["error"]
                      and isinstance(r.get("ppl_s"), float) and not math.isnan(r["ppl_s"]))
        if secs:
            parts.append(f"{project} llama-perplexity {secs[len(secs) // 2]:.0f} s per file (median of {len(secs)})")
    return ["Recorded step times (wall, when done): " + ", ".join(parts) + ".", ""] if parts else []


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """S3D8 against its anchors (KLD ratios) and the two projects' IQ2_S against each other, where measured."""
    def find(project: str, qtype: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["project"] == project and r["qtype"] == qtype), None)

    out = []
    s3d8 = find("mainline", "s3d8")
    if s3d8:
        for project, qtype, what in (("ik", "iq2_kl", "IQ2_KL (ik_llama.cpp, the exact-size peer)"),
                                     ("mainline", "iq2_s", "IQ2_S + imatrix (mainline)"),
                                     ("mainline", "iq2_m", "IQ2_M's types (mainline)")):
            r = find(project, qtype)
            if r:
                out.append(f"- S3D8 + imatrix: KLD {s3d8['kld']:.4f} against {what} {r['kld']:.4f}: "
                           f"**{s3d8['kld'] / r['kld']:.2f}×** at {s3d8['variant_bpw']:.4f} vs "
                           f"{r['variant_bpw']:.4f} bits")
    a, b = find("mainline", "iq2_s"), find("ik", "iq2_s")
    if a and b:
        out.append(f"- Cross-check: IQ2_S made and measured by mainline {a['kld']:.4f}, by ik_llama.cpp "
                   f"{b['kld']:.4f} (each with its own imatrix and f16 base logits)")
    return out + ([""] if out else [])


def render_markdown(results: dict[str, Any]) -> str:
    """The report (docs/quality-anchors.md) from the results JSON: one table per model, sorted by KLD."""
    m = results["machine"]
    out = [
        "# The anchors side by side (issue 34, item 3)",
        "",
        "S3D8 next to the best 2–3-bit types of mainline llama.cpp and of ik_llama.cpp, each measured with its own "
        "project's tools, written by `benchmarks/quality_anchors.py` (its `--help` explains the setting). The "
        "variant's type on the listed tensors, Q8_0 elsewhere; each project's own `llama-imatrix` on the main job's "
        f"training text ({results['settings']['imatrix_chunks']} × 512 tokens) and its own f16 base logits; KLD and "
        f"PPL on {results['settings']['chunks']} × 512 held-out tokens. Raw results: `docs/data/quality_anchors.json`.",
        "",
        f"**Machine:** {m['cpu']} ({m['cores']} cores), {m['threads']} threads for every tool; load average "
        f"{m['load_before']} before, {m['load_after']} after. ik_llama.cpp: {results['ik']['source']}; mainline: "
        f"{results['mainline']['source']}. Run of {results['date']}, {results['seconds']:.0f} s in all.",
        "",
        "Reproduce:",
        "",
        "```",
        results["command"],
        "```",
        "",
        "![KLD against bits per weight](img/quality_anchors.png)",
        "",
    ]
    for mod in results["models"]:
        out += [f"## {mod['title']}: the {mod['n_variant_tensors']} tensors matching `{mod['variant_regex']}`", ""]
        out += [f"- {n}" for n in mod.get("notes", [])]
        for f in mod["f16"]["rows"]:
            speed = (f", pp512 {_fmt(f.get('pp512'), 1)} t/s, tg128 {_fmt(f.get('tg128'), 1)} t/s"
                     if "pp512" in f else "")
            out.append(f"- F16 with {f['project']}'s `llama-perplexity`: PPL {_fmt(f['ppl'], 3)} ± "
                       f"{_fmt(f['ppl_err'], 3)} ({_fmt(mod['f16']['mib'], 1)} MiB{speed})")
        if mod.get("iq2_m_types"):
            counts: dict[str, int] = {}
            for t in mod["iq2_m_types"].values():
                counts[t] = counts.get(t, 0) + 1
            out.append("- IQ2_M mix: the types mainline's `llama-quantize --dry-run --imatrix ... IQ2_M` gives these "
                       f"tensors ({', '.join(f'{t} ×{c}' for t, c in sorted(counts.items()))}), set per tensor with "
                       "`--tensor-type`, Q8_0 elsewhere as for every row")
        out += ["", "| variant (project) | types in the variant tensors | bpw (variant) | file MiB | PPL | KLD vs f16 "
                "| same top % | pp512 t/s | tg128 t/s | load | quant s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        rows = sorted(mod["rows"], key=lambda r: (r["error"] != "", r["kld"] if not math.isnan(r["kld"]) else 1e9))
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


def plot(results: dict[str, Any], path: Path) -> None:
    """KLD against bits per weight of the variant tensors, one panel per model; ik_llama.cpp's types as hollow
    orange diamonds, mainline's as blue circles, S3D8 (ours) as a red star, extra files as red crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FormatStrFormatter, ScalarFormatter

    models = results["models"]
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5.6 * max(1, len(models)), 4.8), squeeze=False)
    for ax, mod in zip(axes[0], models):
        for r in mod["rows"]:
            if r["error"] or math.isnan(r["kld"]):
                continue
            marker, colour = MARKERS[r["project"]]
            if r["project"] == "mainline" and r["qtype"] == "s3d8":
                marker, colour = "*", "tab:red"
            hollow = r["project"] == "ik"  # a mainline point at the same place stays visible inside
            ax.scatter([r["variant_bpw"]], [r["kld"]], marker=marker, s=130 if marker == "*" else 55, zorder=3,
                       facecolors="none" if hollow else colour, edgecolors=colour, linewidths=1.6 if hollow else 1.0)
            # ik's labels below their points, the others' above: the two IQ2_S share an x
            ax.annotate(r["label"] + (" (ik)" if r["project"] == "ik" else ""), (r["variant_bpw"], r["kld"]),
                        textcoords="offset points", xytext=(6, -11) if r["project"] == "ik" else (6, 4), fontsize=8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
        ax.set_xlabel(f"bits per weight of the {mod['n_variant_tensors']} variant tensors (Q8_0 elsewhere)")
        ax.set_ylabel(f"KLD vs f16 ({results['settings']['chunks']} x 512 held-out tokens)")
        ax.set_title(f"{mod['title']}: {' + '.join(mod.get('roles', []))}" if mod.get("roles") else mod["title"])
        ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], marker="*", color="tab:red", ls="", ms=11, label="S3D8 (ours, mainline tools)"),
               Line2D([], [], marker="o", color="tab:blue", ls="", label="mainline llama.cpp"),
               Line2D([], [], marker="D", color="tab:orange", mfc="none", ls="", label="ik_llama.cpp (its own tools)"),
               Line2D([], [], marker="P", color="tab:red", ls="", label="extra file (mainline tools)")]
    axes[0][0].legend(handles=handles, fontsize=8, loc="upper right")
    fig.suptitle("KLD against bits per weight, all with imatrix")
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

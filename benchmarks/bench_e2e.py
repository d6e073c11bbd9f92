#!/usr/bin/env python3
"""End-to-end speed: llama-bench prompt processing and generation of one full-width synthetic Llama in each
weight type, all in one run, written into the "end to end" section of docs/benchmarks.md with a PNG.

The model has the layer shapes of Llama 3 8B (hidden 4096, FFN 14336, 32 query / 8 KV heads of 128) but
--layers of them (default 4) and SmolLM2's tokenizer (vocabulary 49152), with random weights from
``fixtures.synthetic`` (speed does not depend on the values). Every variant keeps the token embedding and the
output matrix in Q8_0 and puts the type under test on every layer matrix; the stock types run with llama.cpp's
default runtime repacking, as users get them. Types that need an importance matrix get one computed by
llama-imatrix on the f16 model (random weights: it serves the encoder, not the quality). Not a test (timings are
never asserted); run by hand on a quiet machine:

    bash ci/build.sh host                              # llama-bench, llama-quantize, llama-imatrix
    .venv/bin/python benchmarks/bench_e2e.py           # ~25 min on 2 cores, ~10 GB of disk under .cache/bench-e2e

Targets (issue 16): tg >= 1.6x Q4_0 and >= 1.3x TQ2_0; pp >= 1.5x Q4_0, at every thread count.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import (  # type: ignore[import-not-found]
    ROOT, cpu_name, data_file, doc_link, image_file, keep_raw_results, run, shown, tool,
)
from bench_kernels import build_harness  # type: ignore[import-not-found]
from report_sections import write_section  # type: ignore[import-not-found]

from gguf_s3d8.fsio import atomic_path, atomic_write

TYPES = ["q8_0", "q4_0", "q4_K", "iq4_nl", "q2_K", "iq2_s", "iq3_xxs", "tq2_0", "s3d8"]
NEEDS_IMATRIX = {"iq2_s", "iq3_xxs", "iq2_xs", "iq2_xxs", "iq1_s", "iq1_m"}
TARGETS = {"tg": {"q4_0": 1.6, "tq2_0": 1.3}, "pp": {"q4_0": 1.5}}
VOCAB, HIDDEN = 49152, 4096
Q8_0_BYTES_PER_WEIGHT = 34 / 32


def streamed_bytes(file_size: int) -> float:
    """Bytes a generated token reads: the whole file except the token embedding (one row of it is read)."""
    return file_size - VOCAB * HIDDEN * Q8_0_BYTES_PER_WEIGHT


def read_bandwidth(work: Path, threads: list[int]) -> dict[int, float]:
    """The machine's streaming read bandwidth (GB/s) per thread count, by the kernel benchmark's harness."""
    exe = build_harness(work)
    proc = run([str(exe), "--types", "q8_0", "--shapes", "", "--threads", ",".join(map(str, threads))],
               capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {int(r["threads"]): float(r["gbps"]) for r in rows if r["kind"] == "bandwidth"}


def synthetic_f16(work: Path, layers: int) -> Path:
    """The f16 GGUF of the synthetic model (cached)."""
    out = work / f"llama-4096x14336-{layers}l-f16.gguf"
    if out.exists():
        return out
    from fixtures.assets import smollm2_hf_dir
    from fixtures.synthetic import write_tiny_llama

    with tempfile.TemporaryDirectory(dir=work) as tmp:
        hf = write_tiny_llama(Path(tmp) / "hf", smollm2_hf_dir(), hidden=4096, layers=layers, heads=32, kv_heads=8,
                              ffn=14336, vocab=49152, tied=False, seed=0)
        with atomic_path(out) as part:
            run([sys.executable, str(ROOT / "convert" / "to_gguf.py"), str(hf), "--type", "f16", "-o", str(part),
                 "--no-progress"])
    return out


def imatrix(work: Path, f16: Path, threads: int) -> Path:
    out = work / (f16.stem + ".imatrix.gguf")
    if out.exists():
        return out
    from fixtures.assets import wiki_text

    text = work / "imatrix.txt"
    text.write_text(wiki_text("train")[:200_000])
    with atomic_path(out) as part:
        run([tool("llama-imatrix"), "-m", str(f16), "-f", str(text), "-c", "512", "--chunks", "4", "-t", str(threads),
             "-o", str(part)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def quantize(work: Path, f16: Path, ty: str, im: Path | None, threads: int) -> tuple[Path, float]:
    out = work / f"{f16.stem.removesuffix('-f16')}-{ty.lower()}.gguf"
    times = work / "quantize_seconds.json"
    known = json.loads(times.read_text()) if times.exists() else {}
    if out.exists() and ty in known:
        return out, known[ty]
    cmd = [tool("llama-quantize"), "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0"]
    if im is not None:
        cmd += ["--imatrix", str(im)]
    with atomic_path(out) as part:
        t0 = time.monotonic()
        run(cmd + [str(f16), str(part), ty.upper(), str(threads)], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        known[ty] = time.monotonic() - t0
    atomic_write(times, json.dumps(known, indent=1))
    return out, known[ty]


def bench(models: list[Path], threads: list[int], pp: int, tg: int, reps: int) -> list[dict]:
    proc = run([tool("llama-bench"), "-m", ",".join(map(str, models)), "-p", str(pp), "-n", str(tg),
                "-t", ",".join(map(str, threads)), "-r", str(reps), "-o", "jsonl"], capture_output=True, text=True)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--pp", type=int, default=512, help="prompt tokens (llama-bench -p)")
    ap.add_argument("--tg", type=int, default=128, help="generated tokens (llama-bench -n)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-e2e", help="models and raw results")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the last raw results")
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    raw = args.work / "bench_e2e.json"
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    threads = [int(t) for t in args.threads.split(",")]
    if not args.report_only:
        f16 = synthetic_f16(args.work, args.layers)
        im = imatrix(args.work, f16, max(threads)) if any(t.lower() in NEEDS_IMATRIX for t in types) else None
        models, qsec = {}, {}
        for ty in types:
            models[ty], qsec[ty] = quantize(args.work, f16, ty, im if ty.lower() in NEEDS_IMATRIX else None, max(threads))
        load_before = os.getloadavg()[0]
        rows = bench([models[t] for t in types], threads, args.pp, args.tg, args.reps)
        bandwidth = read_bandwidth(args.work, threads)
        result = {"date": str(datetime.date.today()), "cpu": cpu_name(), "cpus": os.cpu_count(), "layers": args.layers,
                  "types": types, "pp": args.pp, "tg": args.tg, "reps": args.reps, "threads": threads,
                  "load": [load_before, os.getloadavg()[0]], "quantize_seconds": qsec,
                  "sizes": {t: models[t].stat().st_size for t in types},
                  "files": {t: models[t].name for t in types}, "rows": rows,
                  "bandwidth_gbps": {str(n): bw for n, bw in bandwidth.items()}}
        raw.write_text(json.dumps(result, indent=1))
    kept = keep_raw_results(raw, data_file(args.doc, "benchmarks-e2e.json"), args.report_only)
    write_report(json.loads(kept.read_text()), args)
    return 0


def tps(result: dict) -> dict[tuple[str, str, int], tuple[float, float]]:
    """(type, 'pp' | 'tg', threads) -> (mean, stddev) tokens per second."""
    by_file: dict[str, str] = {name: ty for ty, name in result["files"].items()}
    out: dict[tuple[str, str, int], tuple[float, float]] = {}
    for r in result["rows"]:
        ty = by_file.get(Path(r["model_filename"]).name)
        if ty is None:
            continue
        phase = "pp" if r["n_prompt"] > 0 else "tg"
        out[(ty, phase, int(r["n_threads"]))] = (float(r["avg_ts"]), float(r["stddev_ts"]))
    return out


def write_report(result: dict, args: argparse.Namespace) -> None:
    t = tps(result)
    types, threads = result["types"], result["threads"]
    pp, tg = result["pp"], result["tg"]
    head = [f"Generated by `python benchmarks/bench_e2e.py` on {result['date']} ({result['cpu']}, {result['cpus']} logical "
            f"CPUs; load average {result['load'][0]:.1f} before, {result['load'][1]:.1f} after). A synthetic Llama with "
            f"{result['layers']} layers of the Llama 3 8B shapes (4096 / 14336, 32 / 8 heads of 128), vocabulary 49152, "
            "random weights; token embedding and output Q8_0 in every variant, the named type on every layer matrix "
            "(stock types with llama.cpp's default runtime repacking; IQ types with an imatrix from llama-imatrix). "
            f"`llama-bench -p {pp} -n {tg} -t {','.join(map(str, threads))} -r {result['reps']}`: mean tokens/s "
            f"(± standard deviation over the repetitions). Raw results: `{shown(data_file(args.doc, 'benchmarks-e2e.json'))}`.", ""]
    bw = {int(n): v for n, v in result.get("bandwidth_gbps", {}).items()}
    if bw:
        head += ["Generation reads the whole file per token except the token embedding (one row); the `tg GB/s` "
                 "columns are those bytes times tokens/s, as a fraction of the streaming read bandwidth measured "
                 "after llama-bench in the same run (" + ", ".join(f"{bw[n]:.1f} GB/s with {n} thread{'s' if n > 1 else ''}"
                                                               for n in sorted(bw)) + ").", ""]
    tab = ["| type | file MiB | quantize s | " +
           " | ".join(f"pp{pp} {n}t | tg{tg} {n}t" + (f" | tg GB/s {n}t" if n in bw else "") for n in threads) + " |",
           "|---|---:|---:|" + "".join("---:|---:|" + ("---:|" if n in bw else "") for n in threads)]
    for ty in types:
        cells = []
        for n in threads:
            for ph in ("pp", "tg"):
                m, sd = t.get((ty, ph, n), (float("nan"), 0.0))
                cells.append(f"{m:.1f} ± {sd:.1f}")
            if n in bw:
                gbps = streamed_bytes(result["sizes"][ty]) * t.get((ty, "tg", n), (float("nan"), 0.0))[0] / 1e9
                cells.append(f"{gbps:.1f} = {gbps / bw[n]:.0%}")
        tab.append(f"| {ty} | {result['sizes'][ty] / 2**20:.0f} | {result['quantize_seconds'][ty]:.0f} | " + " | ".join(cells) + " |")
    tgt = ["", "Targets (ratios within this run):", "", "| phase | threads | S3D8 / type | measured | target | met |",
           "|---|---:|---|---:|---:|---|"]
    for ph, refs in TARGETS.items():
        for n in threads:
            for ref, goal in refs.items():
                if ("s3d8", ph, n) in t and (ref, ph, n) in t:
                    r = t[("s3d8", ph, n)][0] / t[(ref, ph, n)][0]
                    tgt.append(f"| {ph} | {n} | {ref} | {r:.2f}x | {goal}x | {'yes' if r >= goal else '**no**'} |")
    png = image_file(args.doc, "benchmarks-e2e.png")
    text = "## End to end (llama-bench)\n\n" + "\n".join(head + tab + tgt) + f"\n\n![llama-bench tokens/s]({doc_link(args.doc, png)})\n"
    write_section(args.doc, "e2e", text, title="S3D8 benchmarks")
    plot(t, types, threads, pp, tg, png)
    print(f"wrote the end-to-end section of {args.doc} and {png}")


def plot(t: dict, types: list[str], threads: list[int], pp: int, tg: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(threads))
    for ax, ph, title in ((axes[0], "pp", f"prompt processing (pp{pp})"), (axes[1], "tg", f"generation (tg{tg})")):
        for i, n in enumerate(threads):
            vals = [t.get((ty, ph, n), (0.0, 0.0)) for ty in types]
            bars = ax.bar([x + i * width for x in range(len(types))], [v[0] for v in vals], width,
                          yerr=[v[1] for v in vals], label=f"{n} thread{'s' if n > 1 else ''}")
            for b, ty in zip(bars, types):
                if ty == "s3d8":
                    b.set_edgecolor("black")
                    b.set_linewidth(1.5)
        ax.set_xticks([x + width * (len(threads) - 1) / 2 for x in range(len(types))], types, rotation=30)
        ax.set_ylabel("tokens/s")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

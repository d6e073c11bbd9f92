#!/usr/bin/env python3
"""MUL_MAT speed of S3D8 against ik_llama.cpp's 2-bit types (IQ2_K, its run-time-repacked IQ2_K_R4, IQ2_KL) on the
paper's shapes, both trees on the same machine in one run, with Q2_K measured in each tree as the common reference.

Why not ``test-backend-ops perf``: ik_llama.cpp's ``tests/test-backend-ops.cpp`` is a mid-2024 fork of upstream's;
its perf mode has no perf shapes of its own (it times the correctness cases, 16 x 256 matrices), no ``-p`` filter
and prints GB/s only, and its CMakeLists does not build it. Upstream's perf mode in our tree has one shape
(k = 14336, n = 4096 outputs) and runs with hardware_concurrency / 2 threads (1 here). So both trees run one
harness, ``benchmarks/bench_kernels.cpp`` (the kernel benchmark's), compiled once against each tree's ggml: a
MUL_MAT graph on the CPU backend, weights of one type x F32 activations, median time of repeated
``ggml_backend_graph_compute``; for m <= 16 the graph multiplies by enough copies of the weights (2 GiB) that they
stream from DRAM. ik's build gets a compatibility prelude (``-include``, written into ``.cache/ik_kernels/``):
its ggml has no ``ggml-cpu.h`` (the CPU backend is declared in ``ggml-backend.h``) and no S3D8. ik's run-time
repacking (``-rtr``) turns IQ2_K into IQ2_K_R4 at load time; the harness quantizes straight into IQ2_K_R4
(``quantize_iq2_k_r4`` = ``quantize_iq2_k`` + the same ``repack_iq2_k``). IQ2_KL has no repacked variant
(``iqk_repack_tensor`` knows none). As a cross-check of the harness, ``--tbo-check`` also runs our tree's
``test-backend-ops perf -o MUL_MAT`` on its one shape (k = 14336, n = 4096, 1 thread) for S3D8 and Q2_K.

Rounds: each round runs, for each (k, n), one process of each tree (all its types, every m, 1 and 2 threads), the
trees' order alternating between rounds (A B, B A, ...) so that the neighbours' load hits both alike; reported are
the medians over the rounds, and the ratio ik / S3D8 is the median of the per-round ratios (the two processes of a
round run back to back). Load average before and after and the CPU model are recorded.

    python benchmarks/ik_build.py                              # ik_llama.cpp's CPU build (.cache/ik_llama.cpp/build)
    .venv/bin/python benchmarks/bench_ik_kernels.py            # measure (15-25 min a round on 2 shared cores), write
                                                               # docs/data/benchmarks-ik-kernels.jsonl, the section
                                                               # "Kernels against ik_llama.cpp" of docs/benchmarks.md
                                                               # and docs/img/benchmarks-ik-kernels.png
    .venv/bin/python benchmarks/bench_ik_kernels.py --report-only   # the section again from the kept results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ik_build  # type: ignore[import-not-found]
from bench_common import (  # type: ignore[import-not-found]
    BUILD, ROOT, cpu_name, data_file, doc_link, image_file, keep_raw_results, run,
)
from bench_kernels import build_harness  # type: ignore[import-not-found]
from bench_vulkan import ANSI, LINE, SCALE  # type: ignore[import-not-found]
from report_sections import write_section  # type: ignore[import-not-found]

from gguf_s3d8.fsio import atomic_write

DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "ik-kernels"
WORK = ROOT / ".cache" / "ik_kernels"
HARNESS = ROOT / "benchmarks" / "bench_kernels.cpp"
#: the types each tree measures; Q2_K is in both (the reference that makes the trees' ratios comparable)
TYPES = {"ours": ("s3d8", "q2_K"), "ik": ("iq2_k", "iq2_k_r4", "iq2_kl", "q2_K")}
#: (k, n): inputs, outputs - the paper's Llama-3.2-11B-Vision projections of docs/benchmarks.md's kernel section
SHAPES = ((4096, 14336), (14336, 4096), (4096, 4096), (4096, 1024), (1280, 5120), (5120, 1280))
TOKENS = (1, 4, 128, 512)
THREADS = (1, 2)
#: ik's types against S3D8, in the report's column order
IK_TYPES = ("iq2_k", "iq2_k_r4", "iq2_kl")
LABEL = {"s3d8": "S3D8", "q2_K": "Q2_K", "iq2_k": "IQ2_K", "iq2_k_r4": "IQ2_K_R4", "iq2_kl": "IQ2_KL"}
#: ik's build lacks what bench_kernels.cpp names of ours: S3D8 becomes a type that no name selects
COMPAT = """\
// written by benchmarks/bench_ik_kernels.py: bench_kernels.cpp against ik_llama.cpp's ggml
#pragma once
#include "ggml.h"
#include <cstdint>
#define GGML_TYPE_S3D8 GGML_TYPE_COUNT
static inline bool ggml_s3d8_is_eligible(int64_t, int64_t) { return false; }
"""
CPU_SHIM = "// written by benchmarks/bench_ik_kernels.py: ik's CPU backend is declared in ggml-backend.h\n" \
           "#pragma once\n#include \"ggml-backend.h\"\n"


# ---------------------------------------------------------------------------------------------------------------
# building the two harnesses


def build_ours(out: Path) -> Path:
    """bench_kernels.cpp linked statically against build/host's ggml (a snapshot: later rebuilds do not change it)."""
    return build_harness(out, BUILD)


def build_ik(out: Path) -> Path:
    """bench_kernels.cpp against ik_llama.cpp's shared libggml (built by ``benchmarks/ik_build.py``)."""
    lib_dir = ik_build.build_dir() / "ggml" / "src"
    lib = lib_dir / "libggml.so"
    if not lib.exists():
        sys.exit(f"missing {lib}: build ik_llama.cpp first (python benchmarks/ik_build.py)")
    shim = out / "ik-include"
    shim.mkdir(parents=True, exist_ok=True)
    atomic_write(shim / "ggml-cpu.h", CPU_SHIM)
    atomic_write(shim / "ik_compat.h", COMPAT)
    exe = out / "bench_kernels-ik"
    cxx = os.environ.get("CXX", "g++")
    run([cxx, "-O3", "-march=native", "-std=c++17", "-fopenmp", f"-I{shim}",
         f"-I{ik_build.src_dir() / 'ggml' / 'include'}", "-include", "ik_compat.h", str(HARNESS),
         f"-L{lib_dir}", "-lggml", f"-Wl,-rpath,{lib_dir}", "-lpthread", "-lm", "-o", str(exe)])
    return exe


# ---------------------------------------------------------------------------------------------------------------
# pure parts (tests/python/test_bench_ik_kernels.py)


def parse_harness(text: str, tree: str, round_: int) -> list[dict[str, Any]]:
    """The JSON records of one harness run (one per line; other lines are skipped), tagged with tree and round."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        rec["tree"] = tree
        rec["round"] = round_
        rows.append(rec)
    return rows


def parse_tbo(output: str) -> list[dict[str, Any]]:
    """MUL_MAT lines of ``test-backend-ops perf`` (console output, colours stripped): type, m (rows), n (tokens), k,
    runs, us/run and the rate in GFLOPS (or GB/s, as the tool chose for that line)."""
    rows = []
    for t, m, n, k, runs, us, rate, unit in LINE.findall(ANSI.sub("", output)):
        rows.append({"type": t, "m": int(m), "n": int(n), "k": int(k), "runs": int(runs), "us": float(us),
                     "rate": float(rate) * SCALE[unit], "unit": "GB/s" if unit == "GB/s" else "GFLOPS"})
    return rows


Key = tuple[str, str, int, int, int, int]  # tree, type, m, k, n, threads


def _key(r: dict[str, Any]) -> Key:
    return r["tree"], r["type"].lower(), r["m"], r["k"], r["n"], r["threads"]


def summarize(rows: Iterable[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Per (tree, type, m, k, n, threads): the median seconds over the rounds, GMAC/s from it, the rounds' GMAC/s range,
    and for memory-bound shapes the median of each round's weight bytes/s over the bandwidth measured around it."""
    groups: dict[Key, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("kind") == "mul_mat":
            groups.setdefault(_key(r), []).append(r)
    out: dict[Key, dict[str, Any]] = {}
    for key, rs in groups.items():
        _, _, m, k, n, _ = key
        sec = statistics.median(r["seconds"] for r in rs)
        fr = [r["weight_gbps"] / r["bw_gbps"] for r in rs if r.get("bw_gbps")]
        out[key] = {"seconds": sec, "gmacs": m * k * n / sec / 1e9, "rounds": len(rs),
                    "gmacs_range": (min(r["gmacs"] for r in rs), max(r["gmacs"] for r in rs)),
                    "bpw": 8.0 * rs[0]["weight_bytes"] / (k * n),
                    "bw_fraction": statistics.median(fr) if fr else None}
    return out


def paired_ratio(rows: Iterable[dict[str, Any]], num: tuple[str, str], den: tuple[str, str], m: int, k: int, n: int,
                 threads: int) -> float | None:
    """Speed of ``num`` over ``den`` ((tree, type) each; above 1: ``num`` faster) at one shape and thread count: the
    median over the rounds of den's seconds / num's seconds in the same round (None: no round has both)."""
    num, den = (num[0], num[1].lower()), (den[0], den[1].lower())
    sec: dict[tuple[str, str, int], float] = {}
    for r in rows:
        if r.get("kind") == "mul_mat" and r["m"] == m and r["k"] == k and r["n"] == n and r["threads"] == threads:
            sec[(r["tree"], r["type"].lower(), r["round"])] = r["seconds"]
    ratios = [sec[(den[0], den[1], rd)] / s for (tr, ty, rd), s in sec.items()
              if (tr, ty) == num and (den[0], den[1], rd) in sec]
    return statistics.median(ratios) if ratios else None


def fmt_ratio(x: float | None) -> str:
    """A ratio as the tables show it: two decimals and 'x'; bold where ik's kernel is faster (above 1)."""
    if x is None:
        return "-"
    s = f"{x:.2f}x"
    return f"**{s}**" if x > 1.0 else s


# ---------------------------------------------------------------------------------------------------------------
# measuring


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def measure(args: argparse.Namespace, raw: Path) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    exes = {"ours": build_ours(WORK), "ik": build_ik(WORK)}
    shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes.split(",")]
    tokens = [int(v) for v in args.tokens.split(",")]
    threads = args.threads
    meta: dict[str, Any] = {"kind": "meta", "date": str(datetime.date.today()), "cpu": cpu_name(), "cpus": os.cpu_count(),
                            "load_before": _load(), "uptime_before": _uptime(), "rounds": args.rounds,
                            "min_time": args.min_time, "threads": threads, "tokens": tokens,
                            "types": {t: list(v) for t, v in TYPES.items()},
                            "ik_source": "ik-llama-cpp-python 0.1.5 sdist (benchmarks/ik_build.py)",
                            "command": "python benchmarks/bench_ik_kernels.py " + " ".join(sys.argv[1:])}
    rows: list[dict[str, Any]] = [meta]
    t0 = time.monotonic()
    for rd in range(args.rounds):
        for k, n in shapes:
            order = ("ours", "ik") if rd % 2 == 0 else ("ik", "ours")
            for tree in order:
                cmd = [str(exes[tree]), "--types", ",".join(TYPES[tree]),
                       "--shapes", ",".join(f"{m}:{k}:{n}" for m in tokens), "--threads", threads,
                       "--min-time", str(args.min_time), "--rounds", "1", "--bw-mib", str(args.bw_mib),
                       "--rotate-mib", str(args.rotate_mib)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
                got = parse_harness(proc.stdout, tree, rd)
                rows += got
                atomic_write(raw, "".join(json.dumps(r) + "\n" for r in rows))  # an interrupted run keeps its rounds
                print(f"[ik-kernels] round {rd + 1}/{args.rounds} {k}x{n} {tree}: {sum(r['kind'] == 'mul_mat' for r in got)} "
                      f"timings, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.tbo_check:
        rows += tbo_check(tokens)
    rows.append({"kind": "meta_end", "load_after": _load(), "uptime_after": _uptime(),
                 "seconds": round(time.monotonic() - t0, 1)})
    atomic_write(raw, "".join(json.dumps(r) + "\n" for r in rows))


def tbo_check(tokens: list[int]) -> list[dict[str, Any]]:
    """Our tree's test-backend-ops perf on its one MUL_MAT shape (k = 14336, 4096 outputs), S3D8 and Q2_K."""
    exe = BUILD / "bin" / "test-backend-ops"
    ns = [t for t in tokens if t in (1, 2, 3, 4, 5, 8, 512)]
    pattern = f"type_a=(s3d8|q2_K),type_b=f32,m=4096,n=({'|'.join(map(str, ns))}),k=14336,bs=\\[1,1\\],nr=\\[1,1\\]"
    proc = run([str(exe), "perf", "-o", "MUL_MAT", "-b", "CPU", "-p", pattern], capture_output=True, text=True,
               errors="replace")
    out = [{"kind": "tbo", **r} for r in parse_tbo(proc.stdout + proc.stderr)]
    if not out:
        print(f"[ik-kernels] test-backend-ops printed no MUL_MAT line:\n{proc.stdout[-2000:]}", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the report


def report(rows: list[dict[str, Any]], plot: Path | None) -> str:
    meta = next(r for r in rows if r["kind"] == "meta")
    end = next((r for r in rows if r["kind"] == "meta_end"), {})
    summ = summarize(rows)
    mm = [r for r in rows if r.get("kind") == "mul_mat"]
    shapes = []
    for r in mm:
        if (r["k"], r["n"]) not in shapes:
            shapes.append((r["k"], r["n"]))
    tokens = sorted({r["m"] for r in mm})
    threads = sorted({r["threads"] for r in mm})
    bw = {t: statistics.median(r["gbps"] for r in rows if r.get("kind") == "bandwidth" and r["threads"] == t)
          for t in threads if any(r.get("kind") == "bandwidth" and r["threads"] == t for r in rows)}
    cols = [("ours", "s3d8"), *[("ik", t) for t in IK_TYPES], ("ours", "q2_K"), ("ik", "q2_K")]

    def g(tree: str, ty: str, m: int, k: int, n: int, t: int) -> str:
        s = summ.get((tree, ty.lower(), m, k, n, t))
        return f"{s['gmacs']:.1f}" if s else "-"

    lines = [
        "## Kernels against ik_llama.cpp (MUL_MAT)", "",
        f"Generated by `{meta['command'].strip()}` on {meta['date']} ({meta['cpu']}, {meta['cpus']} logical CPUs; load "
        f"average {meta['load_before'][0]} before, {end.get('load_after', ['?'])[0]} after; {meta['rounds']} rounds, "
        f"{end.get('seconds', 0) / 60:.0f} min). ik_llama.cpp: {meta['ik_source']}, built CPU-only, Release, "
        "`GGML_NATIVE` (`-march=native`: AVX512 with VNNI and VBMI, so its `HAVE_FANCY_SIMD` kernels); ours: "
        "`build/host`. Raw results: "
        f"[{doc_link(DOC, data_file(DOC, 'benchmarks-ik-kernels.jsonl'))}]"
        f"({doc_link(DOC, data_file(DOC, 'benchmarks-ik-kernels.jsonl'))}).", "",
        "One harness in both trees: `benchmarks/bench_kernels.cpp` compiled against each tree's ggml (ik's "
        "`test-backend-ops` has no perf shapes and no `-p` filter, see the script's `--help`). A MUL_MAT of the named "
        "weight type by F32 activations on the CPU backend, plain CPU buffers; m tokens, k inputs, n outputs; "
        "GMAC/s = m*k*n / the median time over the rounds. For m <= 16 the graph cycles through 2 GiB of weight "
        "copies, so they stream from DRAM. IQ2_K_R4 is what ik's run-time repacking (`-rtr`) makes of IQ2_K at load "
        "time (quantized straight into it here); IQ2_KL has no repacked form. Q2_K runs in both trees (ik's own "
        "Q2_K kernels) as the common reference. **Ratio = ik's GMAC/s over S3D8's** (the median of the per-round "
        "ratios, each round's two processes back to back); **bold: ik's kernel faster**.", "",
    ]
    bpw = {(tr, ty): s["bpw"] for (tr, ty, *_), s in summ.items()}
    lines.append("Bits per weight as stored: " + ", ".join(
        f"{LABEL.get(ty, ty)} {bpw[(tr, ty)]:.3f}" for tr, ty in cols[:5] if (tr, ty) in bpw) + ".")
    lines.append("")
    for t in threads:
        lines += [f"### {t} thread{'s' if t > 1 else ''}: GMAC/s and ratio ik / S3D8", "",
                  "| k x n | m | S3D8 | IQ2_K | IQ2_K_R4 | IQ2_KL | Q2_K (ours) | Q2_K (ik) | IQ2_K / S3D8 | "
                  "IQ2_K_R4 / S3D8 | IQ2_KL / S3D8 | Q2_K ik / ours |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for k, n in shapes:
            for m in tokens:
                vals = [g(tr, ty, m, k, n, t) for tr, ty in cols]
                rat = [fmt_ratio(paired_ratio(mm, ("ik", ty), ("ours", "s3d8"), m, k, n, t)) for ty in IK_TYPES]
                q2 = paired_ratio(mm, ("ik", "q2_K"), ("ours", "q2_K"), m, k, n, t)
                rat.append("-" if q2 is None else f"{q2:.2f}x")
                lines.append(f"| {k} x {n} | {m} | " + " | ".join(vals + rat) + " |")
        lines.append("")
    # one token: the weight bytes per second over the bandwidth measured around each round
    if 1 in tokens:
        lines += ["### m = 1: weight bytes per second over the read bandwidth around each round (median)", "",
                  "| threads | k x n | " + " | ".join(LABEL.get(ty, ty) + (" (ik)" if tr == "ik" and ty == "q2_K" else "")
                                                    for tr, ty in cols) + " |",
                  "|---:|---|" + "---:|" * len(cols)]
        for t in threads:
            for k, n in shapes:
                cells = []
                for tr, ty in cols:
                    s = summ.get((tr, ty.lower(), 1, k, n, t))
                    cells.append(f"{100 * s['bw_fraction']:.0f} %" if s and s["bw_fraction"] is not None else "-")
                lines.append(f"| {t} | {k} x {n} | " + " | ".join(cells) + " |")
        lines.append("")
        if bw:
            lines += ["Read bandwidth at the start of each process, median: " + ", ".join(
                f"{v:.1f} GB/s with {t} thread{'s' if t > 1 else ''}" for t, v in bw.items()) + ".", ""]
    tbo = [r for r in rows if r.get("kind") == "tbo"]
    if tbo:
        lines += ["Cross-check, our tree's `test-backend-ops perf -o MUL_MAT -p 'type_a=(s3d8|q2_K),...,m=4096,...,k=14336'` "
                  "(its one perf shape, k = 14336 and 4096 outputs; 1 thread, its default on 2 cores; the same weight "
                  "tensor in every repeated node, so at few tokens it reads the weights from the 32 MiB L3, not DRAM) "
                  "next to the harness's 1-thread median of the same shape:", "",
                  "| type | tokens | test-backend-ops GFLOPS | harness GFLOPS (2 x GMAC/s) |", "|---|---:|---:|---:|"]
        for r in tbo:
            tree_ty = ("ours", r["type"].lower())
            s = summ.get((*tree_ty, r["n"], r["k"], r["m"], 1))
            unit = "" if r["unit"] == "GFLOPS" else f" ({r['unit']})"
            lines.append(f"| {LABEL.get(r['type'], r['type'])} | {r['n']} | {r['rate']:.1f}{unit} | "
                         f"{2 * s['gmacs']:.1f} |" if s else f"| {r['type']} | {r['n']} | {r['rate']:.1f}{unit} | - |")
        lines.append("")
    if plot is not None:
        lines += [f"![ik / S3D8 per shape]({doc_link(DOC, plot)})", ""]
    lines.append(f"Load: `{meta.get('uptime_before', '')}` before, `{end.get('uptime_after', '')}` after.")
    return "\n".join(lines)


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Ratio ik / S3D8 per (shape, m), one panel per thread count, one bar per ik type (log scale, 1 = parity)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mm = [r for r in rows if r.get("kind") == "mul_mat"]
    shapes = list(dict.fromkeys((r["k"], r["n"]) for r in mm))
    tokens = sorted({r["m"] for r in mm})
    threads = sorted({r["threads"] for r in mm})
    cases = [(m, k, n) for m in tokens for k, n in shapes]
    fig, axes = plt.subplots(len(threads), 1, figsize=(12, 3.6 * len(threads)), squeeze=False)
    width = 0.8 / (len(IK_TYPES) + 1)
    for ax, t in zip(axes[:, 0], threads):
        for i, ty in enumerate((*IK_TYPES, "q2_K")):
            den = ("ours", "s3d8")
            vals = [paired_ratio(mm, ("ik", ty), den, m, k, n, t) or float("nan") for m, k, n in cases]
            ax.bar([c + (i - len(IK_TYPES) / 2) * width for c in range(len(cases))], vals, width,
                   label=f"{LABEL[ty]} (ik)")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)), [f"m={m}\n{k}x{n}" for m, k, n in cases], fontsize=6)
        ax.set_ylabel("ik GMAC/s / S3D8")
        ax.set_title(f"{t} thread{'s' if t > 1 else ''}: above 1 = ik's kernel faster")
        ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds (each: every shape, both trees; default 3)")
    ap.add_argument("--shapes", default=",".join(f"{k}:{n}" for k, n in SHAPES),
                    help="k:n pairs (inputs:outputs), comma-separated; default the paper's six")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="m values (tokens), default 1,4,128,512")
    ap.add_argument("--threads", default=",".join(map(str, THREADS)), help="thread counts, default 1,2")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of timed runs per case and round (>= 3 runs)")
    ap.add_argument("--bw-mib", type=int, default=1024, help="bandwidth buffer (MiB) of each harness process")
    ap.add_argument("--rotate-mib", type=int, default=2048, help="weight copies cycled through for m <= 16 (MiB)")
    ap.add_argument("--tbo-check", action="store_true",
                    help="also run our tree's test-backend-ops perf on its one MUL_MAT shape (S3D8, Q2_K)")
    ap.add_argument("--no-plot", action="store_true", help="no docs/img/benchmarks-ik-kernels.png")
    ap.add_argument("--report-only", action="store_true", help="rewrite the section from the kept results")
    args = ap.parse_args(argv)
    raw = WORK / "raw.jsonl"
    kept = data_file(DOC, "benchmarks-ik-kernels.jsonl")
    if not args.report_only:
        measure(args, raw)
    kept = keep_raw_results(raw, kept, args.report_only)
    rows = [json.loads(line) for line in kept.read_text().splitlines() if line.strip()]
    plot = None if args.no_plot else image_file(DOC, "benchmarks-ik-kernels.png")
    if plot is not None:
        write_plot(rows, plot)
    text = report(rows, plot)
    write_section(DOC, SECTION, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

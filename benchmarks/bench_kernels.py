#!/usr/bin/env python3
"""S3D8 kernel benchmarks: MUL_MAT throughput per weight type on the ggml CPU backend (GMAC/s, 1 and 2
threads), the machine's streaming read bandwidth measured in the same run, and the instruction count of
the aarch64 one-token hot loop and i8mm many-token loops from the disassembly. Not a test (timings are never asserted); run by hand:

    cmake --build --preset host                      # the patched ggml (static libraries)
    cmake --build --preset aarch64-dotprod           # optional: for the aarch64 instruction counts
    cmake --build --preset aarch64-i8mm              #   (and the i8mm many-token loops)
    .venv/bin/python benchmarks/bench_kernels.py     # writes docs/benchmarks.md and docs/img/benchmarks.png

The C++ harness (benchmarks/bench_kernels.cpp) is compiled here against build/host's static libraries.
Weights are allocated in plain CPU buffers (no repacking extra buffer types), so every type runs the
CPU backend's standard MUL_MAT path (vec_dot / llamafile sgemm / tiled for the upstream types).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench_common import (  # type: ignore[import-not-found]
    BUILD, LLAMA, ROOT, cpu_name, data_file, doc_link, image_file, keep_raw_results, shown,
)
from report_sections import write_section  # type: ignore[import-not-found]


TYPES = ["f16", "bf16", "q8_0", "s3d8", "q4_0", "q2_K", "tq2_0", "iq2_s", "iq3_xxs"]
# (m, k, n): tokens, inputs, outputs. The paper's shapes (1,4096,14336), (128,4096,14336) and
# (1601,1280,5120), and the other Llama-3.2-11B-Vision projections at 1 and 128 tokens; 4 tokens (4 parallel
# sequences of llama-server, the few-token kernels) on the FFN shapes
SHAPES = [
    (1, 4096, 14336), (4, 4096, 14336), (128, 4096, 14336),
    (1, 14336, 4096), (4, 14336, 4096), (128, 14336, 4096),
    (1, 4096, 4096), (128, 4096, 4096),
    (1, 4096, 1024), (128, 4096, 1024),
    (1, 1280, 5120), (1601, 1280, 5120),
    (1, 5120, 1280), (1601, 5120, 1280),
]


def build_harness(out: Path, build: Path = BUILD) -> Path:
    lib = build / "llama.cpp" / "ggml" / "src"
    libs = [lib / "libggml.a", lib / "libggml-cpu.a", lib / "libggml-base.a"]
    missing = [str(p) for p in libs if not p.exists()]
    if missing:
        sys.exit(f"missing {missing}: build the {build.name} preset first (cmake --build --preset {build.name})")
    exe = out / f"bench_kernels-{build.name}"
    cxx = os.environ.get("CXX", "g++")
    # -march=native: the bandwidth loop must be limited by memory, not by scalar loads (the kernels' own code
    # is in the prebuilt libraries; the VNNI peak function selects its instructions itself)
    cmd = [cxx, "-O3", "-march=native", "-std=c++17", "-fopenmp", f"-I{LLAMA / 'ggml' / 'include'}",
           str(ROOT / "benchmarks" / "bench_kernels.cpp"), *map(str, libs), "-lpthread", "-lm", "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def _arm_object(presets: tuple[str, ...]) -> tuple[str, Path] | None:
    """objdump and the S3D8 kernel object of the first of ``presets`` that is built (None: neither)."""
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    for preset in presets:
        obj = ROOT / "build" / preset / "llama.cpp" / "ggml" / "src" / "CMakeFiles" / "ggml-cpu.dir" / "ggml-cpu" / "arch" / "arm" / "s3d8.c.o"
        if objdump and obj.exists():
            return objdump, obj
    return None


def _loops(objdump: str, obj: Path, functions: tuple[str, ...]) -> list[list[str]]:
    """Opcodes of every loop (a backward conditional branch and the instructions from its target to it) in the
    first of ``functions`` found in the disassembly of ``obj`` (a static helper may be inlined into its caller)."""
    asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(obj)], check=True, capture_output=True, text=True).stdout
    for fn in functions:
        if m := re.search(rf"<{fn}>:\n(.*?)\n\n", asm, re.S):
            break
    else:
        return []
    lines = []
    for line in m.group(1).splitlines():
        parts = line.strip().split(None, 2)
        if len(parts) >= 2 and parts[0].endswith(":"):
            lines.append((int(parts[0][:-1], 16), parts[1], parts[2] if len(parts) > 2 else ""))
    loops = []
    for addr, op, args in lines:
        if op.startswith("b.") and "<" in args and (target := int(args.split()[0], 16)) < addr:
            loops.append([o for a, o, _ in lines if target <= a <= addr])
    return loops


def _classes(ops: list[str]) -> dict[str, int]:
    loads = sum(o.startswith("ld") for o in ops)
    stores = sum(o.startswith("st") for o in ops)
    prefetches = ops.count("prfm")
    overhead = sum(o in ("subs", "cmp") or o.startswith("b.") for o in ops)
    return {"instructions": len(ops), "loads": loads, "stores": stores, "prefetches": prefetches,
            "loop_overhead": overhead, "compute": len(ops) - loads - stores - prefetches - overhead}


def hot_loop_instructions() -> dict | None:
    """Instructions of the aarch64 one-token S3D8 hot loop (4 row triples = 4 x 48 weights per pass)."""
    found = _arm_object(("aarch64-dotprod", "aarch64-i8mm"))
    if not found:
        return None
    # the one-token hot loop of s3d8_gemv4_dotprod (a function of its own or inlined into the kernel) is the
    # loop whose SDOT count is a multiple of 12 (4 triples x 3 rows per 16 columns, unrolled over a cache line)
    body = next((ops for ops in _loops(*found, ("s3d8_gemv4_dotprod", "ggml_s3d8_gemv_dotprod"))
                 if ops.count("sdot") and ops.count("sdot") % 12 == 0), None)
    if body is None:
        return None
    c = _classes(body)
    groups = body.count("sdot") / 3  # 48-weight groups (one byte column of a triple = 3 weights, 16 columns)
    return {
        "object": str(found[1].relative_to(ROOT)), "function": "s3d8_gemv4_dotprod", "instructions": len(body),
        "loads": c["loads"], "prefetches": c["prefetches"], "loop_overhead": c["loop_overhead"], "tbl": body.count("tbl"),
        "sdot": body.count("sdot"), "groups_48": groups, "per_48_weights_compute": (c["compute"] + c["stores"]) / groups,
        "per_48_weights_loads": c["loads"] / groups, "per_48_weights_prefetch": c["prefetches"] / groups,
        "per_48_weights_all": len(body) / groups,
    }


def i8mm_prefill_instructions() -> dict | None:
    """Instructions of the two loops of the aarch64 i8mm many-token kernel: the decode of a triple pair (16 columns
    = 96 weights per pass) and the full 4 x 4 SMMLA tile (8 rows x 16 columns x 8 tokens per pass)."""
    found = _arm_object(("aarch64-i8mm",))
    if not found:
        return None
    loops = _loops(*found, ("ggml_s3d8_gemm_i8mm",))
    decode = min((ops for ops in loops if ops.count("tbl") == 6 and "smmla" not in ops), key=len, default=None)
    tile = min((ops for ops in loops if ops.count("smmla") == 32), key=len, default=None)
    if decode is None or tile is None:
        return None
    return {"object": str(found[1].relative_to(ROOT)), "decode": _classes(decode) | {"tbl": decode.count("tbl")},
            "tile": _classes(tile) | {"smmla": tile.count("smmla")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--shapes", default=",".join(f"{m}:{k}:{n}" for m, k, n in SHAPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement")
    ap.add_argument("--rounds", type=int, default=3, help="memory-bound shapes (m <= 16): measurements per shape and "
                    "thread count, each between two bandwidth measurements (min-time is split between them)")
    ap.add_argument("--build", default="host", help="the build preset whose ggml libraries are measured, e.g. host-avx2 "
                    "(the AVX2 kernels on an AVX512 machine); its report section is named after it")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "bench")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the last raw results")
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / f"bench_kernels{_suffix(args)}.jsonl"
    if not args.report_only:
        exe = build_harness(args.out, ROOT / "build" / args.build)
        load_before = os.getloadavg()[0]
        with raw.open("w") as f:
            proc = subprocess.run([str(exe), "--types", args.types, "--shapes", args.shapes, "--threads", args.threads,
                                   "--min-time", str(args.min_time), "--rounds", str(args.rounds)], check=True, capture_output=True, text=True)
            f.write(proc.stdout)
            f.write(json.dumps({"kind": "load", "before": load_before, "after": os.getloadavg()[0]}) + "\n")
    kept = keep_raw_results(raw, data_file(args.doc, f"benchmarks-kernels{_suffix(args)}.jsonl"), args.report_only)
    rows = [json.loads(line) for line in kept.read_text().splitlines() if line.startswith("{")]
    loop = hot_loop_instructions()
    write_report(rows, loop, args, i8mm_prefill_instructions())
    return 0


def _suffix(args: argparse.Namespace) -> str:
    """File and section name suffix of a build other than the host preset."""
    return "" if args.build == "host" else f"-{args.build}"


STOCK_TYPES = ("q8_0", "q4_0", "q2_k", "tq2_0", "iq2_s", "iq3_xxs")  # the stock types a many-token target is measured against
BANDWIDTH_TARGET = 0.85  # m = 1: S3D8 bytes streamed / read bandwidth
PREFILL_TARGET = 1.5     # m >= 128: S3D8 / the fastest stock type


def merge_rounds(mm: list[dict]) -> list[dict]:
    """One record per (type, m, k, n, threads): the median GMAC/s and GB/s over the rounds of a memory-bound shape,
    and ``bw_fractions``, the weight bytes per second of each round over the bandwidth measured around it."""
    groups: dict[tuple, list[dict]] = {}
    for r in mm:
        groups.setdefault((r["type"].lower(), r["m"], r["k"], r["n"], r["threads"]), []).append(r)
    out = []
    for rs in groups.values():
        merged = dict(rs[0])
        merged["gmacs"] = statistics.median(r["gmacs"] for r in rs)
        merged["weight_gbps"] = statistics.median(r["weight_gbps"] for r in rs)
        merged["bw_fractions"] = sorted(r["weight_gbps"] / r["bw_gbps"] for r in rs if r.get("bw_gbps"))
        merged["rounds"] = len(rs)
        out.append(merged)
    return out


def write_report(rows: list[dict], loop: dict | None, args: argparse.Namespace, mmla: dict | None = None) -> None:
    bw = {r["threads"]: r["gbps"] for r in rows if r["kind"] == "bandwidth"}
    peak = {r["threads"]: r["gmacs"] for r in rows if r["kind"] == "vnni_peak"}
    load = next((r for r in rows if r["kind"] == "load"), None)
    mm = merge_rounds([r for r in rows if r["kind"] == "mul_mat"])
    threads = sorted({r["threads"] for r in mm})
    shapes = []
    for r in mm:
        s = (r["m"], r["k"], r["n"])
        if s not in shapes:
            shapes.append(s)
    types = [t for t in args.types.split(",") if any(r["type"].lower() == t.lower() for r in mm)]
    get = {(r["type"].lower(), r["m"], r["k"], r["n"], r["threads"]): r for r in mm}

    def fastest_stock(m: int, k: int, n: int, t: int) -> dict | None:
        hits = [get[key] for ty in STOCK_TYPES if (key := (ty, m, k, n, t)) in get]
        return max(hits, key=lambda r: r["gmacs"], default=None)

    out = [f"Generated by `python benchmarks/bench_kernels.py` on {datetime.date.today()} ({cpu_name()}, "
           f"{os.cpu_count()} logical CPUs; compare within a row: absolute numbers depend on the machine and its load). "
           "MUL_MAT on the ggml CPU backend, weights in plain CPU buffers (no repacking), F32 activations; "
           f"GMAC/s = m*k*n / median time. Raw results: `{shown(data_file(args.doc, f'benchmarks-kernels{_suffix(args)}.jsonl'))}`. Few-token shapes "
           "(m <= 16) cycle through enough copies of the weights (2 GiB) that they stream from DRAM, not from the "
           "last-level cache.", ""]
    if load:
        out += [f"Load average: {load['before']:.1f} before the run, {load['after']:.1f} after, on {os.cpu_count()} "
                "logical CPUs.", ""]
    out += ["Measured in the same run with the same thread counts: streaming read bandwidth (2 GiB buffer) " +
            ", ".join(f"{bw[t]:.1f} GB/s with {t} thread{'s' if t > 1 else ''}" for t in sorted(bw)) + "; int8 VNNI "
            "peak (24 independent `vpdpbusd` chains on registers) " +
            (", ".join(f"{peak[t]:.0f} GMAC/s with {t} thread{'s' if t > 1 else ''}" for t in sorted(peak))
             if peak else "not measured (no AVX512-VNNI)") + ".", ""]
    for t in threads:
        out += [f"### {t} thread{'s' if t > 1 else ''}: GMAC/s", "",
                "| m | k | n | " + " | ".join(types) + " | S3D8 / fastest stock |",
                "|---:|---:|---:|" + "---:|" * len(types) + "---:|"]
        for (m, k, n) in shapes:
            cells = []
            for ty in types:
                hit = get.get((ty.lower(), m, k, n, t))
                cells.append(f"{hit['gmacs']:.1f}" if hit else "–")
            s3 = get.get(("s3d8", m, k, n, t))
            best = fastest_stock(m, k, n, t)
            ratio = f"{s3['gmacs'] / best['gmacs']:.2f}x ({best['type']})" if s3 and best else "–"
            out.append(f"| {m} | {k} | {n} | " + " | ".join(cells) + f" | {ratio} |")
        out.append("")

    out += ["### Targets", "",
            f"m = 1: S3D8 weight bytes per second >= {BANDWIDTH_TARGET:.0%} of the read bandwidth - each round's bytes per "
            "second over the mean of the bandwidth measured just before and just after it with the same threads (the "
            "bandwidth this VM gets drifts by up to a third within a minute, so a ratio to the run's first measurement "
            "says more about the neighbours than about the kernel), the median over the rounds; m >= 128: S3D8 >= "
            f"{PREFILL_TARGET}x the fastest stock type ({', '.join(STOCK_TYPES)}) at that shape, and its fraction of the "
            "VNNI peak.", "",
            "| threads | shape | measured | target | met |", "|---:|---|---:|---|---|"]
    for t in threads:
        for (m, k, n) in shapes:
            s3 = get.get(("s3d8", m, k, n, t))
            if not s3:
                continue
            if m == 1 and (fr := s3["bw_fractions"]):
                frac = statistics.median(fr)
                out.append(f"| {t} | {m}x{k}x{n} | {s3['weight_gbps']:.1f} GB/s, {frac:.0%} of the bandwidth around it "
                           f"({fr[0]:.0%}-{fr[-1]:.0%} over {len(fr)} rounds) | >= {BANDWIDTH_TARGET:.0%} | "
                           f"{'yes' if frac >= BANDWIDTH_TARGET else '**no**'} |")
            elif m == 1 and t in bw:  # raw results of a harness without rounds: the bandwidth of the run's start
                frac = s3["weight_gbps"] / bw[t]
                out.append(f"| {t} | {m}x{k}x{n} | {s3['weight_gbps']:.1f} GB/s = {frac:.0%} of {bw[t]:.1f} | "
                           f">= {BANDWIDTH_TARGET:.0%} | {'yes' if frac >= BANDWIDTH_TARGET else '**no**'} |")
            elif m >= 128 and (best := fastest_stock(m, k, n, t)):
                ratio = s3["gmacs"] / best["gmacs"]
                # the fraction of the VNNI peak only where the measured kernels use VNNI (not a host-avx2 build)
                pk = f", {s3['gmacs'] / peak[t]:.0%} of the VNNI peak" if t in peak and "avx2" not in args.build else ""
                out.append(f"| {t} | {m}x{k}x{n} | {ratio:.2f}x {best['type']}{pk} | >= {PREFILL_TARGET}x | "
                           f"{'yes' if ratio >= PREFILL_TARGET else '**no**'} |")
    out.append("")

    out += ["### aarch64 one-token hot loop", ""]
    if loop:
        out += [f"From the disassembly of `{loop['object']}` (`s3d8_gemv4_dotprod`, inlined into `ggml_s3d8_gemv_dotprod`: "
                f"4 row triples x 64 columns = {loop['groups_48']:.0f} x 48 weights per pass): {loop['instructions']} instructions "
                f"per pass: {loop['loads']} loads, {loop['prefetches']} prefetches (the next 4 triples' line), {loop['tbl']} TBL, "
                f"{loop['sdot']} SDOT, {loop['loop_overhead']} loop control. Per 48 weights: "
                f"**{loop['per_48_weights_compute']:.2f} instructions plus {loop['per_48_weights_loads']:.2f} loads** "
                f"(prefetch and loop control included: {loop['per_48_weights_all'] - loop['per_48_weights_loads']:.2f}); the paper's "
                "loop is 8 decode + 3 SDOT = 11, the target at most 12 plus loads.", ""]
    else:
        out += ["Not measured: build the `aarch64-dotprod` preset first.", ""]
    out += ["### aarch64 i8mm many-token loops", ""]
    if mmla:
        d, t = mmla["decode"], mmla["tile"]
        out += [f"From the disassembly of `{mmla['object']}` (`ggml_s3d8_gemm_i8mm`). The kernel decodes up to 16 "
                "triples once into a buffer (each triple pair's packed bytes interleaved in 8-byte halves, so one decode "
                "gives SMMLA's 2 x 8 row-pair operand), interleaves the activations of each token pair once per 8 tokens, "
                "then runs 4 x 4 SMMLA tiles (4 row pairs x 4 token pairs) over the buffer.", "",
                "| loop | per pass | instructions | loads | stores | loop control | compute | per 48 weights |",
                "|---|---|---:|---:|---:|---:|---:|---|",
                f"| decode (2 triples) | 96 weights | {d['instructions']} | {d['loads']} | {d['stores']} | "
                f"{d['loop_overhead']} | {d['compute']} ({d['tbl']} TBL) | {d['instructions'] / 2:.1f} instructions, "
                f"{d['stores'] / 2:.0f} of them stores |",
                f"| tile (4 x 4 SMMLA) | 128 weights x 8 tokens | {t['instructions']} | {t['loads']} | {t['stores']} | "
                f"{t['loop_overhead']} | {t['compute']} ({t['smmla']} SMMLA) | {t['instructions'] * 48 / 128:.1f} "
                f"instructions for 8 tokens: {t['smmla'] * 48 / 128:.0f} SMMLA + {t['loads'] * 48 / 128:.1f} loads + "
                f"{(t['instructions'] - t['smmla'] - t['loads']) * 48 / 128:.1f} other |", "",
                "The decode is paid once per 16 triples and up to 128 tokens (the driver's token tile), the tile once "
                "per 8 tokens: from 64 tokens on, the decode is under a tenth of the instructions. Before this layout "
                "(2026-12-03) GCC compiled the same C to 44 instructions per decode pass (12 register copies of the "
                "TBL tables) and 77 per tile pass (the activations zipped in every tile, 9 accumulator copies, a "
                "spill), 28.9 per 48 weights and 8 tokens; both loops are now inline assembly, with intrinsics "
                "for other compilers.", ""]
    else:
        out += ["Not measured: build the `aarch64-i8mm` preset first.", ""]

    png = image_file(args.doc, f"benchmarks{_suffix(args)}.png")
    out += [f"![MUL_MAT GMAC/s per type]({doc_link(args.doc, png)})", ""]
    bw_png = image_file(args.doc, f"benchmarks-bandwidth{_suffix(args)}.png")
    if plot_bandwidth_fractions(mm, threads, bw_png):
        out += ["One token: each type's weight bytes per second over the bandwidth measured around each round (bars: "
                "median, whiskers: the rounds' range; the line: the 85 % target).", "",
                f"![m = 1: share of the read bandwidth]({doc_link(args.doc, bw_png)})", ""]
    heading = "## Kernels (MUL_MAT)" + (f", build preset `{args.build}`" if _suffix(args) else "")
    write_section(args.doc, f"kernels{_suffix(args)}", heading + "\n\n" + "\n".join(out), title="S3D8 benchmarks")
    plot(mm, types, threads, shapes, png)
    print(f"wrote the kernel section of {args.doc} and {png}")


def plot_bandwidth_fractions(mm: list[dict], threads: list[int], path: Path) -> bool:
    """Bars of the one-token (m = 1) share of the read bandwidth per shape and type, one panel per thread count;
    False (nothing drawn) when the raw results have no per-round bandwidth."""
    rows = [r for r in mm if r["m"] == 1 and r.get("bw_fractions")]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    types = list(dict.fromkeys(r["type"].lower() for r in rows))
    shapes = list(dict.fromkeys((r["k"], r["n"]) for r in rows))
    get = {(r["type"].lower(), r["k"], r["n"], r["threads"]): r["bw_fractions"] for r in rows}
    fig, axes = plt.subplots(1, len(threads), figsize=(7 * len(threads), 4.5), squeeze=False)
    width = 0.8 / max(1, len(types))
    for ax, t in zip(axes[0], threads):
        for i, ty in enumerate(types):
            xs, med, lo, hi = [], [], [], []
            for j, (k, n) in enumerate(shapes):
                if fr := get.get((ty, k, n, t)):
                    m = statistics.median(fr)
                    xs.append(j + i * width)
                    med.append(100 * m)
                    lo.append(100 * (m - fr[0]))
                    hi.append(100 * (fr[-1] - m))
            ax.bar(xs, med, width, yerr=[lo, hi], capsize=2, label=ty)
        ax.axhline(100 * BANDWIDTH_TARGET, color="k", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [f"{k}x{n}" for k, n in shapes],
                      rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("% of the read bandwidth")
        ax.set_ylim(0, 110)
        ax.set_title(f"m = 1, {t} thread{'s' if t > 1 else ''}")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot(mm: list[dict], types: list[str], threads: list[int], shapes: list[tuple], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(threads), figsize=(7 * len(threads), 5), squeeze=False)
    labels = [f"{m}x{k}x{n}" for m, k, n in shapes]
    width = 0.8 / max(1, len(types))
    get = {(r["type"].lower(), r["m"], r["k"], r["n"], r["threads"]): r["gmacs"] for r in mm}
    for ax, t in zip(axes[0], threads):
        for i, ty in enumerate(types):
            vals = [get.get((ty.lower(), *s, t), 0.0) for s in shapes]
            ax.bar([x + i * width for x in range(len(shapes))], vals, width, label=ty)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shapes))], labels, rotation=45, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("GMAC/s")
        ax.set_title(f"MUL_MAT, {t} thread{'s' if t > 1 else ''}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""The vision encoder's speed on the CPU before and after a change of the patch series, in one run: written into
the "vision-encode" section of docs/benchmarks.md.

* **Encode**: ``llama-mtmd-cli`` of each build on the model of ``bench_mllama_tiles.py`` (a random Llama 3.2
  Vision with the real vision encoder: 560 px tiles of 1601 positions, 32 + 8 layers of 1280 / 5120, S3D8
  projector), its own "image slice encoded in N ms", for a 4-tile image (scikit-image's Hubble deep field, a 2x2
  canvas) and the same image with ``--image-max-tiles 1``. The builds alternate run by run, so that a change of
  the machine's load falls on both; the load average before each run is recorded.
* **Flash attention alone**: ``test-backend-ops perf -o FLASH_ATTN_EXT`` of each build on the encoder's shape
  (16 heads of 80, 6432 positions = 4 tiles of 1608, F16 K/V, with and without a mask), in GFLOPS
  (test-backend-ops gives the CPU backend half the hardware threads), and as a fraction of the FP32 FMA peak of
  as many cores, measured by ``benchmarks/fp32_peak.c`` (one core, times the threads).

The "before" build is the series without the change, made by hand (it is not in the repository), e.g. for the
flash-attention and GELU patches: a worktree of ``work/llama.cpp`` at the series' end with the CPU backend of the
parent of the flash-attention patch (so that both builds have the patches' test cases),

    git -C work/llama.cpp worktree add --detach ../fa-before HEAD
    git -C work/fa-before checkout <flash-attention patch commit>~1 -- ggml/src/ggml-cpu
    cmake -S . -B build/fa-before -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
          -DLLAMA_CPP_DIR=$PWD/work/fa-before
    cmake --build build/fa-before --target llama-mtmd-cli test-backend-ops

Not a test; run by hand after ``bash ci/build.sh host`` and
``bench_mllama_tiles.py --prepare-only``:

    .venv/bin/python benchmarks/bench_vision_encode.py --before build/fa-before/bin
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from statistics import median
from typing import Any

from bench_common import (  # type: ignore[import-not-found]
    BUILD, ROOT, cpu_name, data_file, keep_raw_results, run, shown,
)
from bench_mllama_tiles import encode, photo, prepare  # type: ignore[import-not-found]
from report_sections import write_section  # type: ignore[import-not-found]

RAW_NAME = "benchmarks-vision-encode.json"
PHOTO = "hubble_deep_field"  # 1000 x 872: a 2x2 canvas at cap 4
FA_CASES = {"no mask": 0, "mask": 1}
FA_FILTER = r"hsk=80,hsv=80,nh=16,nr23=\[1,1\],kv=6432,nb=6432,mask={mask},"
GFLOPS = re.compile(r"([\d.]+) GFLOPS")


def fa_threads() -> int:
    """The CPU backend's threads in test-backend-ops: half the hardware threads, at least one."""
    return max(1, (os.cpu_count() or 1) // 2)


def fa_gflops(bin_dir: Path) -> dict[str, float]:
    """GFLOPS of test-backend-ops' perf mode for the encoder's flash-attention shapes."""
    out: dict[str, float] = {}
    for name, mask in FA_CASES.items():
        proc = run([str(bin_dir / "test-backend-ops"), "perf", "-o", "FLASH_ATTN_EXT", "-b", "CPU", "-p",
                    FA_FILTER.format(mask=mask)], capture_output=True, text=True, errors="replace")
        rates = [float(x) for line in proc.stdout.splitlines() if "kv=6432" in line for x in GFLOPS.findall(line)]
        if len(rates) != 1:
            raise RuntimeError(f"expected one perf line for {name}, got {len(rates)}:\n{proc.stdout[-3000:]}")
        out[name] = rates[0]
    return out


def fp32_peak(work: Path) -> dict[str, Any]:
    exe = work / "fp32_peak"
    run(["cc", "-O2", "-march=native", "-ffp-contract=fast", str(ROOT / "benchmarks" / "fp32_peak.c"), "-o",
         str(exe)])
    gflops, lanes, _ = run([str(exe)], capture_output=True, text=True).stdout.split()
    return {"gflops_per_core": float(gflops), "lanes": int(lanes)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    text, mmproj = prepare(args.work)
    img = photo(args.work, PHOTO)
    builds = {"before": args.before, "after": args.after}
    result: dict[str, Any] = {"date": str(datetime.date.today()), "cpu": cpu_name(), "cpus": os.cpu_count(),
                              "threads": args.threads, "runs": args.runs, "encode": [], "fa": {},
                              "fa_threads": fa_threads(), "peak": fp32_peak(args.work)}
    for build, bin_dir in builds.items():
        result["fa"][build] = fa_gflops(bin_dir)
        print(build, json.dumps(result["fa"][build]), file=sys.stderr, flush=True)
    for i in range(args.runs):
        for build, bin_dir in (builds.items() if i % 2 == 0 else reversed(builds.items())):
            for cap in (4, 1):
                row = {"build": build, "run": i, "cap": cap,
                       **encode(text, mmproj, img, cap, args.threads, exe=str(bin_dir / "llama-mtmd-cli"))}
                result["encode"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return result


def write_report(result: dict[str, Any], args: argparse.Namespace) -> None:
    enc = result["encode"]

    def times(build: str, cap: int) -> list[float]:
        return [r["encode_ms"] / 1000 for r in enc if r["build"] == build and r["cap"] == cap]

    peak = result["peak"]["gflops_per_core"] * result["fa_threads"]
    loads = [r["load_before"] for r in enc]
    lines = [f"Generated by `python benchmarks/bench_vision_encode.py --before <bin>` on {result['date']} "
             f"({result['cpu']}, {result['cpus']} logical CPUs, {result['threads']} threads, {result['runs']} runs "
             f"per build and cap, the builds alternating; load average before the runs {min(loads):.1f}-"
             f"{max(loads):.1f}). Before: the series with the CPU backend of its state before the encoder's two CPU "
             "patches (`ggml-cpu : tiled flash attention ...`, `ggml-cpu : vectorized GELU (erf) for F32`); after: "
             "with them. Encode: `llama-mtmd-cli`'s own \"image slice encoded in\" time on "
             "the random Llama 3.2 Vision of `bench_mllama_tiles.py` (the real vision encoder, S3D8 projector) for "
             f"scikit-image's {PHOTO} (a 2x2 canvas: 4 tiles, 6432 positions), and with `--image-max-tiles 1`. "
             f"Raw results: `{shown(data_file(args.doc, RAW_NAME))}`.", "",
             "| | before s (median, min-max) | after s (median, min-max) | speed-up |", "|---|---:|---:|---:|"]
    for cap in (4, 1):
        b, a = times("before", cap), times("after", cap)
        lines.append(f"| encode, {cap} tile{'s' if cap > 1 else ''} | {median(b):.1f} ({min(b):.1f}-{max(b):.1f}) | "
                     f"{median(a):.1f} ({min(a):.1f}-{max(a):.1f}) | {median(b) / median(a):.2f}x |")
    a1, a4 = median(times("after", 1)), median(times("after", 4))
    lines += ["", f"After the change, the 1-tile cap encodes in {a1 / a4:.2f} of the 4-tile time.", "",
              "Flash attention alone (`test-backend-ops perf -o FLASH_ATTN_EXT -b CPU`, which gives the CPU backend "
              f"{result['fa_threads']} thread{'s' if result['fa_threads'] > 1 else ''}; 16 heads of 80, 6432 x 6432 "
              "positions, F16 K/V; the FLOPs are the two matrix products), against the FP32 FMA peak of as many "
              f"cores: {result['peak']['gflops_per_core']:.0f} GFLOPS per core measured by `benchmarks/fp32_peak.c` "
              f"({result['peak']['lanes']} lanes){'; ' + result['peak_note'] if 'peak_note' in result else ''}.", "",
              "| mask | before GFLOPS | after GFLOPS | after, of the FP32 peak |", "|---|---:|---:|---:|"]
    for name in FA_CASES:
        b, a = result["fa"]["before"][name], result["fa"]["after"][name]
        lines.append(f"| {name} | {b:.1f} | {a:.1f} | {100 * a / peak:.0f} % |")
    text = "## mllama: the vision encoder on the CPU, before and after\n\n" + "\n".join(lines) + "\n"
    write_section(args.doc, "vision-encode", text, title="S3D8 benchmarks")
    print(f"wrote the vision-encode section of {args.doc}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, help="bin folder of the build without the change (llama-mtmd-cli, "
                                                "test-backend-ops)")
    ap.add_argument("--after", type=Path, default=BUILD / "bin", help="bin folder with it (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2, help="encode runs per build and cap (default: %(default)s)")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-mllama-tiles")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the last raw results")
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    raw = args.work / "bench_vision_encode.json"
    if not args.report_only:
        if args.before is None:
            ap.error("--before is required unless --report-only")
        for bin_dir in (args.before, args.after):
            for exe in ("llama-mtmd-cli", "test-backend-ops"):
                if not (bin_dir / exe).is_file():
                    ap.error(f"missing {bin_dir / exe}")
        try:
            result = measure(args)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            sys.exit(f"bench_vision_encode: {e}")
        raw.write_text(json.dumps(result, indent=1))
    kept = keep_raw_results(raw, data_file(args.doc, RAW_NAME), args.report_only)
    write_report(json.loads(kept.read_text()), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

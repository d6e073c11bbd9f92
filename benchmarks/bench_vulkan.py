"""MUL_MAT speed of S3D8 on a Vulkan device against llama.cpp's own types of similar size, measured in one run.

``test-backend-ops perf -o MUL_MAT -b Vulkan<N>`` of the vulkan build on the paper's shape (4096 rows x 14336
columns, the FFN-down matrix of an 8B model) for one token and for 512, for S3D8, Q4_0, Q2_K and IQ2_S. Reported:
us per run, the rate test-backend-ops prints (GB/s of weights streamed for one token, GFLOPS for 512), and each
type's ratio to Q4_0 measured in the same run; with the device's name as the driver reports it. On Mesa's lavapipe
(the CI machine's software device) the numbers say how the shaders run on the CPU cores behind it, nothing about a
phone's or a desktop's GPU: the report says which device it was, and a GPU run belongs next to it.

    bash ci/build.sh vulkan
    .venv/bin/python benchmarks/bench_vulkan.py                 # one token (--tokens 1 512 on a GPU); measures, writes docs/data/benchmarks-vulkan.json and
                                                                # the section "Vulkan (MUL_MAT)" of docs/benchmarks.md
    .venv/bin/python benchmarks/bench_vulkan.py --report-only   # the section again from the kept results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from typing import Any

from bench_common import ROOT, cpu_name, run  # type: ignore[import-not-found]
from report_sections import write_section  # type: ignore[import-not-found]

from gguf_s3d8.fsio import atomic_write

BIN = ROOT / "build" / "vulkan" / "bin"
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "docs" / "data" / "benchmarks-vulkan.json"
TYPES = ("s3d8", "q4_0", "q2_K", "iq2_s")
TOKENS = (1, 512)  # --tokens: lavapipe takes minutes per 512-token case, so run those on a GPU
M, K = 4096, 14336

LINE = re.compile(r"MUL_MAT\(type_a=(\w+),type_b=f32,m=(\d+),n=(\d+),k=(\d+),bs=\[1,1\],nr=\[1,1\].*?:\s+(\d+) runs - "
                  r"\s*([\d.]+) us/run - .*? - \s*([\d.]+) (GB/s|MFLOPS|GFLOPS|TFLOPS)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
SCALE = {"MFLOPS": 1e-3, "GFLOPS": 1.0, "TFLOPS": 1e3, "GB/s": 1.0}
DEVICE = re.compile(r"ggml_vulkan: (\d+) = (.+)")


def measure(device: int, tokens: tuple[int, ...]) -> dict[str, Any]:
    exe = BIN / "test-backend-ops"
    if not exe.exists():
        sys.exit(f"missing {exe}: build the vulkan preset first (bash ci/build.sh vulkan)")
    pattern = f"type_a=({'|'.join(TYPES)}),type_b=f32,m={M},n=({'|'.join(map(str, tokens))}),k={K},bs=\\[1,1\\],nr=\\[1,1\\]"
    env = {**os.environ, "GGML_VK_VISIBLE_DEVICES": str(device)}
    proc = run([str(exe), "perf", "-o", "MUL_MAT", "-b", "Vulkan0", "-p", pattern], capture_output=True, text=True,
               errors="replace", env=env)
    return results(proc.stdout + proc.stderr, device, tokens, pattern)


def results(output: str, device: int, tokens: tuple[int, ...], pattern: str) -> dict[str, Any]:
    """The results of one test-backend-ops perf run from its output."""
    out = ANSI.sub("", output)  # test-backend-ops colours the rate
    names = dict(DEVICE.findall(out))
    rows = []
    for t, m, n, k, runs, us, rate, unit in LINE.findall(out):
        rows.append({"type": t, "m": int(m), "n": int(n), "k": int(k), "runs": int(runs), "us": float(us),
                     "rate": float(rate) * SCALE[unit], "unit": "GB/s" if unit == "GB/s" else "GFLOPS"})
    missing = {(t, n) for t in TYPES for n in tokens} - {(r["type"], r["n"]) for r in rows}
    if missing:
        sys.exit(f"test-backend-ops printed no perf line for {sorted(missing)}:\n{out[-3000:]}")
    return {"date": str(datetime.date.today()), "device": names.get("0", "unknown").split(" | ")[0], "host_cpu": cpu_name(),
            "cpus": os.cpu_count(), "tokens": list(tokens), "rows": rows,
            "command": f"GGML_VK_VISIBLE_DEVICES={device} build/vulkan/bin/test-backend-ops perf -o MUL_MAT -b Vulkan0 "
                       f"-p '{pattern}'"}


def report(res: dict[str, Any]) -> str:
    by = {(r["type"], r["n"]): r for r in res["rows"]}
    lines = ["## Vulkan (MUL_MAT)", "", f"Device: **{res['device']}** (host CPU {res['host_cpu']}, {res['cpus']} cores), {res['date']}. "
             f"`test-backend-ops perf -o MUL_MAT` of the vulkan build, m = {M}, k = {K}; ratio = Q4_0's time / the "
             "type's (above 1: faster than Q4_0), measured in the same run.", ""]
    for n in res["tokens"]:
        unit = by[(TYPES[0], n)]["unit"]
        lines += [f"**{n} token{'s' if n > 1 else ''}**", "", f"| type | us/run | {unit} | ratio to Q4_0 |",
                  "|---|---:|---:|---:|"]
        q4 = by[("q4_0", n)]["us"]
        for t in TYPES:
            r = by[(t, n)]
            lines.append(f"| {t.upper()} | {r['us']:.1f} | {r['rate']:.2f} | {q4 / r['us']:.2f} |")
        lines.append("")
    if "llvmpipe" in res["device"]:
        lines += ["This is Mesa's lavapipe, a software device: the shaders ran on the CPU cores behind it, so the ratios say "
                  "nothing about a GPU (docs/gpu.md). " + res.get("note", ""), ""]
    lines += ["Reproduce: `bash ci/build.sh vulkan && .venv/bin/python benchmarks/bench_vulkan.py` (the command it "
              f"runs: `{res['command']}`)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", type=int, default=0, help="Vulkan device index (GGML_VK_VISIBLE_DEVICES), default 0")
    ap.add_argument("--tokens", type=int, nargs="+", choices=TOKENS, default=[1],
                    help="activation rows (default 1; add 512 on a GPU: a software device takes minutes a case)")
    ap.add_argument("--report-only", action="store_true", help="rewrite the section from the kept results")
    args = ap.parse_args(argv)
    if args.report_only:
        if not RESULTS.exists():
            sys.exit(f"no kept results in {RESULTS}: run without --report-only first")
        res = json.loads(RESULTS.read_text())
    else:
        res = measure(args.device, tuple(args.tokens))
        atomic_write(RESULTS, (json.dumps(res, indent=1) + "\n").encode())
    write_section(DOC, "vulkan", report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

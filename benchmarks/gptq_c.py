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

``smollm2``: the main job's setting (SmolLM2-135M-Instruct, the 30 ``ffn_down`` in S3D8, Q8_0 elsewhere) from the
main job's files in ``.cache/main-job`` (f16 model, imatrix) and an X^T X file of the same training text
(``--xtx``, from ``llama-imatrix -m .cache/main-job/smollm2-135m-f16.gguf -f .cache/main-job/train.txt -c 512
--chunks 64 --save-xtx FILE``).

The binaries come from ``--bin-dir`` (default ``$S3D8_BIN_DIR`` or ``build/host/bin``)::

    .venv/bin/python benchmarks/gptq_c.py synthetic
    .venv/bin/python benchmarks/gptq_c.py smollm2 --xtx xtx.gguf
"""

from __future__ import annotations

import argparse
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
from bench_common import ROOT as REPO, write_llama_layer  # type: ignore[import-not-found]


def run_measured(cmd: list[str], threads: int) -> tuple[float, int, str]:
    """(wall seconds, peak resident bytes, log) of one command. The peak comes from GNU time's %M: a child of
    this (large) Python process would report this process's resident size in its own ru_maxrss."""
    gnu_time = Path("/usr/bin/time")
    full = [str(gnu_time), "-f", "S3D8_MAXRSS_KB %M", *cmd] if gnu_time.is_file() else cmd
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


def quantize(bin_dir: Path, src: Path, out: Path, extra: list[str], tensors: str, threads: int) -> Run:
    cmd = [str(bin_dir / "llama-quantize"), *extra, "--tensor-type", f"{tensors}=s3d8", str(src), str(out), "Q8_0",
           str(threads)]
    dt, peak, log = run_measured(cmd, threads)
    m = re.search(r"quantize time =\s*([\d.]+) ms", log)
    gptq = [float(x) for x in re.findall(r"\(GPTQ, X\^T X of \d+ tokens, [^,]+ start, ([\d.]+) s\)", log)]
    return Run(dt, float(m.group(1)) / 1000 if m else dt, peak, gptq, log)


def write_model(path: Path, w_down: np.ndarray, n_embd: int, n_ff: int) -> None:
    """A one-layer Llama GGUF (f16) whose only nonzero tensor is ffn_down."""
    write_llama_layer(path, n_embd, n_ff, lambda name, shape: w_down if name == "ffn_down" else np.zeros(shape))


def write_xtx(path: Path, name: str, xtx: np.ndarray, tokens: int) -> None:
    """An X^T X file with one matrix (docs/hessian-format.md, ``gguf_s3d8.xtx``), fingerprint unknown."""
    from gguf_s3d8 import xtx as xtx_file

    m = name + ".xtx"
    xtx_file.write_xtx(path, xtx_file.XtxFile(matrices={m: xtx_file.pack_lower(xtx)}, dims={m: xtx.shape[0]},
                                              tokens={m: tokens}, weights={name: (m, "")}))


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
        print(f"  (the X^T X matrix alone is {k * k * 4 / 2**20:.0f} MiB, the f16 model file "
              f"{model.stat().st_size / 2**20:.0f} MiB)", flush=True)
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
    ap.add_argument("what", nargs="?", choices=("synthetic", "smollm2"), default="synthetic")
    ap.add_argument("--bin-dir", type=Path, default=Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin")))
    ap.add_argument("--threads", type=int, default=2, help="llama-quantize threads and OMP_NUM_THREADS (default 2)")
    ap.add_argument("--rows", "-n", type=int, default=4096, help="synthetic: output rows n (default 4096)")
    ap.add_argument("--cols", "-k", type=int, default=14336, help="synthetic: inputs k (default 14336)")
    ap.add_argument("--tokens", type=int, default=2048, help="synthetic: random activation rows (default 2048)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--python", action="store_true", help="synthetic: also run the torch GPTQ and compare")
    ap.add_argument("--xtx", type=Path, default=None, help="smollm2: the llama-imatrix --save-xtx file")
    ap.add_argument("--tmp", type=Path, default=None, help="folder for the temporary files (default: the system's)")
    args = ap.parse_args()
    (synthetic if args.what == "synthetic" else smollm2)(args)


if __name__ == "__main__":
    main()

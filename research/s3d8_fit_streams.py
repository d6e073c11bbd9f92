"""Which part of the codebook fit makes S3D8 without an imatrix worse than the reference encoder? (issue 12)

Re-encodes the 30 ``ffn_down`` tensors of the main job's ``llama-quantize`` S3D8 file (no imatrix) in place with
one of four fits, all on iw1's training histogram and with iw1's weight-space assignment and absmax scales:

  A  splitmix64 k-means++ + fp32 Lloyd   (= iw1 / llama-quantize: the bytes are checked against the file)
  B  splitmix64 k-means++ + float64 Lloyd
  C  PCG64 k-means++      + fp32 Lloyd
  D  PCG64 k-means++      + float64 Lloyd (= the reference encoder's fit)
  M  as A, every training point p counted ||p||^2 times more (the magnitude weighting that k-quants use
     without an imatrix, here on the codebook fit)

then measures KLD against the f16 model with the main job's own ``llama-perplexity`` command (24 x 512 held-out
tokens). Needs the main job's cache (``bash ci/main.sh``) and ``build/host``. Run:

    python research/s3d8_fit_streams.py --fit A --seed 0     # KLD 1.221, as docs/quality.md
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from gguf_s3d8 import codebook as reference_fit
from gguf_s3d8 import importance as iw1
from gguf_s3d8.constants import DEFAULT_CENTROID_RULE, FIT_CHANGE_THRESHOLD
from gguf_s3d8 import series_gguf
from qat import llama_perplexity

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = ROOT / ".cache" / "main-job"
FITS = ("A", "B", "C", "D", "M")


def fit(w: np.ndarray, alpha: np.ndarray, kind: str, seed: int) -> np.ndarray:
    points, counts = iw1.weighted_histogram(w, alpha, np.ones(w.shape[1], dtype=np.int64), DEFAULT_CENTROID_RULE)
    if kind == "M":
        counts = counts * (points**2).sum(axis=1).astype(np.int64)
    if kind in ("A", "B", "M"):
        init = iw1.kmeans_plus_plus_splitmix(points, counts, iw1.SplitMix64(seed))
    else:
        init = reference_fit.kmeans_plus_plus(points, counts, np.random.default_rng(seed))
    if kind in ("A", "C", "M"):
        c = iw1.lloyd_fp32(points, counts, init, threshold=FIT_CHANGE_THRESHOLD)
    else:
        c, _ = reference_fit.lloyd(points, counts, init)
    return reference_fit.apply_centroid_rule(c, DEFAULT_CENTROID_RULE).astype(np.uint8)


def reencode(model: Path, f16: Path, kind: str, seed: int) -> None:
    gguf = series_gguf()
    src = {t.name: t for t in gguf.GGUFReader(f16).tensors}
    dst = gguf.GGUFReader(model, "r+")
    for t in dst.tensors:
        if not t.name.endswith("ffn_down.weight"):
            continue
        w = np.array(src[t.name].data, dtype=np.float32)
        alpha = iw1.bf16_round(iw1.base_scales(w))
        container = iw1._encode_weight_space(w, alpha, fit(w, alpha, kind, seed), t.name)
        if kind == "A" and seed == 0 and not np.array_equal(np.asarray(t.data).reshape(-1), container.reshape(-1)):
            sys.exit(f"{t.name}: fit A with seed 0 does not reproduce llama-quantize's bytes")
        t.data.reshape(-1)[:] = container.reshape(-1)
    dst.data.flush()


def kld(model: Path, bin_dir: Path) -> float:
    out = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(MAIN_JOB / "eval.txt"),
                          "-c", "512", "--chunks", "24", "-t", "2", "--kl-divergence-base", str(MAIN_JOB / "f16.kld"),
                          "--kl-divergence"], capture_output=True, text=True, check=True)
    return llama_perplexity.parse(out.stdout + out.stderr, kld=True).kld


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", choices=FITS, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build" / "host" / "bin")
    args = ap.parse_args()
    base = MAIN_JOB / "smollm2-135m-s3d8-iw1.gguf"
    if not base.exists():
        sys.exit(f"{base} is missing: run bash ci/main.sh first")
    with tempfile.TemporaryDirectory(dir=MAIN_JOB) as tmp:
        model = Path(tmp) / "model.gguf"
        shutil.copyfile(base, model)
        reencode(model, MAIN_JOB / "smollm2-135m-f16.gguf", args.fit, args.seed)
        print(f"fit {args.fit} seed {args.seed}: KLD {kld(model, args.bin_dir):.6f}")


if __name__ == "__main__":
    main()

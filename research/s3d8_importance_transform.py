"""Does iw1 do better with a tempered importance? (issue 12: S3D8 + imatrix, its level and its spread)

iw1 minimises ``sum_ij u_j (W_ij - W~_ij)^2`` with ``u_j`` the imatrix entry of input column j. SmolLM2's
``ffn_down`` inputs are far from isotropic: a few columns carry most of the energy, so the weighted codebook
fit spends its 32 entries on a handful of columns. This script re-encodes the 30 ``ffn_down`` tensors of the
main job's S3D8 file with iw1 (numpy twin, the same bytes as ``llama-quantize``) from a transformed importance
and measures KLD against the f16 model with the main job's ``llama-perplexity`` command (24 x 512 held-out
tokens), for several k-means seeds:

  none        no imatrix: the encoder as it is without one (since 2026-12-03 iw1's column-maximum weights)
  power:G     u_j ** G  (G = 1 is iw1 as it is; G = 0.5 the square root)
  cap:R       min(u_j, R * median(u))
  colmax:P    no imatrix: u_j = (max_i |W_ij| / std(W)) ** P, a data-free importance from the columns'
              largest weights (the super-activation columns of ffn_down carry weights 20-30 std), used for
              the codebook fit only (absmax scales, weight-space assignment: iw1 without an imatrix otherwise)
  colmaxs:P   as colmax:P, with iw1's whole search (clipped scales, weight-space Lloyd) on that importance
  outlier:T   no imatrix: u_j = 2^16 for columns whose largest |W_ij| is >= T std(W), 1 elsewhere (fit only)
  imcol:P     u_j * (max_i |W_ij| / max |W|) ** P: the imatrix times the column-maximum weights
  scale:B     u_j as it is, integer column weights scaled to 2^B instead of iw1's 2^16 (fewer columns
              clamped to weight 1 where a few columns hold nearly all the importance)

Needs the main job's cache (``bash ci/main.sh``) and ``build/host``. Run:

    python research/s3d8_importance_transform.py --transform power:0.5 --seeds 0 1 2 3 4
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from gguf_s3d8 import importance as iw1
from gguf_s3d8 import series_gguf
from gguf_s3d8.imatrix import read_imatrix
# benchmarks/ is a folder of scripts, not a package: the script's own folder is sys.path[0] when it runs
from s3d8_fit_streams import MAIN_JOB, ROOT, kld  # type: ignore[import-not-found]


DATA_FREE = ("colmax", "colmaxs", "outlier")


def data_free(w: np.ndarray, spec: str) -> np.ndarray:
    kind, _, arg = spec.partition(":")
    r = np.maximum(w.max(axis=0), -w.min(axis=0)).astype(np.float64) / float(w.std(dtype=np.float64))
    if kind in ("colmax", "colmaxs"):
        return (r ** float(arg)).astype(np.float32)
    return np.where(r >= float(arg), 65536.0, 1.0).astype(np.float32)


def transform(u: np.ndarray, spec: str) -> np.ndarray:
    kind, _, arg = spec.partition(":")
    x = float(arg)
    u64 = u.astype(np.float64)
    if kind == "power":
        return (u64**x).astype(np.float32)
    if kind == "scale":
        return u
    if kind == "cap":
        return np.minimum(u64, x * float(np.median(u64))).astype(np.float32)
    raise SystemExit(f"unknown transform {spec!r} (see --help)")


def combined(u: np.ndarray, w: np.ndarray, spec: str) -> np.ndarray:
    r = np.maximum(w.max(axis=0), -w.min(axis=0)).astype(np.float64)
    r = r / r.max()
    return (u.astype(np.float64) * r ** float(spec.partition(":")[2])).astype(np.float32)


def _encode(args: tuple[np.ndarray, np.ndarray | None, int, str, str]) -> np.ndarray:
    w, u, seed, name, spec = args
    kind, _, arg = spec.partition(":")
    if kind == "scale":
        iw1.IMPORTANCE_SCALE = 1 << int(arg)
    if kind in DATA_FREE and kind != "colmaxs":
        alpha = iw1.bf16_round(iw1.base_scales(w))
        weights = iw1.column_weights(u, w.shape[1], name=name)
        cb = iw1.fit_codebook_weighted(w, alpha, weights, rule="trunc", seed=seed, threshold=iw1.FIT_CHANGE_THRESHOLD)
        return iw1._encode_weight_space(w, alpha, cb, name)
    return iw1.quantize_s3d8_importance(w, u, seed=seed, name=name)


def reencode(model: Path, f16: Path, imatrix: Path, spec: str, seed: int, jobs: int) -> None:
    gguf = series_gguf()
    src = {t.name: t for t in gguf.GGUFReader(f16).tensors}
    im = read_imatrix(imatrix)
    dst = gguf.GGUFReader(model, "r+")
    todo = [t for t in dst.tensors if t.name.endswith("ffn_down.weight")]
    work: list[tuple[np.ndarray, np.ndarray | None, int, str, str]] = []
    for t in todo:
        w = np.array(src[t.name].data, dtype=np.float32)
        if spec == "none":
            work.append((w, None, seed, t.name, spec))
            continue
        if spec.partition(":")[0] in DATA_FREE:
            work.append((w, data_free(w, spec), seed, t.name, spec))
            continue
        u = im.for_tensor(t.name, w.shape[1])
        if u is None:
            sys.exit(f"{imatrix} has no entry for {t.name}")
        if spec.startswith("imcol:"):
            work.append((w, combined(u.reshape(-1), w, spec), seed, t.name, spec))
            continue
        work.append((w, transform(u.reshape(-1), spec), seed, t.name, spec))
    with ProcessPoolExecutor(jobs) as pool:
        for t, container in zip(todo, pool.map(_encode, work)):
            t.data.reshape(-1)[:] = container.reshape(-1)
    dst.data.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transform", default="power:1", help="none, power:G, cap:R, colmax:P, colmaxs:P, outlier:T, imcol:P or scale:B (see above; "
                    "default: power:1 = iw1 with the imatrix as it is)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--jobs", type=int, default=2, help="processes encoding matrices in parallel")
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build" / "host" / "bin")
    ap.add_argument("--json", type=Path, help="append one line per seed to this file")
    args = ap.parse_args()
    base = MAIN_JOB / "smollm2-135m-s3d8-iw1.gguf"
    if not base.exists():
        sys.exit(f"{base} is missing: run bash ci/main.sh first")
    for seed in args.seeds:
        with tempfile.TemporaryDirectory(dir=MAIN_JOB) as tmp:
            model = Path(tmp) / "model.gguf"
            shutil.copyfile(base, model)
            reencode(model, MAIN_JOB / "smollm2-135m-f16.gguf", MAIN_JOB / "imatrix.gguf", args.transform, seed,
                     args.jobs)
            value = kld(model, args.bin_dir)
        print(f"{args.transform} seed {seed}: KLD {value:.6f}", flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps({"transform": args.transform, "seed": seed, "kld": value}) + "\n")


if __name__ == "__main__":
    main()

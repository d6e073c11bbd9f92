"""Time the S3D8 codec on a weight-like random matrix: fit, assign, pack (and the container write).

Not a test: run by hand, e.g. ``python benchmarks/bench_codec.py`` (default 14336 x 4096, the Llama-3
8B/11B MLP width). Prints seconds per phase. The matrix is Laplace-distributed with a few heavier-tailed
rows, like real LLM weights (absmax several standard deviations out).
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

import bench_common  # type: ignore[import-not-found]  # noqa: F401  # puts the repository root on sys.path

from gguf_s3d8.assignment import CellAssigner, nearest_centroid
from gguf_s3d8.codebook import apply_centroid_rule, kmeans_plus_plus, lloyd, training_histogram
from gguf_s3d8.container import allocate_container
from gguf_s3d8.eligibility import n_triples
from gguf_s3d8.packing import pack_bytes, sign_bits
from gguf_s3d8.quantize import TRIPLES_PER_CHUNK, dequantize_s3d8, quantize_s3d8_with_codebook
from gguf_s3d8.scales import absmax_scale_bf16, scales_to_fp32
from gguf_s3d8.triples import triple_components

T = TypeVar("T")


def weight_like(n: int, k: int, seed: int) -> np.ndarray:
    """Laplace weights with per-row spread and a sprinkling of outliers (fp32)."""
    rng = np.random.default_rng(seed)
    w = rng.laplace(scale=0.02, size=(n, k)).astype(np.float32)
    w *= rng.uniform(0.5, 2.0, size=(n, 1)).astype(np.float32)
    outliers = rng.integers(0, n * k, size=n * k // 20000)
    w.reshape(-1)[outliers] *= np.float32(6.0)
    return w


def timed(label: str, fn: Callable[[], T], results: dict[str, float]) -> T:
    t0 = time.perf_counter()
    out = fn()
    results[label] = time.perf_counter() - t0
    print(f"  {label:<28s} {results[label]:7.2f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", "-n", type=int, default=14336, help="output rows n (default 14336)")
    ap.add_argument("--cols", "-k", type=int, default=4096, help="input columns k (default 4096)")
    ap.add_argument("--rule", choices=("round", "trunc"), default="round", help="centroid rule")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--brute", action="store_true",
                    help="also time the brute-force nearest_centroid and check it gives identical indices")
    ap.add_argument("--quality", action="store_true",
                    help="also report the relative RMS reconstruction error (dequantise, not timed)")
    args = ap.parse_args()
    n, k = args.rows, args.cols
    print(f"S3D8 codec benchmark: {n} x {k} fp32, rule={args.rule}, numpy {np.__version__}, "
          f"{platform.machine()} python {platform.python_version()}")
    w = weight_like(n, k, args.seed)
    r: dict[str, float] = {}
    # fit_codebook(w) step by step (same calls, timed separately)
    rng = np.random.default_rng(args.seed)
    points, counts = timed("fit: sample + histogram", lambda: training_histogram(w, args.rule, rng), r)
    init = timed("fit: k-means++", lambda: kmeans_plus_plus(points, counts, rng), r)
    centroids, iterations = timed("fit: Lloyd", lambda: lloyd(points, counts, init), r)
    codebook = apply_centroid_rule(centroids, args.rule).astype(np.uint8)
    print(f"    ({counts.sum()} training vectors, {len(points)} distinct, {iterations} Lloyd iterations)")
    scales = timed("scales", lambda: absmax_scale_bf16(w), r)
    alpha = scales_to_fp32(scales)
    container, body = allocate_container(k, n, codebook, scales)
    t_norm = t_assign = t_pack = t_brute = 0.0
    assigner = CellAssigner(codebook)
    for p0 in range(0, n_triples(n), TRIPLES_PER_CHUNK):
        p1 = min(n_triples(n), p0 + TRIPLES_PER_CHUNK)
        t0 = time.perf_counter()
        comps = triple_components(w, alpha, p0, p1)
        a = np.abs(comps)
        t1 = time.perf_counter()
        q = assigner.assign(a[0], a[1], a[2])
        t2 = time.perf_counter()
        s = sign_bits(comps)
        body[p0:p1] = pack_bytes(q, s[0], s[1], s[2])
        t3 = time.perf_counter()
        t_norm += t1 - t0
        t_assign += t2 - t1
        t_pack += t3 - t2
        if args.brute:
            t4 = time.perf_counter()
            if not np.array_equal(q, nearest_centroid(a[0], a[1], a[2], codebook)):
                raise SystemExit("fast and brute-force assignment differ")
            t_brute += time.perf_counter() - t4
    for label, v in (("normalise + triples", t_norm), ("assign (exact fp32)", t_assign), ("signs + pack", t_pack)):
        r[label] = v
        print(f"  {label:<28s} {v:7.2f} s")
    total = sum(r.values())
    print(f"  {'total':<28s} {total:7.2f} s")
    if args.brute:
        print(f"  (brute-force nearest_centroid for comparison: {t_brute:.2f} s, identical indices)")
    t0 = time.perf_counter()
    check = quantize_s3d8_with_codebook(w, codebook)
    print(f"  (quantize_s3d8_with_codebook end to end: {time.perf_counter() - t0:.2f} s, "
          f"identical bytes: {bool(np.array_equal(check, container))})")
    if args.quality:
        err = dequantize_s3d8(container) - w
        rel = float(np.sqrt(np.mean(err.astype(np.float64) ** 2) / np.mean(w.astype(np.float64) ** 2)))
        print(f"  relative RMS reconstruction error: {rel:.4f}")


if __name__ == "__main__":
    main()

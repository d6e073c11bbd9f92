"""Which layers make two S3D8 encodings of SmolLM2 differ in quality? (issue 12, docs/quality.md)

Encodes the main job's 30 ``ffn_down`` tensors with iw1 (numpy twin, the bytes of ``llama-quantize``) at two
k-means seeds, then measures KLD against the f16 model (the main job's ``llama-perplexity`` command, 24 x 512
held-out tokens) for models that take the ``good`` seed's tensors everywhere except a range of layers, which come
from the ``bad`` seed. A range that carries the difference moves the KLD from the good seed's value to the bad
one's. Without ``--imatrix`` the encoder runs as without an imatrix (its data-free column-maximum weights).

Needs the main job's cache (``bash ci/main.sh``) and ``build/host``. Run (docs/quality.md's localisation of
the layer-11 lottery was made with uniform weights, the encoder before 2026-12-03):

    python research/s3d8_layer_swap.py --good 0 --bad 1 --ranges 0-30 0-10 10-20 20-30 29-30
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from gguf_s3d8 import importance as iw1
from gguf_s3d8 import series_gguf
from gguf_s3d8.imatrix import read_imatrix

# benchmarks/ is a folder of scripts, not a package: the script's own folder is sys.path[0] when it runs
from s3d8_fit_streams import MAIN_JOB, ROOT  # type: ignore[import-not-found]
from s3d8_robustness import measure  # type: ignore[import-not-found]

N_LAYERS = 30
NAMES = [f"blk.{layer}.ffn_down.weight" for layer in range(N_LAYERS)]


def _encode(job: tuple[np.ndarray, np.ndarray | None, int, str]) -> np.ndarray:
    w, u, seed, name = job
    return iw1.quantize_s3d8_importance(w, u, seed=seed, name=name)


def encode_all(seed: int, use_imatrix: bool, jobs: int) -> dict[str, np.ndarray]:
    """The 30 containers at one seed, by tensor name."""
    gguf = series_gguf()
    src = {t.name: t for t in gguf.GGUFReader(MAIN_JOB / "smollm2-135m-f16.gguf").tensors}
    im = read_imatrix(MAIN_JOB / "imatrix.gguf") if use_imatrix else None
    work: list[tuple[np.ndarray, np.ndarray | None, int, str]] = []
    for name in NAMES:
        w = np.array(src[name].data, dtype=np.float32)
        u = im.for_tensor(name, w.shape[1]) if im is not None else None
        work.append((w, None if u is None else u.reshape(-1), seed, name))
    with ProcessPoolExecutor(jobs) as pool:
        return dict(zip(NAMES, pool.map(_encode, work)))


def layer_range(spec: str) -> range:
    a, _, b = spec.partition("-")
    r = range(int(a), int(b))
    if not b or r.start < 0 or r.stop > N_LAYERS or r.start > r.stop:
        raise argparse.ArgumentTypeError(f"{spec!r}: give a range A-B of layers, 0 <= A <= B <= {N_LAYERS}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--good", type=int, required=True, help="k-means seed of the base model")
    ap.add_argument("--bad", type=int, required=True, help="k-means seed the swapped layers come from")
    ap.add_argument("--ranges", type=layer_range, nargs="+", required=True, metavar="A-B",
                    help="layer ranges (A inclusive, B exclusive) to take from the bad seed, one model each")
    ap.add_argument("--imatrix", action="store_true", help="encode with the main job's imatrix")
    ap.add_argument("--jobs", type=int, default=2, help="processes encoding matrices in parallel")
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build" / "host" / "bin")
    args = ap.parse_args()
    if not (MAIN_JOB / "smollm2-135m-s3d8-iw1.gguf").exists():
        sys.exit(f"{MAIN_JOB} has no S3D8 file: run bash ci/main.sh first")
    good = encode_all(args.good, args.imatrix, args.jobs)
    bad = encode_all(args.bad, args.imatrix, args.jobs)
    print(f"seed {args.good}: KLD {measure(good, args.bin_dir):.4f}", flush=True)
    for r in args.ranges:
        mixed = {n: bad[n] if layer in r else good[n] for layer, n in enumerate(NAMES)}
        print(f"seed {args.good} with layers {r.start}-{r.stop - 1} from seed {args.bad}: KLD "
              f"{measure(mixed, args.bin_dir):.4f}", flush=True)


if __name__ == "__main__":
    main()

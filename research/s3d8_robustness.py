"""How much does S3D8 + imatrix depend on luck? The worst case over k-means seeds and imatrix variants (issue 34).

A user's S3D8 file depends on two things that should not matter: the k-means seed (the converter's ``--seed``;
``llama-quantize`` always uses 0) and the last digits of the importance matrix, which differ between machines and
thread counts. This script re-encodes the main job's 30 ``ffn_down`` tensors (the setting of ``docs/main-job.md``:
SmolLM2-135M-Instruct, Q8_0 elsewhere) with an encoder, for every seed x imatrix variant, and measures KLD against
the f16 model with the main job's ``llama-perplexity`` command (24 x 512 held-out tokens). Imatrix variants:

  t2      the main job's imatrix (``llama-imatrix -t 2`` on the 64 x 512 training tokens)
  t1      the same command with ``-t 1`` (other summation order: the last digits differ)
  pert    t2 with every entry multiplied by 1 + 1e-6 or 1 - 1e-6 (a fixed random sign per entry; float32)
  FILE    any imatrix file (e.g. one computed on another machine)

Encoders (the numpy twins; ``iw1`` gives ``llama-quantize``'s bytes at seed 0): ``iw1``, the encoder of
gguf_s3d8.importance as it is (a candidate encoder is added to ``ENCODERS``).

``--layers`` re-encodes only those layers and keeps the others from ``llama-quantize --imatrix``'s file (iw1, seed
0, the main job's imatrix): that localises where an encoding's luck sits (docs/quality.md, "The lottery").

Needs the main job's cache (``bash ci/main.sh``) and ``build/host``. Run:

    python research/s3d8_robustness.py --encoder iw1 --seeds 0 1 2 3 4 --imatrices t2 t1 pert \\
        --json research/results/s3d8_robustness.jsonl
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from gguf_s3d8 import importance as iw
from gguf_s3d8 import series_gguf
from gguf_s3d8.fsio import atomic_path
from gguf_s3d8.imatrix import read_imatrix

# benchmarks/ is a folder of scripts, not a package: the script's own folder is sys.path[0] when it runs
from s3d8_fit_streams import MAIN_JOB, ROOT, kld  # type: ignore[import-not-found]

N_LAYERS = 30
NAMES = [f"blk.{layer}.ffn_down.weight" for layer in range(N_LAYERS)]
RELATIVE_PERTURBATION = 1e-6
PERTURBATION_SEED = 1234
#: the main job's llama-quantize --imatrix file: every layer not re-encoded keeps its tensors (Q8_0 elsewhere)
BASE_FILE = MAIN_JOB / "smollm2-135m-s3d8-im.gguf"

Encoder = Callable[[np.ndarray, np.ndarray, int, str], np.ndarray]


def _iw1(w: np.ndarray, u: np.ndarray, seed: int, name: str) -> np.ndarray:
    return iw.quantize_s3d8_importance(w, u, seed=seed, name=name)


ENCODERS: dict[str, Encoder] = {"iw1": _iw1}


def imatrix_variant(spec: str, bin_dir: Path) -> dict[str, np.ndarray]:
    """The ``ffn_down`` entries of an imatrix variant (see the module docstring), by tensor name."""
    base = MAIN_JOB / "imatrix.gguf"
    if spec in ("t2", "pert"):
        path = base
    elif spec == "t1":
        path = MAIN_JOB / "robustness" / "imatrix-t1.gguf"
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            print("llama-imatrix -t 1 on the training text (a few minutes)", file=sys.stderr, flush=True)
            with atomic_path(path) as tmp:
                subprocess.run([str(bin_dir / "llama-imatrix"), "-m", str(MAIN_JOB / "smollm2-135m-f16.gguf"),
                                "-f", str(MAIN_JOB / "train.txt"), "-c", "512", "--chunks", "64", "-t", "1",
                                "-o", str(tmp)], check=True, capture_output=True)
    else:
        path = Path(spec)
    if not path.exists():
        sys.exit(f"imatrix variant {spec!r}: {path} does not exist")
    im = read_imatrix(path)
    rng = np.random.default_rng(PERTURBATION_SEED)
    out: dict[str, np.ndarray] = {}
    for name in NAMES:
        entry = im.for_tensor(name, 1536)
        if entry is None:
            sys.exit(f"{path} has no entry for {name}")
        u = entry.reshape(-1).astype(np.float64)
        if spec == "pert":
            u = u * perturbation_factors(rng, u.shape)
        out[name] = u.astype(np.float32)
    return out


def perturbation_factors(rng: np.random.Generator, shape: tuple[int, ...], *, symmetric: bool = False) -> np.ndarray:
    """``1 + e`` or ``1 - e`` per entry (e = RELATIVE_PERTURBATION, float64), the sign drawn from ``rng``; with
    ``symmetric`` the upper triangle's signs mirrored into the lower one (a square matrix stays symmetric)."""
    signs = rng.choice([-1.0, 1.0], size=shape)
    if symmetric:
        signs = np.triu(signs) + np.triu(signs, 1).T
    return 1.0 + RELATIVE_PERTURBATION * signs


def _encode(job: tuple[str, np.ndarray, np.ndarray, int, str]) -> np.ndarray:
    encoder, w, u, seed, name = job
    return ENCODERS[encoder](w, u, seed, name)


def encode_all(encoder: str, importance: dict[str, np.ndarray], seed: int, jobs: int,
               names: list[str]) -> dict[str, np.ndarray]:
    gguf = series_gguf()
    src = {t.name: t for t in gguf.GGUFReader(MAIN_JOB / "smollm2-135m-f16.gguf").tensors}
    work = [(encoder, np.array(src[n].data, dtype=np.float32), importance[n], seed, n) for n in names]
    with ProcessPoolExecutor(jobs) as pool:
        return dict(zip(names, pool.map(_encode, work)))


def measure(containers: dict[str, np.ndarray], bin_dir: Path) -> float:
    """KLD of the main job's S3D8 file with its ffn_down tensors replaced by ``containers``."""
    gguf = series_gguf()
    with tempfile.TemporaryDirectory(dir=MAIN_JOB) as tmp:
        model = Path(tmp) / "model.gguf"
        shutil.copyfile(BASE_FILE, model)
        dst = gguf.GGUFReader(model, "r+")
        for t in dst.tensors:
            if t.name in containers:
                t.data.reshape(-1)[:] = containers[t.name].reshape(-1)
        dst.data.flush()
        del dst
        return kld(model, bin_dir)


def summary(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return (f"worst {max(values):.4f}  best {min(values):.4f}  mean {mean:.4f}  "
            f"spread {100 * (min(values) / mean - 1):+.1f} % / {100 * (max(values) / mean - 1):+.1f} %  (n = {len(values)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encoder", choices=sorted(ENCODERS), default="iw1")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--imatrices", nargs="+", default=["t2", "t1", "pert"], metavar="VARIANT",
                    help="t2, t1, pert or an imatrix file (default: t2 t1 pert)")
    ap.add_argument("--layers", type=int, nargs="+", choices=range(N_LAYERS), metavar="L",
                    help="re-encode only these layers (default: all 30)")
    ap.add_argument("--jobs", type=int, default=2, help="processes encoding matrices in parallel")
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build" / "host" / "bin")
    ap.add_argument("--json", type=Path, help="append one line per measurement to this file")
    args = ap.parse_args()
    if not BASE_FILE.exists():
        sys.exit(f"{BASE_FILE} is missing: run bash ci/main.sh first")
    names = [NAMES[layer] for layer in args.layers] if args.layers else NAMES
    layers = "all" if not args.layers else ",".join(map(str, args.layers))
    values: list[float] = []
    for spec in args.imatrices:
        importance = imatrix_variant(spec, args.bin_dir)
        for seed in args.seeds:
            value = measure(encode_all(args.encoder, importance, seed, args.jobs, names), args.bin_dir)
            values.append(value)
            print(f"{args.encoder} imatrix {spec} seed {seed} layers {layers}: KLD {value:.6f}", flush=True)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps({"encoder": args.encoder, "imatrix": spec, "seed": seed, "layers": layers,
                                        "kld": value}) + "\n")
    print(f"{args.encoder}: {summary(values)}")


if __name__ == "__main__":
    main()

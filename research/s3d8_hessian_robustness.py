"""S3D8 + imatrix with and without the last layer's X^T X, over imatrices that differ only in rounding (issue 34).

``research/s3d8_robustness.py`` showed that ``llama-quantize --imatrix``'s S3D8 (iw1) depends on the imatrix's
last digits through one matrix, the last layer's ``ffn_down``, and ``research/s3d8_last_layer.py`` that no local
measure can pick the good encoding there but GPTQ with the real X^T X moves far below all of them. This script
measures the product of that, with the C tools only, on the main job's setting (SmolLM2-135M-Instruct, the 30
``ffn_down`` in S3D8, Q8_0 elsewhere, KLD against f16 with the main job's ``llama-perplexity`` command):

  iw1       ``llama-quantize --imatrix IM``
  last      ``llama-quantize --imatrix IM --hessian X`` with X from ``llama-imatrix --save-xtx X --xtx-last-layer``
            (GPTQ for the last layer, iw1 elsewhere)

for the variants

  t2        the main job's imatrix and X^T X (``llama-imatrix -t 2``; the X^T X from the same pass)
  t1        both recomputed with ``-t 1`` (other summation order)
  pert      t2 with every ``in_sum2`` entry of the imatrix file times 1 + 1e-6 or 1 - 1e-6 (fixed random signs)
  pert-xtx  pert, and every X^T X entry perturbed the same way (symmetrically)

Needs the main job's cache (``bash ci/main.sh``: it makes ``xtx-last-layer.gguf`` too) and ``build/host``. Run:

    .venv/bin/python research/s3d8_hessian_robustness.py --json research/results/s3d8_hessian_robustness.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from gguf_s3d8 import series_gguf
from gguf_s3d8.fsio import atomic_write

# benchmarks/ is a folder of scripts, not a package: the script's own folder is sys.path[0] when it runs
from s3d8_fit_streams import MAIN_JOB, ROOT, kld  # type: ignore[import-not-found]
from s3d8_robustness import (  # type: ignore[import-not-found]
    NAMES,
    PERTURBATION_SEED,
    RELATIVE_PERTURBATION,
    perturbation_factors,
)

VARIANTS = ("t2", "t1", "pert", "pert-xtx")
ENCODINGS = ("iw1", "last")


def perturb_file(src: Path, dst: Path, suffix: str, seed: int, symmetric: bool) -> None:
    """Copy ``src`` to ``dst`` with every entry of the tensors named ``*suffix`` times 1 +- RELATIVE_PERTURBATION."""
    shutil.copyfile(src, dst)
    rng = np.random.default_rng(seed)
    reader = series_gguf().GGUFReader(dst, "r+")
    for t in reader.tensors:
        if t.name.endswith(suffix):
            a = t.data
            a[...] = (a.astype(np.float64) * perturbation_factors(rng, a.shape, symmetric=symmetric)).astype(np.float32)
    reader.data.flush()


def inputs(variant: str, work: Path, bin_dir: Path) -> tuple[Path, Path]:
    """(imatrix, X^T X) files of a variant."""
    im, xtx = MAIN_JOB / "imatrix.gguf", MAIN_JOB / "xtx-last-layer.gguf"
    if not xtx.exists():
        sys.exit(f"{xtx} is missing: run bash ci/main.sh (it writes the last layer's X^T X next to the imatrix)")
    if variant == "t2":
        return im, xtx
    if variant == "t1":
        im1, xtx1 = MAIN_JOB / "robustness" / "imatrix-t1-xtx.gguf", MAIN_JOB / "robustness" / "xtx-last-layer-t1.gguf"
        if not xtx1.exists():
            im1.parent.mkdir(exist_ok=True)
            print("llama-imatrix -t 1 --save-xtx --xtx-last-layer on the training text (a few minutes)", flush=True)
            subprocess.run([str(bin_dir / "llama-imatrix"), "-m", str(MAIN_JOB / "smollm2-135m-f16.gguf"),
                            "-f", str(MAIN_JOB / "train.txt"), "-c", "512", "--chunks", "64", "-t", "1",
                            "-o", str(im1), "--save-xtx", str(xtx1), "--xtx-last-layer"],
                           check=True, capture_output=True)
        return im1, xtx1
    pim = work / "imatrix-pert.gguf"
    perturb_file(im, pim, ".in_sum2", PERTURBATION_SEED, symmetric=False)
    if variant == "pert":
        return pim, xtx
    pxtx = work / "xtx-pert.gguf"
    # the X^T X file (format 2) stores each matrix's lower triangle once: a sign per stored entry keeps it symmetric
    perturb_file(xtx, pxtx, ".xtx", PERTURBATION_SEED + 1, symmetric=False)
    return pim, pxtx


def quantize(bin_dir: Path, out: Path, imatrix: Path, xtx: Path | None) -> None:
    overrides = [a for n in NAMES for a in ("--tensor-type", f"^{n.replace('.', '[.]')}$=s3d8")]
    subprocess.run([str(bin_dir / "llama-quantize"), "--imatrix", str(imatrix),
                    *(["--hessian", str(xtx)] if xtx else []), *overrides, str(MAIN_JOB / "smollm2-135m-f16.gguf"),
                    str(out), "Q8_0", "2"], check=True, capture_output=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--encodings", nargs="+", choices=ENCODINGS, default=list(ENCODINGS))
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build" / "host" / "bin")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=MAIN_JOB) as tmp:
        work = Path(tmp)
        for variant in args.variants:
            im, xtx = inputs(variant, work, args.bin_dir)
            for enc in args.encodings:
                if enc == "iw1" and variant == "pert-xtx":
                    continue  # iw1 reads no X^T X: the same file as pert
                out = work / f"{enc}-{variant}.gguf"
                quantize(args.bin_dir, out, im, xtx if enc == "last" else None)
                value = kld(out, args.bin_dir)
                out.unlink()
                rows.append({"encoding": enc, "variant": variant, "kld": value})
                print(f"{enc} {variant}: KLD {value:.6f}", flush=True)
    for enc in args.encodings:
        values = [r["kld"] for r in rows if r["encoding"] == enc]
        if values:
            print(f"{enc}: worst {max(values):.4f} best {min(values):.4f} over {len(values)} variants")
    if args.json:
        atomic_write(args.json, json.dumps({"rows": rows, "relative_perturbation": RELATIVE_PERTURBATION}, indent=1) + "\n")


if __name__ == "__main__":
    main()

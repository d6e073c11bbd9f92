"""The imatrix / X^T X variants of the S3D8 rows and what the report makes of them (issue 49, item 2).

Three variants that differ only in rounding (``docs/quality.md``, "The lottery, localised"):

  t2    ``llama-imatrix -t 2`` (the main job's command), with ``--save-xtx X --xtx-include ROLE`` in the same pass
  t1    the same pass with ``-t 1`` (another summation order)
  pert  t2's imatrix with every ``in_sum2`` and ``in_sum`` entry times ``1 + 1e-6`` or ``1 - 1e-6`` (a fixed random
        sign per entry, seed PERTURBATION_SEED), and t2's X^T X with every stored entry perturbed the same way (seed
        PERTURBATION_SEED + 1; the file keeps each matrix's lower triangle, so the perturbed matrix stays symmetric)

Each S3D8 row is reported as its worst variant (the largest KLD), with every variant's value shown; files with the
same bytes (e.g. t1's and t2's) are measured once and the report says which variants they were.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np

RELATIVE_PERTURBATION = 1e-6
#: research/s3d8_robustness.py's seed (the imatrix); the X^T X's is this + 1 (research/s3d8_hessian_robustness.py)
PERTURBATION_SEED = 1234
#: the imatrix file's tensors whose entries ``pert`` moves (the counts and the derived statistics stay)
PERTURBED_SUFFIXES = (".in_sum2", ".in_sum")
#: llama-imatrix's thread count of each computed variant
VARIANT_THREADS = {"t2": 2, "t1": 1}


def perturbed(values: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``values`` (float32) times ``1 + e`` or ``1 - e`` per entry (e = RELATIVE_PERTURBATION, in float64, the sign
    drawn from ``rng``), rounded back to float32: every nonzero entry moves (1e-6 is about 8 float32 ulps)."""
    signs = rng.choice([-1.0, 1.0], size=values.shape)
    return (values.astype(np.float64) * (1.0 + RELATIVE_PERTURBATION * signs)).astype(np.float32)


def perturb_imatrix(src: Path, dst: Path, seed: int = PERTURBATION_SEED) -> int:
    """Copy the GGUF imatrix ``src`` to ``dst`` with every entry of its ``*.in_sum2`` and ``*.in_sum`` tensors
    perturbed (in the file's tensor order, one generator); the number of entries moved."""
    from gguf_s3d8 import series_gguf

    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.copyfile(src, tmp)
    rng = np.random.default_rng(seed)
    reader = series_gguf().GGUFReader(tmp, "r+")
    if not any(t.name.endswith(PERTURBED_SUFFIXES) for t in reader.tensors):
        raise ValueError(f"{src}: no {' / '.join(PERTURBED_SUFFIXES)} tensors (not a GGUF imatrix?)")
    n = 0
    for t in reader.tensors:
        if t.name.endswith(PERTURBED_SUFFIXES):
            t.data[...] = perturbed(np.asarray(t.data), rng)
            n += int(t.data.size)
    reader.data.flush()
    del reader
    tmp.replace(dst)
    return n


def perturb_xtx(src: Path, dst: Path, seed: int = PERTURBATION_SEED + 1) -> int:
    """``src`` (an X^T X file) written to ``dst`` with every stored entry of every matrix perturbed
    (``gguf_s3d8.xtx.perturbed``: the file keeps each matrix's packed lower triangle, so it stays exactly
    symmetric); the number of entries moved."""
    from gguf_s3d8 import xtx

    f = xtx.read_xtx(src)
    xtx.write_xtx(dst, xtx.perturbed(f, np.random.default_rng(seed), RELATIVE_PERTURBATION))
    return sum(int(m.size) for m in f.matrices.values())


def last_block(names: list[str]) -> int:
    """The highest block index among ``blk.N.*`` tensor names."""
    blocks = [int(n.split(".")[1]) for n in names if n.startswith("blk.")]
    if not blocks:
        raise ValueError("no blk.N tensors")
    return max(blocks)


def xtx_subset(src: Path, dst: Path, weights: list[str]) -> list[str]:
    """``dst``: ``src`` (an X^T X file) with only the matrices of ``weights`` (``gguf_s3d8.xtx.subset``); the
    weights it holds (an error when one of ``weights`` is not in ``src``)."""
    from gguf_s3d8 import xtx

    f = xtx.read_xtx(src)
    missing = sorted(set(weights) - set(f.weights))
    if missing:
        raise ValueError(f"{src} has no X^T X for {', '.join(missing)}")
    sub = xtx.subset(f, lambda w: w in weights)
    xtx.write_xtx(dst, sub)
    return list(sub.weights)


# ------------------------------------------------------------------------------------------------- the report

def identical_groups(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Rows whose files hold the same tensors (``tensors_sha256``; the file's ``sha256`` where that is not known),
    each group of two or more in row order."""
    by_sha: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        key = r.get("tensors_sha256") or r.get("sha256")
        if key and not r.get("error"):
            by_sha.setdefault(key, []).append(r)
    return [g for g in by_sha.values() if len(g) > 1]


def s3d8_groups(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The S3D8 rows by their ``group`` (an S3D8_ROWS key), in row order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("group"):
            out.setdefault(r["group"], []).append(r)
    return out


def worst_case(group: list[dict[str, Any]]) -> dict[str, Any]:
    """One S3D8 row's summary over its variants: ``worst`` (the row with the largest KLD), ``best``, the KLD of
    each variant (NaN where it failed) and ``complete`` (every variant measured: only then is ``worst`` the worst
    case; an incomplete group still names the worst of those measured)."""
    kld = {r.get("variant") or "-": r["kld"] for r in group}
    ok = [r for r in group if not r.get("error") and not math.isnan(r["kld"])]
    worst = max(ok, key=lambda r: r["kld"]) if ok else None
    best = min(ok, key=lambda r: r["kld"]) if ok else None
    return {"worst": worst, "best": best, "kld": kld, "complete": len(ok) == len(group) and bool(group),
            "n": len(group)}

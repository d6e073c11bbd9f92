"""Could S3D8 without an imatrix estimate the importance of ``ffn_down``'s input columns from the weights alone?

The input of ``ffn_down`` is ``silu(gate . x) * (up . x)`` with ``x`` the RMS-normalised hidden state times the
norm weight ``g``. If ``x`` were isotropic (unit variance, uncorrelated), the mean squared activation of
column j would be ``E[silu(a)^2] * ||up_j * g||^2`` with ``a ~ N(0, ||gate_j * g||^2)``. This script compares
that estimate (and two cruder ones) with the real importance matrix of the main job (``llama-imatrix`` on
64 x 512 training tokens), per layer, by the correlation of the logarithms and by rank correlation.

    python research/s3d8_data_free_importance.py     # needs the main job's cache (bash ci/main.sh)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

from gguf_s3d8 import series_gguf
from gguf_s3d8.imatrix import read_imatrix

ROOT = Path(__file__).resolve().parent.parent
MAIN_JOB = ROOT / ".cache" / "main-job"
F64 = npt.NDArray[np.float64]

_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(64)


def mean_silu_squared(sigma: F64) -> F64:
    """``E[silu(a)^2]`` for ``a ~ N(0, sigma^2)`` (Gauss-Hermite quadrature, 64 nodes)."""
    a = sigma[:, None] * _GH_X[None, :]
    return np.asarray(((a / (1.0 + np.exp(-a))) ** 2) @ _GH_W / np.sqrt(2.0 * np.pi))


def estimates(g: F64, gate: F64, up: F64) -> dict[str, F64]:
    """The data-free estimates of the importance of each of the ``gate.shape[0]`` columns."""
    sg2 = ((gate * g) ** 2).sum(axis=1)
    su2 = ((up * g) ** 2).sum(axis=1)
    return {"silu(gate) x up": mean_silu_squared(np.sqrt(sg2)) * su2, "gate^2 x up^2": sg2 * su2, "up^2": su2}


def ranks(v: F64) -> F64:
    return np.argsort(np.argsort(v)).astype(np.float64)


def main() -> None:
    f16, imatrix = MAIN_JOB / "smollm2-135m-f16.gguf", MAIN_JOB / "imatrix.gguf"
    if not (f16.exists() and imatrix.exists()):
        sys.exit(f"{f16} or {imatrix} is missing: run bash ci/main.sh first")
    tensors = {t.name: t for t in series_gguf().GGUFReader(f16).tensors}
    im = read_imatrix(imatrix)

    def get(name: str) -> F64:
        return np.array(tensors[name].data, dtype=np.float64)

    layers = sorted({int(n.split(".")[1]) for n in tensors if n.endswith("ffn_down.weight")})
    table: dict[str, list[tuple[float, float]]] = {}
    for layer in layers:
        real = im.for_tensor(f"blk.{layer}.ffn_down.weight", get(f"blk.{layer}.ffn_gate.weight").shape[0])
        if real is None:
            sys.exit(f"the imatrix has no entry for blk.{layer}.ffn_down.weight")
        r = real[0].astype(np.float64)
        est = estimates(get(f"blk.{layer}.ffn_norm.weight"), get(f"blk.{layer}.ffn_gate.weight"),
                        get(f"blk.{layer}.ffn_up.weight"))
        for name, e in est.items():
            table.setdefault(name, []).append((float(np.corrcoef(np.log(r + 1e-12), np.log(e + 1e-12))[0, 1]),
                                               float(np.corrcoef(ranks(r), ranks(e))[0, 1])))
    print(f"{'estimate':<18} {'log corr: mean':>14} {'min':>7} {'max':>7}   {'rank corr: mean':>15} {'min':>7} {'max':>7}")
    for name, rows in table.items():
        a = np.array(rows)
        print(f"{name:<18} {a[:, 0].mean():14.3f} {a[:, 0].min():7.3f} {a[:, 0].max():7.3f}   "
              f"{a[:, 1].mean():15.3f} {a[:, 1].min():7.3f} {a[:, 1].max():7.3f}")


if __name__ == "__main__":
    main()

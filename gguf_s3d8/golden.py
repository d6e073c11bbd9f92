"""Golden vectors for the C implementation: ``python -m gguf_s3d8.golden --out tests/data/s3d8_golden``.

Writes small fixed cases as raw little-endian binaries plus ``manifest.json`` and a plain ``manifest.txt``
(one case per line, for a C reader without a JSON library). Generation is deterministic: re-running
reproduces the committed files byte for byte (a test checks this).

All matrices use k = 2048 so that every case shares one activation file. The smallest eligible shapes
make stored fp32 weights large, so only the special-values matrix stores its weights; the padding cases
(n % 3 = 1, 2) and the all-zero matrix are exact grid points whose weights are *the dequantised container*
(``w_source = dequantized-container``, ``file_w = -``): quantising ``dequantize(container)`` with the
case's codebook must give the container back byte for byte.

Files (all little endian):
  *.w.f32           fp32 weights, n rows x k columns, row major
  *.codebook.u8     32 x 3 uint8, C[l][d] at 3l + d
  *.container.u8    the S3D8 slice, n * 43k/128 bytes
  x.f32             fp32 activations, 17 rows x k
  x.xq.i8           int8 quantised activations, 17 x k
  x.xs.bf16         bf16 bit patterns (uint16) of the per-row activation scales, 17
  *.y.f32           fp32 reference outputs, 17 x n (row t = token t)
A case with m < 17 uses the first m rows of x / xq / xs / y (rows are independent by construction).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .activations import quantize_activations
from .assignment import centroid_distances
from .codebook import fit_codebook
from .constants import N_CENTROIDS, VECTOR_DIM
from .container import read_container, write_container
from .eligibility import n_triples
from .errors import S3D8InputError
from .packing import pack_bytes
from .quantize import dequantize_s3d8, quantize_s3d8_with_codebook
from .reference import reference_matmul

K = 2048
N_SPECIAL = 48        # n % 3 == 0, smallest eligible n at k = 2048
N_PAD1 = 448          # n % 3 == 1
N_PAD2 = 248          # n % 3 == 2
X_ROWS = 17
M_VALUES = (1, 2, 3, 7, 8, 17)
F32 = npt.NDArray[np.float32]
FLT_MAX = np.finfo(np.float32).max

# Crafted codebook indices with a purpose (see special_codebook()).
TIE_EXACT = (2, 5)       # (12,100,100) and (10,100,100): |w'| = (11,100,100) is exactly equidistant
TIE_ROUNDED = (7, 9)     # (12,50,60) and (10,50,60): |w'| = (11 - 2^-20, 50, 50) ties only after fp32 rounding
FULL = 31                # (127,127,127)


def _f32(v: float) -> np.float32:
    return np.float32(v)


def special_codebook() -> npt.NDArray[np.uint8]:
    """Distinct centroids in 0..127 with two crafted tie pairs, (127,127,127), and no (0,0,0)."""
    rng = np.random.default_rng(20261101)
    fixed = {TIE_EXACT[0]: (12, 100, 100), TIE_EXACT[1]: (10, 100, 100),
             TIE_ROUNDED[0]: (12, 50, 60), TIE_ROUNDED[1]: (10, 50, 60), FULL: (127, 127, 127),
             0: (1, 0, 2)}
    probes = np.array([[11, 100, 100], [11, 50, 50]], dtype=np.float64)
    cb = np.zeros((N_CENTROIDS, VECTOR_DIM), dtype=np.int64)
    used = set(fixed.values())
    for i in range(N_CENTROIDS):
        if i in fixed:
            cb[i] = fixed[i]
            continue
        while True:
            c = np.minimum(np.abs(rng.laplace(scale=30.0, size=3)), 127).astype(np.int64)
            far = np.sqrt(((probes - c) ** 2).sum(axis=1)).min() > 14
            if far and tuple(c) not in used:
                break
        used.add(tuple(c))
        cb[i] = c
    return cb.astype(np.uint8)


def special_weights() -> F32:
    """48 x 2048 matrix of special values, one purpose per row triple (see the row comments)."""
    rng = np.random.default_rng(20261102)
    w = rng.laplace(scale=0.02, size=(N_SPECIAL, K)).astype(np.float32)
    w *= np.exp(rng.uniform(-7, 7, size=(N_SPECIAL, 1))).astype(np.float32)  # rows 18.. span many scales
    # rows 0-2: alpha = 1 exactly (row max 127), crafted ties at columns 1..3
    w[0:3] = rng.uniform(-126.9, 126.9, size=(3, K)).astype(np.float32)
    w[0:3, 0] = [127.0, -127.0, 127.0]
    w[0:3, 1] = [11.0, -100.0, 100.0]                                      # exact tie
    w[0:3, 2] = [-(11.0 - 2.0**-20), 50.0, -50.0]                          # tie after fp32 rounding
    w[0:3, 3] = [-11.0, -100.0, -100.0]                                     # exact tie, all negative
    w[0:3, 4:40:5] = -0.0
    # rows 3-5: ordinary weights with +0 and -0 sprinkled in
    w[3, ::7] = -0.0
    w[4, ::11] = 0.0
    w[5, 5::13] = -0.0
    # row 6: all zeros inside the matrix (rows 7, 8 ordinary)
    w[6] = 0.0
    # rows 9-11: huge, tiny, and subnormal rows (max ~1e-40: alpha rounds to 0, the row becomes zeros)
    w[9] = rng.laplace(scale=1e29, size=K).astype(np.float32)
    w[10] = rng.laplace(scale=1e-31, size=K).astype(np.float32)
    w[11] = rng.uniform(-1e-40, 1e-40, size=K).astype(np.float32)
    # row 12: max 1.4e-38 -> alpha is a bf16 subnormal that rounded down, |w'| exceeds 127
    w[12] = rng.uniform(-1.4e-38, 1.4e-38, size=K).astype(np.float32)
    w[12, 7] = _f32(1.4e-38)
    # row 13: one +/-1e30 pair among tiny values; -1e-45 etc. normalise to -0 (sign must come out 0)
    w[13] = rng.uniform(-1e-30, 1e-30, size=K).astype(np.float32)
    w[13, 100], w[13, 200] = _f32(1e30), _f32(-1e30)
    w[13, 300:310] = -np.float32(1e-45)
    # rows 14-16: bf16 rounding of the scale: halfway up to even, halfway down to even, plain round-up
    for row, m in ((14, 127.0 * (1 + 3 * 2.0**-8)), (15, 127.0 * (1 + 2.0**-8)), (16, 127.0 * (1 + 3 * 2.0**-9))):
        w[row] = rng.uniform(-m, m, size=K).astype(np.float32)
        w[row, 11] = -_f32(m)
    # row 17: -FLT_MAX among values around 1e37
    w[17] = rng.laplace(scale=1e37, size=K).astype(np.float32)
    w[17, 42] = -FLT_MAX
    return w


def activations() -> F32:
    """17 x 2048 activations: ordinary, zero and extreme rows (the first rows matter for small m)."""
    rng = np.random.default_rng(20261103)
    x = rng.laplace(scale=1.0, size=(X_ROWS, K)).astype(np.float32)
    x[1] = 0.0                                                   # all-zero token
    x[2, 10], x[2, 20] = _f32(1e30), _f32(-1e30)                 # two spikes dominate the scale
    x[3] *= _f32(1e-30)                                          # tiny token
    x[4] = rng.integers(-127, 127, size=K).astype(np.float32) + _f32(0.5)  # s = 1 and exact .5 ties
    x[4, 0] = 127.0
    a5 = _f32(127.0 * 2.0**-127)                                 # s = 2^-127, a bf16 subnormal, 1/s finite
    x[5] = rng.uniform(-1, 1, size=K).astype(np.float32) * a5
    x[5, 1] = a5
    x[6] *= _f32(1e28)                                           # huge, yet acc * s stays finite
    x[6, 3] = _f32(-1.0e31)
    a7 = _f32(127.0 * 2.0**-127 * 1.005)                         # s rounds down to 2^-127: x*inv > 127.5, clamps
    x[7] = rng.uniform(-1, 1, size=K).astype(np.float32) * a7
    x[7, 5], x[7, 6] = a7, -a7
    x[8, ::5] = -0.0                                             # signed zeros
    for row, scale in zip(range(9, 16), (1e-3, 1e-1, 10.0, 1e3, 1e5, 3e-20, 7e20)):
        x[row] *= _f32(scale)
    x[14] = _f32(0.5)                                            # constant row
    x[16] = 0.0
    x[16, 1000] = _f32(-2.5)                                     # one nonzero element
    return x


def pad_codebook() -> npt.NDArray[np.uint8]:
    """Distinct centroids for the grid cases, with zero trailing components available for padding."""
    rng = np.random.default_rng(20261104)
    fixed = [(127, 127, 127), (127, 0, 0), (127, 127, 0), (0, 0, 0), (5, 0, 0), (40, 0, 0), (3, 9, 0), (60, 20, 0)]
    used = set(fixed)
    rows = list(fixed)
    while len(rows) < N_CENTROIDS:
        v = rng.integers(0, 128, size=3)
        c = (int(v[0]), int(v[1]), int(v[2]))
        if c not in used:
            used.add(c)
            rows.append(c)
    return np.array(rows, dtype=np.uint8)


def grid_container(n: int, codebook: npt.NDArray[np.uint8], seed: int) -> npt.NDArray[np.uint8]:
    """A canonical container whose dequantised matrix quantises back to it exactly.

    Every real row reaches 127 alpha (column 0 uses (127,127,127), or a padding-compatible full centroid
    in the last triple), signs are 0 where the component is 0, padding rows use centroids whose padding
    components are 0, and scales are normal bf16 numbers.
    """
    rng = np.random.default_rng(seed)
    p_total = n_triples(n)
    q = rng.integers(0, N_CENTROIDS, size=(p_total, K)).astype(np.uint8)
    q[:, 0] = 0
    real_rows = n - VECTOR_DIM * (p_total - 1)
    if real_rows < VECTOR_DIM:
        allowed = np.flatnonzero((codebook[:, real_rows:] == 0).all(axis=1))
        q[-1] = rng.choice(allowed, size=K).astype(np.uint8)
        q[-1, 0] = 1 if real_rows == 1 else 2          # (127,0,0) or (127,127,0)
    comps = codebook[q]                                  # (P, k, 3)
    s = (rng.random(size=comps.shape) < 0.5) & (comps > 0)
    s[-1, :, real_rows:] = False
    packed = pack_bytes(q, s[..., 0], s[..., 1], s[..., 2])
    exps = rng.integers(100, 150, size=n)               # 2^-27 .. 2^22
    mant = rng.integers(0, 128, size=n)
    scales = ((exps << 7) | mant).astype(np.uint16)
    return write_container(K, n, codebook, scales, packed)


@dataclass(frozen=True)
class WeightCase:
    name: str
    n: int
    file_w: str            # "-" when w is the dequantised container
    file_codebook: str
    file_container: str
    file_y: str
    description: str


def _write(out: Path, fname: str, arr: npt.NDArray[np.generic], files: dict[str, dict[str, object]],
           dtype_name: str) -> None:
    data = np.ascontiguousarray(arr)
    (out / fname).write_bytes(data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes())
    files[fname] = {"dtype": dtype_name, "shape": list(data.shape), "bytes": int(data.nbytes)}


def _check_crafted(w: F32, codebook: npt.NDArray[np.uint8]) -> None:
    """Make sure the crafted tie columns do what they are meant to (guards edits of this script)."""
    a = np.abs(w[0:3, 1:4].T)                         # alpha = 1 for rows 0..2
    d = centroid_distances(a, codebook)
    for col, (lo, hi) in enumerate((TIE_EXACT, TIE_ROUNDED, TIE_EXACT)):
        best = np.flatnonzero(d[col] == d[col].min()).tolist()
        assert best == [lo, hi], (col, best, d[col].min())
    exact = ((codebook.astype(np.float64) - a[1].astype(np.float64)) ** 2).sum(axis=1)
    assert int(exact.argmin()) == TIE_ROUNDED[1], "the rounded tie must differ from exact arithmetic"


def generate(out: Path) -> None:
    """Write every golden file into ``out`` (created if needed)."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, object]] = {}
    x = activations()
    xq, xs = quantize_activations(x)
    _write(out, "x.f32", x, files, "float32")
    _write(out, "x.xq.i8", xq, files, "int8")
    _write(out, "x.xs.bf16", xs, files, "bf16 (uint16 bit patterns)")

    w_special = special_weights()
    cb_special = special_codebook()
    _check_crafted(w_special, cb_special)
    _write(out, "special.w.f32", w_special, files, "float32")
    _write(out, "special.codebook.u8", cb_special, files, "uint8")
    cb_fitted = fit_codebook(w_special, centroid_rule="round", seed=0)
    _write(out, "fitted.codebook.u8", cb_fitted, files, "uint8")
    cb_pad = pad_codebook()
    _write(out, "pad.codebook.u8", cb_pad, files, "uint8")

    containers = {
        "special": quantize_s3d8_with_codebook(w_special, cb_special, name="special"),
        "fitted": quantize_s3d8_with_codebook(w_special, cb_fitted, name="fitted"),
        "zeros": quantize_s3d8_with_codebook(np.zeros((N_SPECIAL, K), np.float32), cb_special, name="zeros"),
        "pad1": grid_container(N_PAD1, cb_pad, seed=20261105),
        "pad2": grid_container(N_PAD2, cb_pad, seed=20261106),
    }
    codebook_file = {"special": "special.codebook.u8", "fitted": "fitted.codebook.u8",
                     "zeros": "special.codebook.u8", "pad1": "pad.codebook.u8", "pad2": "pad.codebook.u8"}
    codebook_of = {"special": cb_special, "fitted": cb_fitted, "zeros": cb_special, "pad1": cb_pad, "pad2": cb_pad}
    descriptions = {
        "special": "n%3=0; crafted codebook; exact and fp32-rounding ties, +/-0, zero row, 1e30/1e-30/subnormal "
                   "rows, bf16 scale rounding (halfway up/down, round-up), -FLT_MAX",
        "fitted": "same weights as 'special', codebook from fit_codebook(rule=round, seed=0)",
        "zeros": "entire all-zero matrix (w = dequantised container = zeros), crafted codebook",
        "pad1": "n%3=1 (two padding rows in the last triple); exact grid weights = dequantised container",
        "pad2": "n%3=2 (one padding row in the last triple); exact grid weights = dequantised container",
    }
    cases: list[WeightCase] = []
    for wname, container in containers.items():
        n = container.shape[0]
        read_container(container, name=wname)  # everything written must validate
        if wname in ("zeros", "pad1", "pad2"):
            again = quantize_s3d8_with_codebook(dequantize_s3d8(container), codebook_of[wname], name=wname)
            assert np.array_equal(again, container), f"{wname}: grid container does not round-trip"
        _write(out, f"{wname}.container.u8", container, files, "uint8 (S3D8 container)")
        _write(out, f"{wname}.y.f32", reference_matmul(container, x, name=wname), files, "float32")
        file_w = "special.w.f32" if wname in ("special", "fitted") else "-"
        cases.append(WeightCase(wname, n, file_w, codebook_file[wname], f"{wname}.container.u8",
                                f"{wname}.y.f32", descriptions[wname]))

    bad = np.zeros((6, 256), dtype=np.float32)
    bad[0, 3], bad[2, 7], bad[5, 255] = np.nan, np.inf, -np.inf
    try:
        quantize_s3d8_with_codebook(bad, cb_special, name="nonfinite")
        raise AssertionError("non-finite weights were accepted")
    except S3D8InputError:
        pass
    _write(out, "nonfinite.w.f32", bad, files, "float32")

    _write_manifests(out, cases, files)


def _write_manifests(out: Path, cases: list[WeightCase], files: dict[str, dict[str, object]]) -> None:
    rows: list[dict[str, object]] = []
    lines = [
        "# S3D8 golden vectors (generated by: python -m gguf_s3d8.golden --out tests/data/s3d8_golden)",
        "# columns: name n k m file_w file_codebook file_container file_x file_y file_xq file_xs",
        "# raw little-endian files; x/xq/xs/y hold 17 rows, a case uses the first m rows.",
        "# file_w '-': w is the dequantised container (quantising it must reproduce the container exactly).",
        "# file_container '-': quantising file_w (shape n x k) must be rejected (non-finite input).",
    ]
    for c in cases:
        for m in M_VALUES:
            name = f"{c.name}_m{m}"
            rows.append({
                "name": name, "weights": c.name, "expect": "ok", "n": c.n, "k": K, "m": m,
                "file_w": c.file_w, "w_source": "file" if c.file_w != "-" else "dequantized-container",
                "file_codebook": c.file_codebook, "file_container": c.file_container,
                "file_x": "x.f32", "file_y": c.file_y, "file_xq": "x.xq.i8", "file_xs": "x.xs.bf16",
                "rows_in_activation_files": X_ROWS, "description": c.description,
            })
            lines.append(f"{name} {c.n} {K} {m} {c.file_w} {c.file_codebook} {c.file_container} "
                         f"x.f32 {c.file_y} x.xq.i8 x.xs.bf16")
    rows.append({
        "name": "nonfinite", "weights": "nonfinite", "expect": "reject", "n": 6, "k": 256, "m": 0,
        "file_w": "nonfinite.w.f32", "w_source": "file", "file_codebook": "special.codebook.u8",
        "file_container": "-", "file_x": "-", "file_y": "-", "file_xq": "-", "file_xs": "-",
        "description": "must be rejected: NaN, +inf and -inf weights (checked before shape eligibility)",
    })
    lines.append("nonfinite 6 256 0 nonfinite.w.f32 special.codebook.u8 - - - - -")
    manifest = {
        "format": "S3D8 golden vectors", "version": 1, "byte_order": "little",
        "generator": "python -m gguf_s3d8.golden --out tests/data/s3d8_golden",
        "notes": __doc__.strip().splitlines()[4:],
        "files": files, "cases": rows,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    (out / "manifest.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gguf_s3d8.golden", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory (e.g. tests/data/s3d8_golden)")
    args = ap.parse_args(argv)
    generate(args.out)
    total = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    print(f"wrote {len(list(args.out.iterdir()))} files, {total} bytes, to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GPTQ for S3D8 in C: ``llama-imatrix --save-xtx`` writes each weight's input X^T X, ``llama-quantize --hessian``
runs GPTQ with it (``ggml_s3d8_quantize_gptq``), the C twin of ``qat.gptq_s3d8.gptq_s3d8_matrix``
(docs/hessian-format.md).

On real SmolLM2 tensors with a real X^T X file: the file's layout (one matrix per distinct input, symmetric, its
diagonal the imatrix), the C containers against the torch GPTQ given the same Hessian (byte-identical, or the
difference bounded: the fraction of values that differ and the layer-output error tr(dW H dW^T) of both), and the
bad inputs (another model, the wrong column count, NaN, a matrix that is not positive semi-definite or not
symmetric, a file that is no X^T X file), each a clear error naming the tensor, with no output left behind; a
Hessian that needs more damping is logged.

The binaries: ``$S3D8_GPTQ_BIN_DIR``, else ``$S3D8_BIN_DIR``, else ``build/host/bin``; the module is skipped (with
the reason) when they lack ``--save-xtx`` / ``--hessian``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gguf

import gguf_s3d8
from gguf_s3d8 import xtx as xtx_file
from gguf_s3d8.imatrix import read_imatrix
from qat.gptq_s3d8 import gptq_s3d8_matrix

REPO = Path(__file__).resolve().parents[2]
#: the ffn_down layers compared with the torch GPTQ (layer 11 reads SmolLM2's super-activation columns)
LAYERS = (0, 11)
TOKENS = 8 * 256
#: the bound on a C / torch difference (they differ only where torch's BLAS rounds a sum differently)
MAX_DIFFERING_VALUES = 2e-3
MAX_OUTPUT_ERROR_CHANGE = 2e-3


def bin_dir() -> Path:
    for var in ("S3D8_GPTQ_BIN_DIR", "S3D8_BIN_DIR"):
        if os.environ.get(var):
            return Path(os.environ[var])
    return REPO / "build" / "host" / "bin"


def run(cmd: list[str], ok: bool = True, threads: str = "2") -> subprocess.CompletedProcess[str]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": threads})
    if ok:
        assert r.returncode == 0, f"{cmd[0]} exited {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}"
    return r


@pytest.fixture(scope="module")
def tools() -> dict[str, str]:
    d = bin_dir()
    exes = {name: d / name for name in ("llama-imatrix", "llama-quantize")}
    for exe in exes.values():
        if not exe.is_file():
            pytest.skip(f"{exe} not found: build llama.cpp (`bash ci/build.sh host`) or set S3D8_GPTQ_BIN_DIR")
    help_im = run([str(exes["llama-imatrix"]), "--help"], ok=False)
    help_q = run([str(exes["llama-quantize"]), "--help"], ok=False)
    if "--save-xtx" not in help_im.stdout + help_im.stderr or "--hessian" not in help_q.stdout + help_q.stderr:
        pytest.skip(f"the binaries in {d} have no llama-imatrix --save-xtx / llama-quantize --hessian (a tree without "
                    "the GPTQ patches); set S3D8_GPTQ_BIN_DIR to a build that has them")
    return {k: str(v) for k, v in exes.items()}


@pytest.fixture(scope="module")
def smollm2(tools: dict[str, str], smollm2_f16_and_text: tuple[Path, Path],
            tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SmolLM2 f16, an imatrix and the X^T X file of layers 0 and 11 (``--xtx-include``) and of the last layer, 29
    (``--xtx-last-layer``), from one llama-imatrix run on training text."""
    d = tmp_path_factory.mktemp("gptq_c")
    f16, text = smollm2_f16_and_text
    im, xtx = d / "imatrix.gguf", d / "xtx.gguf"
    r = run([tools["llama-imatrix"], "-m", str(f16), "-f", str(text), "-c", "256", "--chunks", "8", "-t", "2",
             "-o", str(im), "--save-xtx", str(xtx), "--xtx-include", r"^blk\.(0|11)\.",
             "--xtx-last-layer"])
    assert "X^T X matrices" in r.stdout + r.stderr and "--xtx-last-layer" in r.stdout + r.stderr
    return {"dir": d, "f16": f16, "imatrix": im, "xtx": xtx, "text": text}


# ---------------------------------------------------------------------------------------------------
# the file (docs/hessian-format.md)


def read_xtx(path: Path) -> dict[str, Any]:
    """weights -> (matrix name, N, fingerprint), matrices -> float32 (k, k) (read by ``gguf_s3d8.xtx``)."""
    xf = xtx_file.read_xtx(path)
    return {"weights": {w: (m, xf.tokens[m], fp) for w, (m, fp) in xf.weights.items()},
            "matrices": {m: xtx_file.unpack(a, xf.dims[m]) for m, a in xf.matrices.items()}, "tokens": dict(xf.tokens)}


def hessian(xtx: dict[str, Any], weight: str) -> torch.Tensor:
    """H = (X^T X * (2 / N)) as float32 from float64, as llama-quantize and qat.gptq.HessianCollector form it."""
    m, n, _ = xtx["weights"][weight]
    return (torch.from_numpy(xtx["matrices"][m]).to(torch.float64) * (2.0 / n)).to(torch.float32)


def f16_matrix(f16: Path, name: str) -> np.ndarray:
    t = next(t for t in gguf.GGUFReader(f16).tensors if t.name == name)
    return np.asarray(t.data).astype(np.float32).reshape(int(t.shape[1]), int(t.shape[0]))


def fnv_fingerprint(raw: np.ndarray, type_name: str, ne: list[int]) -> str:
    """The fingerprint of docs/hessian-format.md (FNV-1a over little-endian 64-bit words, then the tail bytes)."""
    b = raw.tobytes()
    h, mask = 0xCBF29CE484222325, (1 << 64) - 1
    n8 = len(b) // 8 * 8
    for w in np.frombuffer(b[:n8], dtype="<u8").tolist():
        h = ((h ^ w) * 0x100000001B3) & mask
    for c in b[n8:]:
        h = ((h ^ c) * 0x100000001B3) & mask
    return f"{type_name}:{'x'.join(str(x) for x in ne)}:{h:016x}"


def test_xtx_file_one_matrix_per_input(smollm2: dict[str, Path]) -> None:
    xtx = read_xtx(smollm2["xtx"])
    w = xtx["weights"]
    for layer in (0, 11, 29):  # --xtx-include's and --xtx-last-layer's (the union)
        b = f"blk.{layer}."
        # q, k and v share the attention input, gate and up the FFN input; attn_output and ffn_down have their own
        assert w[b + "attn_q.weight"][0] == w[b + "attn_k.weight"][0] == w[b + "attn_v.weight"][0]
        assert w[b + "ffn_gate.weight"][0] == w[b + "ffn_up.weight"][0]
        mats = {w[b + n + ".weight"][0] for n in ("attn_q", "ffn_gate", "attn_output", "ffn_down")}
        assert len(mats) == 4
    assert len(xtx["matrices"]) == 12 and len(w) == 21
    assert set(xtx["tokens"].values()) == {TOKENS}
    for m in xtx["matrices"].values():
        assert np.array_equal(m, m.T) and (np.diagonal(m) >= 0).all()
    # the diagonal is the imatrix's statistic (sum of squares per input column; float sums in another order)
    im = read_imatrix(smollm2["imatrix"])
    for name in ("blk.11.ffn_down.weight", "blk.0.attn_k.weight", "blk.0.ffn_up.weight"):
        m, n, _ = w[name]
        k = xtx["matrices"][m].shape[0]
        rows = im.for_tensor(name, k)
        assert rows is not None
        np.testing.assert_allclose(np.diagonal(xtx["matrices"][m]) / n, rows[0], rtol=1e-4, atol=1e-12)
    # the fingerprint of the weights llama-imatrix read
    t = next(t for t in gguf.GGUFReader(smollm2["f16"]).tensors if t.name == "blk.0.ffn_down.weight")
    want = fnv_fingerprint(np.asarray(t.data), "f16", [int(x) for x in t.shape] + [1, 1])
    assert w["blk.0.ffn_down.weight"][2] == want


# ---------------------------------------------------------------------------------------------------
# C GPTQ against the torch GPTQ


def quantize(tools: dict[str, str], smollm2: dict[str, Path], out: Path, *, hessian: Path | None,
             imatrix: bool = True, layers: tuple[int, ...] = LAYERS, ok: bool = True, threads: str = "2",
             ) -> subprocess.CompletedProcess[str]:
    overrides = [a for i in layers for a in ("--tensor-type", f"^blk[.]{i}[.]ffn_down[.]weight$=s3d8")]
    cmd = [tools["llama-quantize"], *(["--imatrix", str(smollm2["imatrix"])] if imatrix else []),
           *(["--hessian", str(hessian)] if hessian else []), *overrides, str(smollm2["f16"]), str(out), "Q8_0", threads]
    return run(cmd, ok=ok, threads=threads)


@pytest.fixture(scope="module")
def iw1(tools: dict[str, str], smollm2: dict[str, Path]) -> Path:
    """llama-quantize --imatrix without --hessian: the iw1 start."""
    out = smollm2["dir"] / "iw1.gguf"
    quantize(tools, smollm2, out, hessian=None)
    return out


def containers(path: Path, names: list[str]) -> dict[str, np.ndarray]:
    ts = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    return {n: ts[n] for n in names}


def compare(w: np.ndarray, h: torch.Tensor, c: np.ndarray, py: np.ndarray) -> dict[str, float]:
    """The C / torch difference: share of values that differ, and tr(dW H dW^T) of each against the weights."""
    qc, qp = gguf_s3d8.dequantize_s3d8(c), gguf_s3d8.dequantize_s3d8(py)
    hd = h.numpy().astype(np.float64)

    def err(d: np.ndarray) -> float:
        d = d.astype(np.float64)
        return float(np.einsum("ij,jk,ik->", d, hd, d))

    e_c, e_p = err(w - qc), err(w - qp)
    return {"differing": float((qc != qp).mean()), "err_c": e_c, "err_py": e_p, "change": e_c / e_p - 1.0,
            "cross": err(qc - qp) / e_p}


@pytest.mark.parametrize("imatrix", [True, False], ids=["imatrix-start", "diag-start"])
def test_c_gptq_matches_the_torch_gptq(tools: dict[str, str], smollm2: dict[str, Path], iw1: Path,
                                      imatrix: bool) -> None:
    """llama-quantize --hessian against qat.gptq_s3d8.gptq_s3d8_matrix with the same H and the same start (iw1 with
    the imatrix: llama-quantize --imatrix's container as the torch side's ``start``; without: iw1 with diag(H) on
    both sides, numpy's iw1 being byte-identical to C's)."""
    d = smollm2["dir"]
    names = [f"blk.{i}.ffn_down.weight" for i in LAYERS]
    out = d / f"gptq-{imatrix}.gguf"
    r = quantize(tools, smollm2, out, hessian=smollm2["xtx"], imatrix=imatrix)
    log = r.stdout + r.stderr
    assert log.count("(GPTQ, X^T X of 2048 tokens") == len(LAYERS), log[-2000:]
    got = containers(out, names)
    starts = containers(iw1, names) if imatrix else {}
    xtx = read_xtx(smollm2["xtx"])
    for name in names:
        w, h = f16_matrix(smollm2["f16"], name), hessian(xtx, name)
        py = gptq_s3d8_matrix(w, h, name=name, start=starts.get(name)).container
        if np.array_equal(py, got[name]):
            continue
        s = compare(w, h, got[name], py)
        assert s["differing"] <= MAX_DIFFERING_VALUES and abs(s["change"]) <= MAX_OUTPUT_ERROR_CHANGE, f"{name}: {s}"
    # the result does not depend on the thread count
    one = d / f"gptq-{imatrix}-1.gguf"
    quantize(tools, smollm2, one, hessian=smollm2["xtx"], imatrix=imatrix, threads="1")
    for name, c in containers(one, names).items():
        assert np.array_equal(c, got[name]), name


def output_error(w: np.ndarray, h: np.ndarray, c: np.ndarray) -> float:
    """tr(dW H dW^T) of a container against the weights."""
    d = (w - gguf_s3d8.dequantize_s3d8(c)).astype(np.float64)
    return float(np.einsum("ij,jk,ik->", d, h, d))


def test_gptq_lowers_the_layer_output_error(tools: dict[str, str], smollm2: dict[str, Path], iw1: Path) -> None:
    """tr(dW H dW^T) of GPTQ is far below iw1's (the start) on both layers."""
    d = smollm2["dir"]
    names = [f"blk.{i}.ffn_down.weight" for i in LAYERS]
    gptq_file = d / "gptq-True.gguf"
    if not gptq_file.exists():
        quantize(tools, smollm2, gptq_file, hessian=smollm2["xtx"])
    gptq, start = containers(gptq_file, names), containers(iw1, names)
    xtx = read_xtx(smollm2["xtx"])
    for name in names:
        w, h = f16_matrix(smollm2["f16"], name), hessian(xtx, name).numpy().astype(np.float64)
        assert output_error(w, h, gptq[name]) < 0.8 * output_error(w, h, start[name]), name


# ---------------------------------------------------------------------------------------------------
# bad input


def write_xtx(path: Path, mats: dict[str, np.ndarray], weights: dict[str, tuple[str, str]],
              tokens: int = TOKENS) -> None:
    """An X^T X file (docs/hessian-format.md, written by ``gguf_s3d8.xtx``): ``mats`` maps a matrix name to its
    square (only its lower triangle is stored), ``weights`` a weight to (its matrix, its fingerprint)."""
    xtx_file.write_xtx(path, xtx_file.XtxFile(
        matrices={m: xtx_file.pack_lower(a) for m, a in mats.items()}, dims={m: a.shape[0] for m, a in mats.items()},
        tokens={m: tokens for m in mats}, weights=dict(weights), datasets=["test"]))


def write_xtx_v1(path: Path, mats: dict[str, np.ndarray], weights: dict[str, tuple[str, str]]) -> None:
    """The same content in format version 1 (full squares, no xtx.dims), which llama-quantize must refuse."""
    w = gguf.GGUFWriter(path, arch="xtx")
    w.add_string("general.type", "xtx")
    w.add_uint32("xtx.version", 1)
    w.add_array("xtx.datasets", ["test"])
    names = list(mats)
    arr, vt = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType
    w.add_key_value("xtx.matrices", names, arr, sub_type=vt.STRING)
    w.add_key_value("xtx.tokens", [TOKENS] * len(names), arr, sub_type=vt.UINT64)
    w.add_key_value("xtx.weights", list(weights), arr, sub_type=vt.STRING)
    w.add_key_value("xtx.weight_matrix", [names.index(m) for m, _ in weights.values()], arr, sub_type=vt.UINT32)
    w.add_key_value("xtx.weight_fingerprints", [fp for _, fp in weights.values()], arr, sub_type=vt.STRING)
    for name, m in mats.items():
        w.add_tensor(name, np.ascontiguousarray(m, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


NAME = "blk.0.ffn_down.weight"


def _bad(smollm2: dict[str, Path], case: str) -> tuple[dict[str, np.ndarray], dict[str, tuple[str, str]]]:
    xtx = read_xtx(smollm2["xtx"])
    m, _, fp = xtx["weights"][NAME]
    a = xtx["matrices"][m].copy()
    if case == "wrong-columns":
        a = a[:1024, :1024]
    elif case == "nan":
        a[3, 700] = a[700, 3] = np.nan
    elif case == "inf-diagonal":
        a[5, 5] = np.inf
    elif case == "negative-diagonal":
        a[9, 9] = -1.0
    elif case == "not-psd":
        a[2, 3] = a[3, 2] = 3.0 * np.sqrt(a[2, 2] * a[3, 3])
    elif case == "other-model":
        fp = fp[:-1] + ("0" if fp[-1] != "0" else "1")
    elif case == "other-names":
        return {"x.xtx": a}, {"model.layers.0.mlp.down_proj.weight": ("x.xtx", "")}
    return {m: a}, {NAME: (m, fp)}


@pytest.mark.parametrize("case, message", [
    ("wrong-columns", "but the tensor has 1536 columns"),
    ("nan", "is not finite"),
    ("inf-diagonal", "not finite"),
    ("negative-diagonal", "not positive semi-definite"),
    ("not-psd", "not positive semi-definite"),
    ("other-model", "computed on other weights"),
    ("other-names", "none of its 1 weights is a tensor of this model"),
])
def test_bad_hessian_is_a_clear_error(tools: dict[str, str], smollm2: dict[str, Path], tmp_path: Path,
                                      case: str, message: str) -> None:
    bad = tmp_path / f"{case}.gguf"
    write_xtx(bad, *_bad(smollm2, case))
    out = tmp_path / "q.gguf"
    r = quantize(tools, smollm2, out, hessian=bad, layers=(0,), ok=False)
    log = r.stdout + r.stderr
    assert r.returncode != 0, log[-2000:]
    assert message in log, log[-2000:]
    if case != "other-names":
        assert NAME in log, log[-2000:]
    assert not out.exists()


def test_xtx_options_need_save_xtx(tools: dict[str, str], smollm2: dict[str, Path], tmp_path: Path) -> None:
    """--xtx-last-layer / --xtx-include without --save-xtx would collect nothing: refused before the model loads."""
    (tmp_path / "t.txt").write_text("some calibration text " * 64)
    for opt in (["--xtx-last-layer"], ["--xtx-include", "ffn_down"]):
        r = run([tools["llama-imatrix"], "-m", str(smollm2["f16"]), "-f", str(tmp_path / "t.txt"),
                 "-o", str(tmp_path / "im.gguf"), *opt], ok=False)
        assert r.returncode != 0 and "which is not given" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
        assert not (tmp_path / "im.gguf").exists()


def test_not_an_xtx_file(tools: dict[str, str], smollm2: dict[str, Path], tmp_path: Path) -> None:
    """The imatrix file (a GGUF, but general.type "imatrix") and a text file are refused before anything is written."""
    out = tmp_path / "q.gguf"
    r = quantize(tools, smollm2, out, hessian=smollm2["imatrix"], layers=(0,), ok=False)
    assert r.returncode != 0 and "not an X^T X file" in r.stdout + r.stderr and not out.exists()
    txt = tmp_path / "x.txt"
    txt.write_text("hello")
    r = quantize(tools, smollm2, out, hessian=txt, layers=(0,), ok=False)
    assert r.returncode != 0 and "cannot read it as a GGUF file" in r.stdout + r.stderr and not out.exists()


def test_damping_is_raised_and_logged(tools: dict[str, str], smollm2: dict[str, Path], tmp_path: Path) -> None:
    """An indefinite matrix that passes the 2 x 2 checks: GPTQ raises the damping until the factorization succeeds
    (qat.gptq's rule) and says so, naming the tensor; the torch GPTQ ends at the same damping."""
    xtx = read_xtx(smollm2["xtx"])
    m, n, fp = xtx["weights"][NAME]
    a = xtx["matrices"][m].copy()
    # three columns i, j, l with correlations +0.9 (i, j), +0.9 (j, l), -0.9 (i, l) and none with the others:
    # (1, -1, 1) in their scaled coordinates has the eigenvalue -0.8 (every |H_ij| <= sqrt(H_ii H_jj) holds)
    dg = np.diagonal(a).astype(np.float64)
    i, j, l = np.argsort(np.abs(dg - 0.2 * dg.mean()))[:3]
    for x in (i, j, l):
        a[x, :] = 0.0
        a[:, x] = 0.0
        a[x, x] = dg[x]
    for (x, y, c) in ((i, j, 0.9), (j, l, 0.9), (i, l, -0.9)):
        a[x, y] = a[y, x] = c * np.sqrt(dg[x] * dg[y])
    bad = tmp_path / "indefinite.gguf"
    write_xtx(bad, {m: a}, {NAME: (m, fp)}, tokens=n)
    out = tmp_path / "q.gguf"
    r = quantize(tools, smollm2, out, hessian=bad, layers=(0,))
    log = r.stdout + r.stderr
    assert NAME in log and "failed Cholesky factorization" in log, log[-2000:]
    damp = float(log.split("damping ")[1].split(" x mean")[0])
    assert damp > 0.05
    from qat.gptq import inverse_hessian_factor

    h = (torch.from_numpy(a).to(torch.float64) * (2.0 / n)).to(torch.float32)
    _, d_py, failures = inverse_hessian_factor(h)
    assert failures > 0 and abs(d_py - damp) < 0.005
    assert out.exists()


# ---------------------------------------------------------------------------------------------------
# a model too large for one pass: --xtx-layers, several --hessian files; the format version; a full disk


def imatrix_pass(tools: dict[str, str], smollm2: dict[str, Path], out: Path, *opts: str,
                 ok: bool = True) -> subprocess.CompletedProcess[str]:
    """llama-imatrix with the fixture's text and settings, its X^T X into ``out``."""
    return run([tools["llama-imatrix"], "-m", str(smollm2["f16"]), "-f", str(smollm2["text"]), "-c", "256",
                "--chunks", "8", "-t", "2", "-o", str(out.with_suffix(".imatrix.gguf")), "--save-xtx", str(out),
                *opts], ok=ok)


@pytest.fixture(scope="module")
def two_passes(tools: dict[str, str], smollm2: dict[str, Path]) -> tuple[Path, Path]:
    """The fixture's blocks (0, 11 and the last, 29) collected in two passes: ``--xtx-layers 0-0`` and
    ``--xtx-layers 11-11 --xtx-last-layer``."""
    a, b = smollm2["dir"] / "pass-a.gguf", smollm2["dir"] / "pass-b.gguf"
    imatrix_pass(tools, smollm2, a, "--xtx-layers", "0-0")
    imatrix_pass(tools, smollm2, b, "--xtx-layers", "11-11", "--xtx-last-layer")
    return a, b


def test_layer_passes_hold_the_one_pass_matrices(smollm2: dict[str, Path], two_passes: tuple[Path, Path]) -> None:
    """Each pass holds exactly its blocks' weights, and each matrix equals the one-pass file's bit for bit (the
    same forward pass and the same products: collecting fewer matrices changes none of them)."""
    one = xtx_file.read_xtx(smollm2["xtx"])
    a, b = (xtx_file.read_xtx(p) for p in two_passes)
    assert {w.split(".")[1] for w in a.weights} == {"0"} and {w.split(".")[1] for w in b.weights} == {"11", "29"}
    assert set(a.weights) | set(b.weights) == set(one.weights) and not set(a.weights) & set(b.weights)
    for part in (a, b):
        for w, (m, fp) in part.weights.items():
            m1, fp1 = one.weights[w]
            assert fp == fp1 and part.tokens[m] == one.tokens[m1] == TOKENS
            assert np.array_equal(part.matrices[m], one.matrices[m1]), w


def test_several_hessian_files_give_the_one_file_result(tools: dict[str, str], smollm2: dict[str, Path],
                                                        two_passes: tuple[Path, Path], tmp_path: Path) -> None:
    """llama-quantize --hessian A --hessian B writes the same bytes as --hessian with the one-pass file; a weight
    in two of the files is an error naming both."""
    layers = (0, 11, 29)
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    quantize(tools, smollm2, one, hessian=smollm2["xtx"], layers=layers)
    a, b = two_passes
    cmd = [tools["llama-quantize"], "--imatrix", str(smollm2["imatrix"]), "--hessian", str(a), "--hessian", str(b),
           *[x for i in layers for x in ("--tensor-type", f"^blk[.]{i}[.]ffn_down[.]weight$=s3d8")],
           str(smollm2["f16"]), str(two), "Q8_0", "2"]
    r = run(cmd)
    assert "GPTQ (--hessian) quantized 3 tensor(s)" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
    assert containers(one, [f"blk.{i}.ffn_down.weight" for i in layers]).keys() == {
        f"blk.{i}.ffn_down.weight" for i in layers}
    for name, c in containers(one, [f"blk.{i}.ffn_down.weight" for i in layers]).items():
        assert np.array_equal(c, containers(two, [name])[name]), name
    dup = tmp_path / "dup.gguf"
    cmd[cmd.index(str(b))] = str(smollm2["xtx"])
    cmd[-3] = str(dup)
    r = run(cmd, ok=False)
    log = r.stdout + r.stderr
    assert r.returncode != 0 and "has an X^T X in both" in log and str(a) in log, log[-2000:]
    assert not dup.exists()


def test_old_format_version_is_refused(tools: dict[str, str], smollm2: dict[str, Path], tmp_path: Path) -> None:
    """A version-1 file (full squares) is refused by llama-quantize and by gguf_s3d8.xtx, both naming the version."""
    xtx = read_xtx(smollm2["xtx"])
    m, _, fp = xtx["weights"][NAME]
    old = tmp_path / "v1.gguf"
    write_xtx_v1(old, {m: xtx["matrices"][m]}, {NAME: (m, fp)})
    out = tmp_path / "q.gguf"
    r = quantize(tools, smollm2, out, hessian=old, layers=(0,), ok=False)
    log = r.stdout + r.stderr
    assert r.returncode != 0 and "X^T X format version 1" in log and str(old) in log, log[-2000:]
    assert not out.exists()
    with pytest.raises(xtx_file.XtxFormatError, match="format version 1"):
        xtx_file.read_xtx(old)


def test_a_full_disk_leaves_no_xtx_file(tools: dict[str, str], smollm2: dict[str, Path], tmp_path: Path) -> None:
    """A write that fails half-way (a file size limit of 8 MiB, as a full disk would: write() fails with EFBIG
    once SIGXFSZ is ignored) is an error naming the file, and neither the file nor its .tmp is left."""
    out = tmp_path / "xtx.gguf"
    cmd = [tools["llama-imatrix"], "-m", str(smollm2["f16"]), "-f", str(smollm2["text"]), "-c", "256",
           "--chunks", "1", "-t", "2", "-o", str(tmp_path / "im.gguf"), "--save-xtx", str(out),
           "--xtx-include", "ffn_down"]  # 30 matrices of 1536 x 1536: 135 MiB
    script = "trap '' XFSZ; ulimit -f 8192; exec " + " ".join(f"'{c}'" for c in cmd)
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    log = r.stdout + r.stderr
    assert r.returncode != 0, log[-2000:]
    assert f"failed to write {out}" in log and "File too large" in log, log[-2000:]
    assert not out.exists() and not Path(str(out) + ".tmp").exists()


@pytest.mark.parametrize("value", ["3", "5-2", "-1-4", "2-x"])
def test_bad_xtx_layers_is_refused(tools: dict[str, str], smollm2: dict[str, Path], tmp_path: Path,
                                   value: str) -> None:
    r = imatrix_pass(tools, smollm2, tmp_path / "x.gguf", "--xtx-layers", value, ok=False)
    assert r.returncode != 0 and "--xtx-layers expects FIRST-LAST" in r.stdout + r.stderr, (r.stdout + r.stderr)[-2000:]
    assert not (tmp_path / "x.gguf").exists()


def dry_run_types(tools: dict[str, str], smollm2: dict[str, Path], *opts: str) -> dict[str, str]:
    """The type llama-quantize --dry-run gives each ffn_down of the S3D8 file type."""
    r = run([tools["llama-quantize"], "--dry-run", *opts, str(smollm2["f16"]), "S3D8"])
    types = {}
    for line in (r.stdout + r.stderr).splitlines():  # "[  8/ 272] blk.0.ffn_down.weight - [...], ... -> 0.28 MiB (s3d8)"
        m = re.search(r"\]\s+(blk\.\d+\.ffn_down\.weight)\s.*\((\w+)\)\s*$", line)
        if m:
            types[m.group(1)] = m.group(2)
    assert len(types) == 30, (r.stdout + r.stderr)[-3000:]
    return types


def test_s3d8_file_type_gives_the_last_ffn_down_iq4_xs_without_its_hessian(tools: dict[str, str],
                                                                         smollm2: dict[str, Path]) -> None:
    """The S3D8 file type: every ffn_down S3D8 but the last block's, IQ4_XS (with or without an imatrix); with an
    X^T X for it (--hessian: GPTQ), S3D8 too."""
    last = "blk.29.ffn_down.weight"
    for opts in ((), ("--imatrix", str(smollm2["imatrix"]))):
        types = dry_run_types(tools, smollm2, *opts)
        assert types[last] == "iq4_xs", types
        assert {t for n, t in types.items() if n != last} == {"s3d8"}, types
    types = dry_run_types(tools, smollm2, "--imatrix", str(smollm2["imatrix"]), "--hessian", str(smollm2["xtx"]))
    assert set(types.values()) == {"s3d8"}, types

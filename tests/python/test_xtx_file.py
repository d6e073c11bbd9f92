"""gguf_s3d8.xtx, the Python reader and writer of the X^T X file (format version 2, docs/hessian-format.md):
packing, a write/read round trip, the subset and the perturbation the robustness studies use, and the refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gguf_s3d8  # noqa: F401  (the series' gguf-py)
import gguf
from gguf_s3d8 import xtx


def _file(datasets: list[str]) -> xtx.XtxFile:
    rng = np.random.default_rng(0)
    mats, dims = {}, {}
    for name, k in (("blk.0.attn_q.weight.xtx", 5), ("blk.0.ffn_down.weight.xtx", 7)):
        x = rng.standard_normal((11, k)).astype(np.float32)
        mats[name], dims[name] = xtx.pack_lower(x.T @ x), k
    weights = {"blk.0.attn_q.weight": ("blk.0.attn_q.weight.xtx", "f16:5x5x1x1:0123456789abcdef"),
               "blk.0.attn_k.weight": ("blk.0.attn_q.weight.xtx", ""),
               "blk.0.ffn_down.weight": ("blk.0.ffn_down.weight.xtx", "")}
    return xtx.XtxFile(matrices=mats, dims=dims, tokens={m: 11 for m in mats}, weights=weights,
                       datasets=datasets, model="m.gguf")


def test_packed_layout_is_the_lower_triangle_row_by_row() -> None:
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    a = a + a.T
    p = xtx.pack_lower(a)
    assert xtx.packed_size(4) == 10 and p.tolist() == [a[0, 0], a[1, 0], a[1, 1], a[2, 0], a[2, 1], a[2, 2],
                                                       a[3, 0], a[3, 1], a[3, 2], a[3, 3]]
    assert np.array_equal(xtx.unpack(p, 4), a)
    with pytest.raises(ValueError, match="not the packed lower triangle of a 5 x 5"):
        xtx.unpack(p, 5)


@pytest.mark.parametrize("datasets", [["train.txt"], []])
def test_write_read_round_trip(tmp_path: Path, datasets: list[str]) -> None:
    f = _file(datasets)
    path = tmp_path / "x.gguf"
    xtx.write_xtx(path, f)
    g = xtx.read_xtx(path)
    assert g.weights == f.weights and g.dims == f.dims and g.tokens == f.tokens and g.datasets == datasets
    for name in f.matrices:
        assert np.array_equal(g.matrices[name], f.matrices[name])
    full = g.matrix("blk.0.ffn_down.weight")
    assert full.shape == (7, 7) and np.array_equal(full, full.T)
    h = xtx.hessian(g, "blk.0.ffn_down.weight")
    assert np.array_equal(h, (full.astype(np.float64) * (2.0 / 11)).astype(np.float32))


def test_subset_keeps_only_the_matrices_of_its_weights() -> None:
    s = xtx.subset(_file([]), lambda w: "ffn_down" in w)
    assert list(s.weights) == ["blk.0.ffn_down.weight"] and list(s.matrices) == ["blk.0.ffn_down.weight.xtx"]
    with pytest.raises(ValueError, match="no weight is kept"):
        xtx.subset(_file([]), lambda w: False)


def test_perturbation_is_relative_and_keeps_the_matrix_symmetric() -> None:
    f = _file([])
    p = xtx.perturbed(f, np.random.default_rng(1), rel=1e-6)
    for m, a in f.matrices.items():
        rel = np.abs(p.matrices[m].astype(np.float64) / a.astype(np.float64) - 1.0)
        # 1e-6 up to the float32 rounding of the result (2^-24 relative)
        assert (np.abs(rel - 1e-6) <= 6e-8 + 1e-12).all() and (p.matrices[m] != a).mean() > 0.5
        full = xtx.unpack(p.matrices[m], f.dims[m])
        assert np.array_equal(full, full.T)


def test_version_1_and_other_files_are_refused(tmp_path: Path) -> None:
    v1 = tmp_path / "v1.gguf"
    w = gguf.GGUFWriter(v1, "xtx")
    w.add_string("general.type", "xtx")
    w.add_uint32("xtx.version", 1)
    w.add_tensor("a.xtx", np.eye(3, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(xtx.XtxFormatError, match="format version 1, this reader reads version 2"):
        xtx.read_xtx(v1)
    txt = tmp_path / "x.txt"
    txt.write_text("hello")
    with pytest.raises(xtx.XtxFormatError, match="cannot read it as a GGUF file"):
        xtx.read_xtx(txt)

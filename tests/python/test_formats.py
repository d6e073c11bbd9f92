"""Fake-quantised baseline formats (qat/formats.py): hand-checked values, bit accounting, and the S3D8
simulation matching the codec's real containers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qat.formats import (IntFormat, LloydMaxFormat, S3D8Format, StudentTFormat, WeightFormat, _SortedData,
                         _s3d8_simulate_pieces, crd_t_table, expected_block_max_t, int_range,
                         lloyd_max_table, s3d8_simulate, sqnr_db)
from qat.numerics import bf16_rne

LOG2_6 = math.log2(6)


def test_helpers_hand_checked() -> None:
    assert int_range(6) == (-3, 2) and int_range(8) == (-4, 3) and int_range(4) == (-2, 1) and int_range(5) == (-2, 2)
    x = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0], dtype=torch.float32)
    assert bf16_rne(x).tolist() == [1.0, 1 + 2**-6, -1.0, 3.0]  # ties to even
    assert sqnr_db(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == pytest.approx(10 * math.log10(2))
    assert sqnr_db(torch.ones(3), torch.ones(3)) == math.inf


# ---------------------------------------------------------------------------------------------------
# INT


def test_int6_known_blocks() -> None:
    fmt = IntFormat(levels=6, block=4)
    assert fmt.divisor == 2
    w = torch.tensor([[1.0, -0.5, 0.25, 0.74, -1.0, 0.3, 0.75, 0.25],
                      [0.0, 0.0, 0.0, 0.0, 3.0, 1.0, 2.25, -3.0]])
    # row 0 block 0: scale bf16(1/2) = 0.5, w/s = 2, -1, 0.5, 1.48 -> 2, -1, 0 (half to even), 1
    # row 0 block 1: scale 0.5, w/s = -2, 0.6, 1.5, 0.5 -> -2, 1, 2 (half to even), 0
    # row 1 block 0: all zero -> scale 0 -> zeros;  block 1: scale 1.5, w/s = 2, 0.667, 1.5, -2 -> 2, 1, 2, -2
    want = torch.tensor([[1.0, -0.5, 0.0, 0.5, -1.0, 0.5, 1.0, 0.0],
                         [0.0, 0.0, 0.0, 0.0, 3.0, 1.5, 3.0, -3.0]])
    assert torch.equal(fmt.quantise(w), want)


def test_int_ragged_block_and_bf16_scale() -> None:
    fmt = IntFormat(levels=6, block=4)
    w = torch.tensor([[0.1, 0.2, 0.3, 0.4, 10.0, -5.0]])  # last block (10, -5) has its own scale 5
    q = fmt.quantise(w)
    assert q[0, 4:].tolist() == [10.0, -5.0]
    s = float(bf16_rne(torch.tensor(0.4 / 2)))  # 0.2 is not a bf16 number: the scale is 0.2001953125
    assert s == 0.2001953125
    # w/s = 0.4995, 0.999, 1.4985, 1.998: the rounded-up scale moves 0.3 below the 1.5 tie -> 0, 1, 1, 2
    assert q[0, :4].tolist() == [0.0, s, s, 2 * s]


def test_int6_uses_five_levels() -> None:
    """With the absmax mapped to +-2 the extra level -3 of K=6 is never reached (as in the reference)."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    fmt = IntFormat(6, 128)
    q = fmt.quantise(w).reshape(64, 2, 128)
    scale = bf16_rne(w.reshape(64, 2, 128).abs().amax(-1, keepdim=True) / 2)
    codes = torch.round(q / scale)
    assert set(codes.unique().tolist()) == {-2.0, -1.0, 0.0, 1.0, 2.0}


def test_int_bits_per_param() -> None:
    assert IntFormat(6, 128).bits_per_param((576, 1536)) == pytest.approx(LOG2_6 + 16 / 128)  # 2.70996
    assert IntFormat(6, 128).bits_per_param((576, 576)) == pytest.approx(LOG2_6 + 16 * 5 / 576)  # ragged: 5 blocks
    assert IntFormat(16, 32).bits_per_param((4096, 4096)) == pytest.approx(4.5)
    assert IntFormat(8, 64).bits_per_param((10, 128)) == pytest.approx(3.25)


# ---------------------------------------------------------------------------------------------------
# Student-t


@pytest.mark.parametrize(("levels", "df", "block"), [(6, 10.0, 128), (5, 4.5, 64), (8, 3.0, 128), (6, 100.0, 32)])
def test_crd_t_table_matches_scipy(levels: int, df: float, block: int) -> None:
    """The table against scipy.stats.t, computed here independently of the implementation's trapezoid CDF: the cube
    root of the t(df) density, (1 + x^2/df)^(-(df+1)/6), is the t density with cdof = (df-2)/3 degrees of freedom and
    scale sqrt(df/cdof); truncated to [-E, E] and divided by E, its p-quantile is sign(2p-1) * T^-1(1/2 + |2p-1| *
    (T(E) - 1/2)) / E. The implementation's stated accuracy is ~1e-9."""
    from scipy import stats
    e = expected_block_max_t(df, block)
    cdof = (df - 2.0) / 3.0
    t = stats.t(cdof, scale=math.sqrt(df / cdof))
    p = np.arange(levels) / (levels - 1)
    want = np.sign(2 * p - 1) * t.ppf(0.5 + np.abs(2 * p - 1) * (t.cdf(e) - 0.5)) / e
    assert crd_t_table(levels, df, block).tolist() == pytest.approx(want.tolist(), abs=1e-8)


@pytest.mark.parametrize(("df", "block"), [(10.0, 128), (4.5, 64), (3.0, 128), (100.0, 128), (6.0, 32)])
def test_expected_block_max_t_approximates_the_exact_expectation(df: float, block: int) -> None:
    """expected_block_max_t is the reference baseline's asymptotic closed form (OWF crd_block_t), an approximation:
    against the exact E[max |x|] of ``block`` t(df) samples, the integral of 1 - F(x)^block over [0, inf) with F the
    CDF of |x| (scipy), it is within 5 % (measured: 0.96-1.00 on these cases; the form is the baseline's, so it is
    not improved here)."""
    from scipy import stats
    from scipy import integrate
    exact = integrate.quad(lambda x: 1.0 - (2.0 * stats.t.cdf(x, df) - 1.0) ** block, 0, np.inf, limit=200)[0]
    assert expected_block_max_t(df, block) == pytest.approx(exact, rel=0.05)


def test_crd_t_table_shape() -> None:
    t5 = crd_t_table(5, 4.5, 64)
    assert t5[2] == 0 and t5[0] == -1 and t5[-1] == 1 and torch.equal(t5, -t5.flip(0))
    # heavier tails (small df) put the inner levels closer to zero
    assert crd_t_table(6, 3.0, 128)[3] < crd_t_table(6, 100.0, 128)[3]


def test_sorted_error_equals_direct() -> None:
    g = torch.Generator().manual_seed(1)
    u = torch.rand(5000, generator=g) * 2 - 1
    wt = torch.rand(5000, generator=g)
    table = torch.tensor([-0.9, -0.3, -0.05, 0.2, 0.5, 0.95], dtype=torch.float64)
    idx = torch.bucketize(u.double(), (table[1:] + table[:-1]) / 2)
    direct = float((wt.double() * (u.double() - table[idx]) ** 2).sum())
    assert _SortedData(u, wt).sq_error(table) == pytest.approx(direct, rel=1e-10)


def test_student_t_recovers_its_own_grid() -> None:
    """Data made of the levels of one (df, s=1) table is reproduced exactly and that pair is chosen."""
    fmt = StudentTFormat(levels=6, block=8)
    df = fmt.dfs[4]
    table = crd_t_table(6, df, 8).to(torch.float32)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 6, (16, 64), generator=g)
    idx[:, ::8] = 5  # every block of 8 contains the level +1 (its absmax)
    w = table[idx] * 0.25
    got_df, got_s, _ = fmt.fit(w)
    assert got_df == df and got_s == pytest.approx(1.0)
    assert torch.equal(fmt.quantise(w), w)


def test_student_t_search_space_and_bits() -> None:
    fmt = StudentTFormat()
    assert len(fmt.dfs) == 12 and fmt.dfs[0] == pytest.approx(3) and fmt.dfs[-1] == pytest.approx(100)
    assert len(fmt.multipliers) == 9 and fmt.multipliers[0] == pytest.approx(0.25) and fmt.multipliers[4] == pytest.approx(1)
    assert np.allclose(np.diff(np.log(fmt.dfs)), np.log(100 / 3) / 11)
    assert fmt.bits_per_param((576, 1536)) == pytest.approx(LOG2_6 + 16 / 128 + 6 * 16 / (576 * 1536))


def test_student_t_beats_int_on_heavy_tails() -> None:
    w = torch.distributions.StudentT(4.0).sample((256, 512)) * 0.02
    assert sqnr_db(w, StudentTFormat().quantise(w)) > sqnr_db(w, IntFormat(6, 128).quantise(w))


# ---------------------------------------------------------------------------------------------------
# Lloyd-Max


def test_lloyd_max_hand_checked() -> None:
    # init [0, 10] -> boundary 5 -> {0,0,1,1} | {10} -> means 0.5, 10 -> boundary 5.25: unchanged, stop
    assert lloyd_max_table(torch.tensor([0.0, 0.0, 1.0, 1.0, 10.0]), 2).tolist() == [0.5, 10.0]
    assert lloyd_max_table(torch.tensor([0.0, 1.0, 2.0, 9.0, 10.0]), 2).tolist() == [1.0, 9.5]
    # an empty cluster keeps its value: three levels, two far clusters
    t = lloyd_max_table(torch.tensor([0.0, 0.1, 0.2, 10.0]), 3)
    assert t.tolist() == pytest.approx([0.1, 5.0, 10.0])


def test_lloyd_max_format_reproduces_six_atoms() -> None:
    levels = torch.tensor([-1.0, -0.5, -0.125, 0.125, 0.5, 1.0])
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 6, (32, 100), generator=g)
    idx[:, 0] = 5  # row absmax 1 -> scale is the row factor below
    w = levels[idx] * torch.tensor([2.0 ** -(i % 5) for i in range(32)])[:, None]
    fmt = LloydMaxFormat(levels=6)
    assert fmt.fit(w).tolist() == pytest.approx(levels.tolist())
    assert torch.equal(fmt.quantise(w), w)


def test_lloyd_max_bits() -> None:
    assert LloydMaxFormat(6).bits_per_param((576, 1536)) == pytest.approx(LOG2_6 + 16 / 1536 + 96 / (576 * 1536))
    assert LloydMaxFormat(6).bits_per_param((49152, 576)) == pytest.approx(2.61274, abs=1e-5)


# ---------------------------------------------------------------------------------------------------
# S3D8 (through the codec)


@pytest.mark.parametrize("shape", [(192, 1024), (248, 2048)])  # n % 3 == 0 and == 2, both eligible
@pytest.mark.parametrize("rule", ["round", "trunc"])
def test_s3d8_pieces_equal_container(shape: tuple[int, int], rule: str) -> None:
    """The simulation used for ineligible shapes gives exactly the container's values where both exist."""
    import gguf_s3d8

    w = np.random.default_rng(4).standard_t(5, shape).astype(np.float32) * 0.02
    via_container = gguf_s3d8.dequantize_s3d8(gguf_s3d8.quantize_s3d8(w, centroid_rule=rule, seed=1))
    np.testing.assert_array_equal(_s3d8_simulate_pieces(w, centroid_rule=rule, seed=1), via_container)
    np.testing.assert_array_equal(s3d8_simulate(w, centroid_rule=rule, seed=1), via_container)
    got = S3D8Format(centroid_rule=rule, seed=1).quantise(torch.from_numpy(w))
    np.testing.assert_array_equal(got.numpy(), via_container)


def test_s3d8_ineligible_shape_is_simulated() -> None:
    import gguf_s3d8

    w = np.random.default_rng(5).standard_normal((192, 576)).astype(np.float32)
    assert gguf_s3d8.s3d8_ineligibility(192, 576) is not None
    q = S3D8Format("round").quantise(torch.from_numpy(w)).numpy()
    assert q.shape == w.shape and sqnr_db(torch.from_numpy(w), torch.from_numpy(q)) > 8
    # every value is +-alpha_i * a codebook integer, with the sign of w (or zero)
    alpha = gguf_s3d8.scales.scales_to_fp32(gguf_s3d8.absmax_scale_bf16(w))
    ints = q / alpha[:, None]
    assert np.allclose(ints, np.round(ints), atol=1e-4) and np.abs(ints).max() <= 127
    assert np.all((np.sign(q) == np.sign(w)) | (q == 0))


def test_s3d8_bits() -> None:
    f = S3D8Format()
    assert f.bits_per_param((576, 1536)) == pytest.approx((8 * 192 * 1536 + 16 * 576 + 768) / (576 * 1536))
    assert f.bits_per_param((4096, 4096)) == pytest.approx((8 * 1366 * 4096 + 16 * 4096 + 768) / 4096**2)
    assert S3D8Format.container_bits_per_param((576, 1536)) == pytest.approx(2.6875)
    assert S3D8Format.container_bits_per_param((576, 576)) is None


def test_all_formats_are_weight_formats() -> None:
    for f in (IntFormat(), StudentTFormat(), LloydMaxFormat(), S3D8Format()):
        assert isinstance(f, WeightFormat) and f.name
        w = torch.randn(9, 256, generator=torch.Generator().manual_seed(6))
        q = f.quantise(w)
        assert q.shape == w.shape and q.dtype == torch.float32 and torch.isfinite(q).all()
        assert f.quantise(torch.zeros(9, 256)).abs().max() == 0


# ---------------------------------------------------------------------------------------------------
# INT affine, quantiser interface, padding in the accounting


def test_int_affine_known_blocks() -> None:
    fmt = IntFormat(levels=4, block=4, affine=True)
    w = torch.tensor([[-1.0, 0.5, 0.25, 2.0, 1.0, 2.0, 3.0, 4.0]])
    # block 0: range [-1, 2] -> scale 3/3 = 1, zero round(1/1) = 1; codes clip(round(w)+1) = 0, 1, 1, 3
    # block 1: range widened to [0, 4] -> scale bf16(4/3) = 1.3359375, zero 0; w/s = .75, 1.50, 2.25, 2.99 -> 1, 1, 2, 3
    s = 1.3359375
    assert float(bf16_rne(torch.tensor(4 / 3))) == s
    assert fmt.quantise(w).tolist() == [[-1.0, 0.0, 0.0, 2.0, s, s, 2 * s, 3 * s]]
    assert fmt.name == "INT K=4 G=4 affine"
    assert fmt.quantise(torch.zeros(2, 8)).abs().max() == 0
    # all K levels are used on random data (unlike the absmax parameterisation)
    r = torch.randn(64, 128, generator=torch.Generator().manual_seed(7))
    q = IntFormat(6, 128, affine=True)
    qa = q.quantise(r)
    assert all(len(torch.unique(row)) == 6 for row in qa[:8])


def test_bits_hand_computed_with_padding() -> None:
    assert IntFormat(4, 128, affine=True).bits_per_param((10, 256)) == pytest.approx(2 + 2 * 16 / 128)
    assert IntFormat(4, 128, affine=True).bits_per_param((10, 576)) == pytest.approx(2 + 2 * 16 * 5 / 576)
    assert IntFormat(12, 32).bits_per_param((3, 100)) == pytest.approx(math.log2(12) + 16 * 4 / 100)  # 4 blocks
    # S3D8: 4 rows -> 2 triples (2 padding rows cost codes), 4 bf16 scales, 96-byte codebook
    assert S3D8Format().bits_per_param((4, 128)) == pytest.approx((8 * 2 * 128 + 16 * 4 + 768) / 512)
    assert StudentTFormat(8, 64).bits_per_param((2, 64)) == pytest.approx(3 + 16 / 64 + 8 * 16 / 128)
    assert LloydMaxFormat(4).bits_per_param((2, 10)) == pytest.approx(2 + 16 / 10 + 4 * 16 / 20)


def test_quantiser_groups() -> None:
    w = torch.randn(7, 200)
    assert IntFormat(6, 64).quantiser(w).group == 64
    assert IntFormat(6, 512).quantiser(w).group == 200
    assert LloydMaxFormat(6).quantiser(w).group == 200
    assert S3D8Format().quantiser(w).group == 200


# ---------------------------------------------------------------------------------------------------
# QAT split (qat.train --format): frozen per-matrix fit, scales from the current weights


QAT_FORMATS = (IntFormat(6, 128), IntFormat(8, 64, affine=True), StudentTFormat(6, 128), LloydMaxFormat(6), S3D8Format())


@pytest.mark.parametrize("fmt", QAT_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape", [(96, 1024), (100, 576), (7, 200)])  # S3D8: eligible, ineligible (k, rows)
def test_qat_split_is_the_direct_cast_and_scales_are_dynamic(fmt: WeightFormat, shape: tuple[int, int]) -> None:
    """``qat_quantise(w, qat_fit(w)) == quantise(w)`` bit for bit; with the fit frozen, the scales follow the
    weights: doubling w doubles every bf16 absmax scale exactly and keeps every normalised value, so the value of
    2w is exactly 2 * the value of w (a scale frozen at fit time would not double)."""
    w = torch.from_numpy(np.random.default_rng(8).standard_t(5, shape).astype(np.float32) * 0.02)
    fitted = fmt.qat_fit(w)
    assert all(isinstance(v, torch.Tensor) for v in fitted.values())
    q = fmt.qat_quantise(w, fitted)
    assert torch.equal(q, fmt.quantise(w))
    assert torch.equal(fmt.qat_quantise(2 * w, fitted), 2 * q)
    if "table" in fitted or "codebook" in fitted:  # the frozen part is not refitted: another matrix, same table
        v = torch.sign(w) * w.abs().sqrt() * 0.1  # lighter tails: a different distribution of normalised values
        assert not torch.equal(fmt.qat_quantise(v, fitted), fmt.quantise(v))

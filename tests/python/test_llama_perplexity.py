"""qat.llama_perplexity reads the figures llama-perplexity prints (lines as the pinned tree formats them)."""

from __future__ import annotations

import math

import pytest

from qat import llama_perplexity as lp

KV = ("0.00.515.073 I llama_kv_cache: size =   23.91 MiB (   256 cells,  30 layers,  8/8 seqs), K (q8_0):   11.95 MiB, "
      "V (q8_0):   11.95 MiB\n")
BASE = KV + "0.14.576.799 I Final estimate: PPL = 10.6693 +/- 2.41650\n"
COMPARE = KV + """Mean PPL(Q)                   :  10.669300 ±   2.416500
Mean PPL(base)                :  10.602000 ±   2.400000
Mean    KLD:   0.000212 ±   0.000031
Maximum KLD:   0.012000
Same top p: 99.216 ± 0.781 %
"""


def test_base_run() -> None:
    r = lp.parse(BASE, kld=False)
    assert (r.ppl, r.ppl_err) == (10.6693, 2.4165) and math.isnan(r.kld)
    # 8 streams of 256 cells: 30 layers x 3 KV heads x 64 x (K + V) x 8.5 bits = 12240 bytes per token, printed in
    # MiB with 2 decimals (23.91 MiB: within 0.005 MiB / 2048 tokens)
    assert r.kv_cache_cells == 2048 and abs(r.kv_bytes_per_token - 12240) < 0.005 * 2**20 / 2048


def test_comparison_run() -> None:
    r = lp.parse(COMPARE, kld=True)
    assert (r.ppl, r.kld, r.kld_err, r.same_top, r.same_top_err) == (10.6693, 0.000212, 0.000031, 99.216, 0.781)


def test_missing_figures_are_an_error_naming_them() -> None:
    with pytest.raises(lp.PerplexityOutputError, match="Mean KLD"):
        lp.parse(BASE, kld=True)
    with pytest.raises(lp.PerplexityOutputError, match="Final estimate"):
        lp.parse("llama_init_from_model: failed", kld=False)
    assert math.isnan(lp.parse("Final estimate: PPL = 3.0 +/- 0.1", kld=False).kv_bytes_per_token)


# three chunks of a comparison run as the pinned tree prints them: running means; the chunks' own KLDs are
# 0.2, 0.3 and 0.4 (running means 0.2, 0.25, 0.3)
CHUNKS = """chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      12.6093 ±    2.3772       0.12020 ±    0.04434       0.20000 ±    0.02640     9.299 ±  1.230 %    83.529 ±  2.327 %
   2      16.8097 ±    2.3735      -0.20759 ±    0.03803       0.25000 ±    0.02243    12.896 ±  1.207 %    78.824 ±  1.811 %
   3      21.6533 ±    2.7049       0.23333 ±    0.03404       0.30000 ±    0.01950    13.366 ±  0.989 %    77.386 ±  1.513 %
"""


def test_chunk_klds_undo_the_running_mean() -> None:
    assert lp.chunk_klds(COMPARE + CHUNKS) == pytest.approx([0.2, 0.3, 0.4], abs=3e-5)
    with pytest.raises(lp.PerplexityOutputError, match="per-chunk"):
        lp.chunk_klds(COMPARE)
    with pytest.raises(lp.PerplexityOutputError, match="out of order"):
        lp.chunk_klds(CHUNKS.replace("   2      16", "   5      16"))


def test_paired_difference() -> None:
    d = lp.paired_kld_difference([0.2, 0.3, 0.4, 0.5], [0.19, 0.28, 0.41, 0.46])
    assert d.mean == pytest.approx(-0.015) and (d.n_lower, d.n) == (3, 4)
    # differences -0.01, -0.02, +0.01, -0.04: sample sd 0.0208, / sqrt(4)
    assert d.stderr == pytest.approx(math.sqrt(((0.005**2) + (0.005**2) + (0.025**2) + (0.025**2)) / 3 / 4))
    with pytest.raises(ValueError, match="same chunks"):
        lp.paired_kld_difference([0.1, 0.2], [0.1])

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

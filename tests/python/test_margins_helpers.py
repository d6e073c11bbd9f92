"""The near-tie guards of tests.mllama.margins fail where they must (they gate the greedy-token checks of the
llama.cpp tests, so a guard that always passed would let those checks hinge on rounding again)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.mllama.margins import assert_decisive_chain, assert_same_argmax, decisive_rows, margins, tie_bound

TOL = 1e-2
# max |ref| = 10, so the tie bound is 2 * TOL * 10 = 0.2
REF = np.array([[10.0, 0.0, 1.0],    # margin 9: decisive
                [5.0, 4.9, 0.0],     # margin 0.1: a near tie
                [0.0, 3.0, 2.5]])    # margin 0.5: decisive


def test_margins_and_bound() -> None:
    np.testing.assert_allclose(margins(REF), [9.0, 0.1, 0.5])
    assert tie_bound(REF, TOL) == pytest.approx(0.2)
    assert decisive_rows(REF, TOL).tolist() == [0, 2]


def test_same_argmax_compares_decisive_rows_only() -> None:
    got = REF.copy()
    got[1] = [4.9, 5.0, 0.0]  # the near tie flips: not compared
    assert assert_same_argmax(got, REF, TOL, min_rows=2, what="x").tolist() == [0, 2]
    got[2] = [0.0, 2.5, 3.0]  # a decisive row flips: an error
    with pytest.raises(AssertionError, match="decisive positions \\[2\\]"):
        assert_same_argmax(got, REF, TOL, min_rows=2, what="x")


def test_same_argmax_needs_enough_decisive_rows() -> None:
    with pytest.raises(AssertionError, match="only 2 positions"):
        assert_same_argmax(REF, REF, TOL, min_rows=3, what="x")


def test_decisive_chain() -> None:
    assert_decisive_chain([(REF[0], REF), (REF[2], REF)], TOL, what="x")
    with pytest.raises(AssertionError, match="greedy decision 1 is a near tie"):
        assert_decisive_chain([(REF[0], REF), (REF[1], REF)], TOL, what="x")

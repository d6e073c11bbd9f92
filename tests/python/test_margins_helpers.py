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


def test_greedy_match_compares_up_to_the_first_near_tie() -> None:
    from tests.mllama.margins import assert_greedy_match

    ref, margins_ = [5, 6, 7, 8], [0.5, 0.3, 0.01, 0.4]   # decision 2 is a near tie (bound 0.1)
    assert assert_greedy_match([5, 6, 9, 9], ref, margins_, 0.1, what="t", min_decisive=2) == 2
    with pytest.raises(AssertionError, match="differs"):
        assert_greedy_match([5, 7, 7, 8], ref, margins_, 0.1, what="t", min_decisive=2)
    with pytest.raises(AssertionError, match="only 2 leading"):
        assert_greedy_match(ref, ref, margins_, 0.1, what="t", min_decisive=3)
    # every decision decisive: the whole outputs, length included
    with pytest.raises(AssertionError, match="differs"):
        assert_greedy_match([5, 6, 7, 8, 1], ref, [0.5] * 4, 0.1, what="t", min_decisive=1)
    # text against the reference's pieces: the decisive prefix, the whole text when all are decisive
    assert assert_greedy_match("ab?", ["a", "b", "c"], [1.0, 1.0, 0.0], 0.1, what="t", min_decisive=2) == 2
    with pytest.raises(AssertionError, match="differs"):
        assert_greedy_match("abc!", ["a", "b", "c"], [1.0] * 3, 0.1, what="t", min_decisive=1)


def _entry(tok: int, own: list[int], cands: list[tuple[int, float]], sent: list[int] | None = None) -> dict:
    return {"id": tok, "token": bytes(sent or own).decode(errors="replace"), "bytes": sent or own,
            "logprob": dict(cands)[tok],
            "top_logprobs": [{"id": t, "bytes": own if t == tok else [65 + t], "logprob": lp} for t, lp in cands]}


def test_server_answers_compare_where_the_margins_are_listed() -> None:
    from tests.mllama import llama_server as S

    c = [(1, -0.1), (2, -0.5), (3, -0.9)]   # margin 0.4 for token 1, 0.4 for token 2 (its best other: 1)
    near = [(2, -0.5), (1, -0.505)]          # margin 0.005 < 2 * LOGPROB_TOL
    entries = [_entry(1, [97], c), _entry(1, [98], c), _entry(2, [99], near), _entry(1, [100], c)]
    res = {"choices": [{"logprobs": {"content": entries}, "finish_reason": "length"}],
           "usage": {"completion_tokens": 4}}
    ref = S.parse_answer(res)
    assert ref.aligned == 4 and ref.text == "abcd"
    assert S.assert_same_answer(ref, ref, what="t", min_decisive=2) == 2
    # parting at the near tie is allowed; parting before it is not
    flipped = [(1, -0.502), (2, -0.503)]     # within LOGPROB_TOL of `near`, the other token best
    other = S.parse_answer({**res, "choices": [{"logprobs": {"content": entries[:2] + [_entry(1, [99], flipped)]},
                                                "finish_reason": "length"}]})
    S.assert_same_answer(other, ref, what="t", min_decisive=2)
    with pytest.raises(AssertionError, match="differ"):
        S.assert_same_answer(S.parse_answer({**res, "choices": [{"logprobs": {"content": [entries[0],
                             _entry(2, [99], c)]}, "finish_reason": "length"}]}), ref, what="t", min_decisive=1)
    # a held-back token: the next entry carries its bytes; from there on no margin is known
    merged = [entries[0], _entry(1, [98], c, sent=[0xC3, 98]), entries[3]]
    m = S.parse_answer({"choices": [{"logprobs": {"content": merged}, "finish_reason": "length"}],
                        "usage": {"completion_tokens": 4}})
    assert m.aligned == 1 and m.margins()[1:] == [0.0, 0.0]
    with pytest.raises(AssertionError, match="only 1 leading"):
        S.assert_same_answer(m, m, what="t", min_decisive=2)
    # the browser's text against the API's answer
    S.assert_text_is_answer("abcX", ref, what="t", min_decisive=2)
    with pytest.raises(AssertionError, match="differs"):
        S.assert_text_is_answer("aXcd", ref, what="t", min_decisive=2)

"""Greedy-token comparisons that cannot hinge on a near tie.

Two implementations whose logits agree to a normwise bound, max |got - ref| <= tol * max |ref| (the tests' relative
error), can still pick different tokens where the reference's two best logits are closer than the error: each of
the two may move by up to tol * max |ref|, so the argmax is then decided by rounding (the CPU's instruction set,
the summation order), not by the model. The argmax is implied only where the margin, best minus second-best logit,
exceeds twice that, ``2 * tol * max |ref|``. These helpers compare tokens only at such positions and *assert* that
there are enough of them (a precondition on the test's input, never a silent skip): a test whose input has no
decisive position fails and says that its input (prompt, image, model seed) must change.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def margins(logits: np.ndarray) -> np.ndarray:
    """Best minus second-best logit of every row (float64)."""
    top2 = np.sort(np.asarray(logits, dtype=np.float64), axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def tie_bound(ref: np.ndarray, tol: float) -> float:
    """The margin above which an implementation within ``tol`` (relative to max |ref|) must pick ref's argmax."""
    return 2.0 * tol * float(np.max(np.abs(np.asarray(ref, dtype=np.float64))))


def decisive_rows(ref: np.ndarray, tol: float) -> np.ndarray:
    """Indices of the rows of ``ref`` whose margin exceeds :func:`tie_bound`."""
    return np.flatnonzero(margins(ref) > tie_bound(ref, tol))


def _describe(ref: np.ndarray, tol: float) -> str:
    scale = float(np.max(np.abs(ref)))
    return (f"margins / max|ref| per position {np.round(margins(ref) / scale, 5).tolist()}, "
            f"bound 2 * tol = {2 * tol:.3g}")


def assert_same_argmax(got: np.ndarray, ref: np.ndarray, tol: float, *, min_rows: int, what: str) -> np.ndarray:
    """``got`` picks ``ref``'s token at every row where ``ref``'s margin exceeds :func:`tie_bound`; at least
    ``min_rows`` rows must qualify. Returns the rows compared."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    rows = decisive_rows(ref, tol)
    assert rows.size >= min_rows, (
        f"{what}: only {rows.size} positions (rows {rows.tolist()}) have a margin above the tie bound, {min_rows} "
        f"needed - the test input must change ({_describe(ref, tol)})")
    bad = rows[got[rows].argmax(-1) != ref[rows].argmax(-1)]
    assert bad.size == 0, (f"{what}: other token than the reference at decisive positions {bad.tolist()} "
                           f"({_describe(ref, tol)})")
    return rows


def assert_decisive_chain(decisions: list[tuple[np.ndarray, np.ndarray]], tol: float, *, what: str) -> None:
    """Every decision of a greedy chain is decisive: ``decisions`` lists (row, array it was checked in) - the
    array whose max |.| scales the tolerance, e.g. the prompt logits for the first token and the decode-step
    logits for the others. Then an implementation within ``tol`` of the reference at every step generates the
    reference's tokens, and comparing the tokens (and the step logits, computed on those tokens) is sound."""
    ms, bounds = chain_margins(decisions, tol)
    i = decisive_count(ms, bounds)
    assert i == len(ms), (f"{what}: greedy decision {i} is a near tie (margin {ms[i]:.3g} <= bound {bounds[i]:.3g} = "
                          f"2 * {tol:.3g} * max|logits|): the generated tokens would depend on rounding - the test "
                          f"input must change")


def chain_margins(decisions: list[tuple[np.ndarray, np.ndarray]], tol: float) -> tuple[list[float], list[float]]:
    """The margins of a greedy chain's decisions (see :func:`assert_decisive_chain`) and the bound of each."""
    return [float(margins(row)) for row, _ in decisions], [tie_bound(arr, tol) for _, arr in decisions]


def decisive_count(ref_margins: Sequence[float], bounds: float | Sequence[float]) -> int:
    """How many of the reference's greedy decisions, from the first on, have a margin above their bound."""
    bs = [bounds] * len(ref_margins) if isinstance(bounds, (int, float)) else list(bounds)
    assert len(bs) == len(ref_margins), (len(bs), len(ref_margins))
    n = 0
    for m, b in zip(ref_margins, bs):
        if not m > b:
            break
        n += 1
    return n


def assert_greedy_match(got: Sequence[Any] | str, ref: Sequence[Any], ref_margins: Sequence[float],
                        bounds: float | Sequence[float], *, what: str, min_decisive: int) -> int:
    """The one comparison of greedy outputs in the suite: ``got`` equals the reference ``ref`` (tokens, or the text
    pieces of its tokens when ``got`` is a string) over the leading decisions whose margin ``ref_margins[i]`` exceeds
    its bound (the distance at which rounding within the test's tolerance could flip it). After a near tie the two may
    part (the contexts then differ), so nothing after it is compared; at least ``min_decisive`` decisions must come
    before it (asserted: a test input with too few is changed, never skipped). When every decision is decisive, the
    whole outputs are equal (the same length included). Returns the number of decisions compared."""
    assert len(ref_margins) == len(ref), (what, len(ref_margins), len(ref))
    n = decisive_count(ref_margins, bounds)
    assert n >= min_decisive, (
        f"{what}: only {n} leading greedy decisions of the reference lie above the tie bound ({min_decisive} needed; "
        f"margins {[round(m, 4) for m in ref_margins]}, bound(s) {bounds}): the test input must change")
    whole = n == len(ref)
    if isinstance(got, str):
        want = "".join(ref[:n])
        ok = got == want if whole else got.startswith(want)
    else:
        ok = list(got) == list(ref) if whole else list(got[:n]) == list(ref[:n])
    assert ok, (f"{what}: {'the' if whole else f'the first {n} decisive'} greedy output differs from the "
                f"reference: {got!r} vs {list(ref)!r}")
    return n


def assert_same_greedy_chain(got: Sequence[int], ref: Sequence[int], decisions: list[tuple[np.ndarray, np.ndarray]],
                             tol: float, *, what: str, min_decisive: int | None = None) -> int:
    """:func:`assert_greedy_match` for a greedy chain given as the reference's logits (:func:`assert_decisive_chain`'s
    ``decisions``, one per token): by default every decision must be decisive and the tokens equal."""
    ref_margins, bounds = chain_margins(decisions, tol)
    return assert_greedy_match(got, ref, ref_margins, bounds, what=what,
                               min_decisive=len(ref) if min_decisive is None else min_decisive)

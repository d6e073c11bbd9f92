"""Codebook fitting: determinism, the two centroid rules, subsampling and degenerate matrices."""

from __future__ import annotations

import numpy as np
import pytest

from gguf_s3d8 import DEFAULT_CENTROID_RULE, fit_codebook, quantize_s3d8
from gguf_s3d8.codebook import apply_centroid_rule, kmeans_plus_plus, lloyd, training_histogram
from gguf_s3d8.errors import S3D8InputError


@pytest.fixture(scope="module")
def weights() -> np.ndarray:
    rng = np.random.default_rng(11)
    return rng.laplace(scale=0.01, size=(96, 1024)).astype(np.float32)


def test_default_rule_is_what_the_encoder_applies(weights: np.ndarray) -> None:
    """With no rule given, the encoder fits with DEFAULT_CENTROID_RULE ("trunc": docs/codec.md, chosen on real
    weights in docs/quality.md), observably: its codebook is the trunc one and not the round one on these weights."""
    assert DEFAULT_CENTROID_RULE == "trunc"
    default = fit_codebook(weights, seed=3)
    assert np.array_equal(default, fit_codebook(weights, centroid_rule="trunc", seed=3))
    assert not np.array_equal(default, fit_codebook(weights, centroid_rule="round", seed=3))
    w = np.concatenate([weights, weights[::-1]])  # 192 rows: a container large enough to hold its header
    assert np.array_equal(quantize_s3d8(w, seed=3), quantize_s3d8(w, centroid_rule="trunc", seed=3))


@pytest.mark.parametrize("rule", ["round", "trunc"])
def test_fit_is_deterministic_for_a_seed(weights: np.ndarray, rule: str) -> None:
    a = fit_codebook(weights, centroid_rule=rule, seed=3)
    b = fit_codebook(weights.copy(), centroid_rule=rule, seed=3)
    assert a.dtype == np.uint8 and a.shape == (32, 3)
    assert np.array_equal(a, b)
    assert a.max() <= 127
    assert len(np.unique(a, axis=0)) > 20


def test_seed_changes_the_initialisation(weights: np.ndarray) -> None:
    fits = {fit_codebook(weights, seed=s).tobytes() for s in range(4)}
    assert len(fits) > 1


def test_rules_truncate_or_round_vectors_and_centroids() -> None:
    v = np.array([0.4, 0.5, 1.5, 2.5, 10.7, 126.99, 127.4, 180.0])
    assert apply_centroid_rule(v, "trunc").tolist() == [0, 0, 1, 2, 10, 126, 127, 127]
    assert apply_centroid_rule(v, "round").tolist() == [0, 0, 2, 2, 11, 127, 127, 127]
    # rows with scale exactly 1 (max 127 in column 0): the only 3-vectors are (127,127,127) and
    # (127, 89.7, 63.5), so the codebook holds exactly those made integer by the rule
    w = np.tile(np.array([[127.0], [89.7], [63.5]], np.float32), (2, 128))
    w[:, 0] = 127.0
    for rule, expected in (("trunc", (127, 89, 63)), ("round", (127, 90, 64))):
        cb = fit_codebook(w, centroid_rule=rule)
        assert {tuple(int(x) for x in r) for r in cb} == {(127, 127, 127), expected}


def test_round_and_trunc_give_different_codebooks(weights: np.ndarray) -> None:
    assert not np.array_equal(fit_codebook(weights, centroid_rule="round"),
                              fit_codebook(weights, centroid_rule="trunc"))


def test_unknown_rule_is_rejected_with_the_name(weights: np.ndarray) -> None:
    with pytest.raises(S3D8InputError, match="'w.q'.*centroid rule"):
        fit_codebook(weights, centroid_rule="floor", name="w.q")


def test_subsample_is_used_above_the_limit_and_is_seeded(weights: np.ndarray) -> None:
    rule = "trunc"
    full_pts, full_counts = training_histogram(weights, rule, np.random.default_rng(0), max_vectors=None)
    assert full_counts.sum() == 32 * 1024
    pts, counts = training_histogram(weights, rule, np.random.default_rng(0), max_vectors=5000)
    assert counts.sum() == 5000
    again = training_histogram(weights, rule, np.random.default_rng(0), max_vectors=5000)
    assert np.array_equal(pts, again[0]) and np.array_equal(counts, again[1])
    # every sampled point exists in the full histogram with at least that multiplicity
    full = {tuple(p): c for p, c in zip(full_pts.tolist(), full_counts.tolist())}
    assert all(full[tuple(p)] >= c for p, c in zip(pts.tolist(), counts.tolist()))


def test_lloyd_keeps_empty_clusters_and_converges() -> None:
    pts = np.array([[0, 0, 0], [2, 0, 0], [100, 100, 100]], np.float64)
    counts = np.array([5, 5, 1], np.int64)
    init = np.array([[1, 0, 0], [100, 100, 100], [50, 127, 0]] + [[127, 127, 127]] * 29, np.float64)
    c, iterations = lloyd(pts, counts, init)
    assert c[0].tolist() == [1, 0, 0] and c[1].tolist() == [100, 100, 100]
    assert c[2].tolist() == [50, 127, 0]          # empty cluster keeps its value
    assert iterations == 1


def test_kmeans_pp_with_few_distinct_points() -> None:
    pts = np.array([[0, 0, 0], [3, 4, 0]], np.float64)
    init = kmeans_plus_plus(pts, np.array([10, 1], np.int64), np.random.default_rng(0))
    assert init.shape == (32, 3)
    assert {tuple(r) for r in init.tolist()} == {(0, 0, 0), (3, 4, 0)}


def test_all_zero_matrix_fits_and_quantises() -> None:
    w = np.zeros((48, 2048), np.float32)
    cb = fit_codebook(w)
    assert not cb.any()
    c = quantize_s3d8(w, name="zeros")
    assert c.shape == (48, 688)

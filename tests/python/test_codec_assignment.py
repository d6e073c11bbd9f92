"""Nearest-centroid search: fp32 evaluation order, ties to the lowest index, chunking."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gguf_s3d8.assignment import CellAssigner, centroid_distances, nearest_centroid


def codebook_with(rows: dict[int, tuple[int, int, int]]) -> np.ndarray:
    cb = np.full((32, 3), 127, dtype=np.uint8)
    cb[:, 0] = np.arange(32) + 90          # far-away filler centroids, all distinct
    for i, r in rows.items():
        cb[i] = r
    return cb


def assign_points(points: list[tuple[float, float, float]], cb: np.ndarray) -> list[int]:
    a = np.array(points, dtype=np.float32)
    return nearest_centroid(a[:, 0], a[:, 1], a[:, 2], cb).tolist()


def test_exact_tie_goes_to_lowest_index() -> None:
    cb = codebook_with({3: (12, 100, 100), 4: (10, 100, 100)})
    assert assign_points([(11, 100, 100)], cb) == [3]
    cb = codebook_with({3: (10, 100, 100), 4: (12, 100, 100)})
    assert assign_points([(11, 100, 100)], cb) == [3]


def test_duplicate_centroids_keep_the_first() -> None:
    cb = codebook_with({6: (5, 5, 5), 20: (5, 5, 5), 31: (5, 5, 5)})
    assert assign_points([(5, 5, 5), (4.9, 5.2, 5)], cb) == [6, 6]


def test_tie_created_by_fp32_rounding_goes_to_lowest_index() -> None:
    # |w'| = (11 - 2^-20, 50, 50): index 7 is farther in exact arithmetic (1 + 2^-19 + ... vs 1 - 2^-19),
    # but after fp32 rounding both distances are exactly 101.0, so the lower index wins.
    cb = codebook_with({7: (12, 50, 60), 9: (10, 50, 60)})
    p = (11.0 - 2.0**-20, 50.0, 50.0)
    d = centroid_distances(np.array([p], np.float32), cb)[0]
    assert d[7] == d[9] == np.float32(101.0)
    exact = ((cb.astype(np.float64) - np.array(p)) ** 2).sum(axis=1)
    assert exact[9] < exact[7]
    assert assign_points([p], cb) == [7]


def test_summation_order_is_left_to_right() -> None:
    # with t0 = 1 + 2^-19 (rounded square), t1 = 0, t2 = 2^24: ((t0 + t1) + t2) rounds t0 away entirely
    cb = codebook_with({0: (12, 0, 127)})
    p = np.array([[11.0 - 2.0**-20, 0.0, 127.0 - 4096.0]], np.float32)
    d = centroid_distances(p, cb)[0, 0]
    t0 = np.float32(np.float32(12) - p[0, 0]) ** 2
    assert d == np.float32(np.float32(t0 + np.float32(0)) + np.float32(4096.0) ** 2)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 7, 64, 1000]))
def test_streaming_search_equals_brute_force_argmin(seed: int, size: int) -> None:
    rng = np.random.default_rng(seed)
    cb = rng.integers(0, 128, size=(32, 3)).astype(np.uint8)
    cb[rng.integers(0, 32)] = cb[rng.integers(0, 32)]           # sometimes duplicated centroids
    a = np.abs(rng.laplace(scale=20, size=(size, 3))).astype(np.float32)
    a[: size // 2] = np.rint(a[: size // 2])                      # integer points: many exact ties
    a = np.minimum(a, np.float32(190))
    expected = centroid_distances(a, cb).argmin(axis=1)           # argmin = first minimum
    got = nearest_centroid(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), cb, chunk=7)
    assert np.array_equal(got, expected)


def test_shape_and_float64_variant() -> None:
    rng = np.random.default_rng(1)
    cb = rng.integers(0, 128, size=(32, 3))
    a = rng.uniform(0, 127, size=(3, 4, 5))
    q64 = nearest_centroid(a[0], a[1], a[2], cb)
    assert q64.shape == (4, 5) and q64.dtype == np.uint8
    d = ((cb[None, None, :, :] - np.moveaxis(a, 0, -1)[:, :, None, :]) ** 2).sum(axis=-1)
    assert np.array_equal(q64, d.argmin(axis=-1))


def adversarial_points(rng: np.random.Generator, cb: np.ndarray, size: int) -> np.ndarray:
    """Points on cell corners and faces, one ulp either side, midpoints of centroid pairs (exact ties),
    large components (>= 128) and ordinary Laplace-like values."""
    c = cb.astype(np.float32)
    parts = [
        rng.integers(0, 129, size=(size, 3)).astype(np.float32),
        np.nextafter(rng.integers(1, 128, size=(size, 3)).astype(np.float32), np.float32(0)),
        np.nextafter(rng.integers(0, 128, size=(size, 3)).astype(np.float32), np.float32(200)),
        rng.integers(0, 256, size=(size, 3)).astype(np.float32) / np.float32(2),
        (c[rng.integers(0, 32, size)] + c[rng.integers(0, 32, size)]) / np.float32(2),
        np.abs(rng.laplace(scale=15, size=(size, 3))).astype(np.float32),
        rng.uniform(0, 200, size=(size, 3)).astype(np.float32),
    ]
    return np.concatenate(parts)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from(["uniform", "clustered", "duplicates", "small"]))
def test_cell_assigner_equals_brute_force(seed: int, kind: str) -> None:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        cb = rng.integers(0, 128, size=(32, 3))
    elif kind == "clustered":
        cb = np.minimum(np.abs(rng.laplace(scale=8, size=(32, 3))), 127).astype(int)
    elif kind == "duplicates":
        cb = rng.integers(0, 128, size=(32, 3))
        cb[rng.integers(0, 32, 8)] = cb[rng.integers(0, 32, 8)]
    else:
        cb = rng.integers(0, 4, size=(32, 3))
    cb = cb.astype(np.uint8)
    a = adversarial_points(rng, cb, 3000)
    assigner = CellAssigner(cb)
    expected = nearest_centroid(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), cb)
    assert np.array_equal(assigner.assign(a[:, 0], a[:, 1], a[:, 2]), expected)
    # a second call reuses the classified cells
    perm = rng.permutation(len(a))
    assert np.array_equal(assigner.assign(a[perm, 0], a[perm, 1], a[perm, 2]), expected[perm])


def test_cell_assigner_on_the_crafted_ties() -> None:
    cb = codebook_with({3: (12, 100, 100), 4: (10, 100, 100), 7: (12, 50, 60), 9: (10, 50, 60)})
    a = np.array([(11, 100, 100), (11.0 - 2.0**-20, 50.0, 50.0), (11, 50, 50)], np.float32)
    got = CellAssigner(cb).assign(a[:, 0], a[:, 1], a[:, 2])
    assert got.tolist() == [3, 7, 7]

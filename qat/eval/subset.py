"""The fixed seeded evaluation subset.

``subset_indices(size, n, seed)`` = the first ``min(n, size)`` entries of
``numpy.random.default_rng(seed).permutation(size)``: exactly the rows ``datasets.Dataset.shuffle(seed)``
followed by ``select(range(n))`` picks, which is how the authors drew their 1024 examples per task. Entry i is a
pure function of (seed, size); a smaller n gives a prefix of a larger one; n ≥ size gives every row (shuffled).
"""

from __future__ import annotations

import numpy as np


def subset_indices(size: int, n: int, seed: int) -> list[int]:
    if size < 0 or n < 0:
        raise ValueError(f"size and n must be non-negative (got {size}, {n})")
    return [int(i) for i in np.random.default_rng(seed).permutation(size)[:n]]

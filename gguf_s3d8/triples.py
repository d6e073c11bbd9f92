"""Row triples (format section 1): rows 3p, 3p+1, 3p+2 form the 3-vectors; rows >= n are zero padding.

Both the quantiser (whole triples, chunk by chunk) and codebook fitting (a random sample of vectors) get
their normalised components ``w'`` from here, so padding and the ``alpha == 0`` rule live in one place.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .constants import VECTOR_DIM
from .scales import normalise

F32 = npt.NDArray[np.float32]


def triple_components(w: F32, alpha: F32, p_start: int, p_stop: int) -> F32:
    """Normalised weights ``w'`` of triples ``p_start .. p_stop-1`` as an array (3, p_stop-p_start, k).

    Component d of triple p is row 3p+d; rows at or beyond n (the padding of the last triple) are +0.
    """
    n, k = w.shape
    out = np.zeros((p_stop - p_start, VECTOR_DIM, k), dtype=np.float32)
    r0, r1 = VECTOR_DIM * p_start, min(n, VECTOR_DIM * p_stop)
    if r1 > r0:
        rows = normalise(w[r0:r1], alpha[r0:r1, None])
        out.reshape(-1, k)[: r1 - r0] = rows
    return np.ascontiguousarray(out.transpose(1, 0, 2))


def sampled_components(w: F32, alpha: F32, vector_ids: npt.NDArray[np.int64]) -> F32:
    """``w'`` of selected 3-vectors, shape (3, len(vector_ids)); vector v is triple ``v // k``, column ``v % k``."""
    n, k = w.shape
    p = vector_ids // k
    j = vector_ids % k
    out = np.zeros((VECTOR_DIM, vector_ids.size), dtype=np.float32)
    for d in range(VECTOR_DIM):
        rows = VECTOR_DIM * p + d
        real = rows < n
        r = rows[real]
        out[d, real] = normalise(w[r, j[real]], alpha[r])
    return out

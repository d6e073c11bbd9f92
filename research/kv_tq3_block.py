"""Would a 128-value 3-bit block (3.125 bpw) beat TQ3_0 (32 values, 3.5 bpw)? (issue 13 part 1)

Relative MSE of the TQ3_0 quantiser (gguf_s3d8.kv_types: Lloyd-Max levels, searched fp16 scale) with one
scale per 32 values against the same quantiser with one scale per 64 and per 128 values, on
  gauss     i.i.d. N(0, 1)
  kv-rot    K-like rows (log-normal channel scales, 4 outlier channels x12, per-channel offsets, head 128)
            after the pinned tree's 64-point Hadamard rotation
  kv-norot  the same rows without rotation
and, for scale, the 4-bit HQQ types and Q4_1-style min/max. Run: python research/kv_tq3_block.py
"""

from __future__ import annotations

import numpy as np

from gguf_s3d8 import kv_types
from gguf_s3d8.ggml_types import TYPES


def hadamard(n: int) -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def kv_like(rng: np.random.Generator, rows: int, d: int = 128, rotate: bool = True) -> np.ndarray:
    sc = np.exp(rng.normal(0, 0.6, d))
    sc[rng.choice(d, 4, replace=False)] *= 12
    x = rng.normal(size=(rows, d)) * sc + rng.normal(size=d) * sc * 0.5
    if rotate:
        x = (x.reshape(rows, -1, 64) @ hadamard(64).T).reshape(rows, d)
    return x.astype(np.float32)


def tq3_group(x: np.ndarray, group: int) -> np.ndarray:
    """TQ3_0's quantiser with one scale per `group` values (float64 simulation of the same search)."""
    xb = x.reshape(-1, group).astype(np.float64)
    lv = kv_types.TQ3_LEVELS.astype(np.float64)
    amax = np.abs(xb).max(1, keepdims=True)
    best_e, best_r = None, None
    for c in range(11):
        d = (amax * (20 - c) / 20 / 88).astype(np.float16).astype(np.float64)
        idx = np.abs(xb[:, :, None] / np.where(d == 0, 1, d)[:, :, None] - lv).argmin(-1)
        r = lv[idx] * d
        e = ((xb - r) ** 2).sum(1, keepdims=True)
        if best_e is None:
            best_e, best_r = e, r
        else:
            m = e < best_e
            best_e, best_r = np.where(m, e, best_e), np.where(m, r, best_r)
    assert best_r is not None
    return best_r.reshape(x.shape)


def rel(x: np.ndarray, r: np.ndarray) -> float:
    return float(((x - r) ** 2).sum() / (x.astype(np.float64) ** 2).sum())


def main() -> None:
    rng = np.random.default_rng(0)
    data = {"gauss": rng.normal(size=(2048, 128)).astype(np.float32),
            "kv-rot": kv_like(rng, 2048), "kv-norot": kv_like(rng, 2048, rotate=False)}
    print(f"{'data':10s} {'TQ3_0 (32, 3.5 bpw)':>20s} {'64 (3.25 bpw)':>14s} {'128 (3.125 bpw)':>16s} "
          f"{'Q4_HQQ':>8s} {'Q4_HQQ_128':>11s}")
    for name, x in data.items():
        t32 = rel(x, TYPES["tq3_0"].decode(TYPES["tq3_0"].encode(x)).reshape(x.shape))
        t64, t128 = rel(x, tq3_group(x, 64)), rel(x, tq3_group(x, 128))
        h32 = rel(x, TYPES["q4_hqq"].decode(TYPES["q4_hqq"].encode(x)).reshape(x.shape))
        h128 = rel(x, TYPES["q4_hqq_128"].decode(TYPES["q4_hqq_128"].encode(x)).reshape(x.shape))
        print(f"{name:10s} {t32:20.4f} {t64:14.4f} {t128:16.4f} {h32:8.4f} {h128:11.4f}")


if __name__ == "__main__":
    main()

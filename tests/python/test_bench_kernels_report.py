"""The kernel benchmark's report arithmetic (benchmarks/bench_kernels.py), on hand-made raw results: the rounds of a
memory-bound shape merge into their medians, and the one-token target is judged on each round's bytes per second
over the bandwidth measured around that round, not over the run's first bandwidth measurement."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_kernels  # type: ignore[import-not-found]  # noqa: E402


def _mm(round_: int, gbps: float, bw: float | None, m: int = 1, type_: str = "s3d8", threads: int = 2) -> dict:
    row = {"kind": "mul_mat", "type": type_, "m": m, "k": 4096, "n": 1024, "threads": threads, "round": round_,
           "gmacs": gbps * 3.0, "weight_gbps": gbps}
    if bw is not None:
        row["bw_gbps"] = bw
    return row


def test_rounds_merge_into_medians_and_per_round_fractions() -> None:
    rows = [_mm(0, 20.0, 40.0), _mm(1, 30.0, 32.0), _mm(2, 24.0, 30.0), _mm(0, 10.0, None, type_="q8_0")]
    merged = {r["type"]: r for r in bench_kernels.merge_rounds(rows)}
    s3 = merged["s3d8"]
    assert s3["rounds"] == 3
    assert s3["weight_gbps"] == 24.0 and s3["gmacs"] == 72.0
    # each round against its own bandwidth: 0.5, 0.8, 0.9375 (sorted); the median 0.8 differs from the median
    # bytes/s over the median bandwidth (24 / 32 = 0.75)
    assert s3["bw_fractions"] == [0.5, 0.8, 0.9375]
    assert merged["q8_0"]["bw_fractions"] == [] and merged["q8_0"]["rounds"] == 1


def test_target_row_uses_the_bandwidth_around_each_round(tmp_path: Path) -> None:
    rows = [{"kind": "bandwidth", "threads": 2, "gbps": 50.0},  # the run's first measurement: would give 60 %
            _mm(0, 30.0, 33.0), _mm(1, 29.0, 34.0), _mm(2, 31.0, 35.0),
            _mm(0, 400.0, None, m=128)]
    doc = tmp_path / "benchmarks.md"
    args = argparse.Namespace(types="s3d8", build="host", doc=doc)
    bench_kernels.write_report(rows, None, args)
    text = doc.read_text()
    line = next(li for li in text.splitlines() if li.startswith("| 2 | 1x4096x1024 |"))
    # rounds: 30/33 = 91 %, 29/34 = 85 %, 31/35 = 89 % -> median 89 %, met
    assert "89% of the bandwidth around it (85%-91% over 3 rounds)" in line
    assert line.endswith("| yes |")
    assert (tmp_path / "img" / "benchmarks.png").exists() and (tmp_path / "img" / "benchmarks-bandwidth.png").exists()

"""The tile-cap benchmark's report (benchmarks/bench_mllama_tiles.py), on hand-made raw results: every photo and cap
is a row with its encode time against cap 4's of the same photo and the load around it, and every answer row says
whether llama.cpp's greedy tokens are transformers'."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_mllama_tiles  # type: ignore[import-not-found]  # noqa: E402


def test_report_rows_and_ratios(tmp_path: Path) -> None:
    timing = [{"photo": "astronaut", "cap": cap, "grid": [1, 1], "encode_ms": ms, "load_before": 2.0,
               "load_after": 3.5} for cap, ms in ((1, 20_000.0), (4, 160_000.0))]
    answers = {"astronaut": [{"cap": 1, "grid": [1, 1], "tokens": [5, 6], "hf_tokens": [5, 6], "rel_err_hf": 2e-6,
                              "rel_err_cap4": 0.25, "cross_rows": 17, "cross_valid": 17},
                             {"cap": 4, "grid": [2, 2], "tokens": [5, 7], "hf_tokens": [5, 8], "rel_err_hf": 3e-6,
                              "rel_err_cap4": 0.0, "cross_rows": 68, "cross_valid": 68}]}
    result = {"date": "2026-12-06", "cpu": "test CPU", "cpus": 2, "threads": 2, "timing": timing, "answers": answers,
              "sizes": {"astronaut": [512, 512]}}
    doc = tmp_path / "benchmarks.md"
    bench_mllama_tiles.write_report(result, argparse.Namespace(doc=doc))
    text = doc.read_text()
    assert "| astronaut (512 x 512) | 1 | 1x1 | 20.0 | 0.12 | 2.0 / 3.5 |" in text
    assert "| astronaut (512 x 512) | 4 | 1x1 | 160.0 | 1.00 | 2.0 / 3.5 |" in text
    assert "| astronaut | 1 | 1x1 | 17 / 17 | 5 6 | yes | 2.0e-06 | 0.25 |" in text
    assert "| astronaut | 4 | 2x2 | 68 / 68 | 5 7 | no | 3.0e-06 | 0 |" in text
    assert text.count("<!-- begin mllama-tiles -->") == 1

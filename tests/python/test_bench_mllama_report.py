"""The mllama benchmark's report (benchmarks/bench_mllama.py), on hand-made raw results: each row keeps its
fastest run, the speed-ups are taken against the Q8_0 mmproj (encode) and the Q8_0 / Q4_0 text models
(generation) at the same thread count, and the section and its plot are written."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_mllama  # type: ignore[import-not-found]  # noqa: E402


def _row(text: str, mmproj: str, encode_ms: list[float], gen_tps: list[float]) -> dict:
    return {"text": text, "mmproj": mmproj, "threads": 2, "text_mib": 100.0, "mmproj_mib": 200.0,
            "runs": [{"encode_ms": e, "prompt_tps": 10.0 * g, "gen_tps": g} for e, g in zip(encode_ms, gen_tps)]}


def test_report_keeps_the_fastest_run_and_ratios_to_the_stock_rows(tmp_path: Path) -> None:
    result = {"date": "2026-12-04", "cpu": "test CPU", "cpus": 2, "text_layers": 4, "n_gen": 32, "reps": 2,
              "load": [0.0, 1.0],
              "rows": [_row("q8_0", "q8_0", [200_000, 190_000], [10.0, 9.0]),
                       _row("q4_0", "q8_0", [195_000, 210_000], [16.0, 15.0]),
                       _row("s3d8", "s3d8", [140_000, 95_000], [30.0, 32.0])]}
    doc = tmp_path / "benchmarks.md"
    args = argparse.Namespace(doc=doc, work=tmp_path)
    bench_mllama.write_report(result, args)
    text = doc.read_text()
    lines = {li.split("|")[1].strip() + "/" + li.split("|")[2].strip(): li for li in text.splitlines()
             if li.startswith("| ") and not li.startswith("| text")}
    # S3D8: fastest encode 95 s against Q8_0's 190 s = 2.00x; generation 32 t/s against 10 (Q8_0) and 16 (Q4_0)
    assert lines["s3d8/s3d8"].endswith("| 95.0 | 320.0 | 32.0 | 2.00x | 3.20x | 2.00x |")
    assert lines["q8_0/q8_0"].endswith("| 190.0 | 100.0 | 10.0 | 1.00x | 1.00x | 0.62x |")
    assert "fastest of 2 runs" in text
    assert (tmp_path / "img" / "benchmarks-mllama.png").exists()


def test_ratios_without_a_stock_row_are_left_blank(tmp_path: Path) -> None:
    result = {"date": "2026-12-04", "cpu": "test CPU", "cpus": 2, "text_layers": 4, "n_gen": 32, "reps": 1,
              "load": [0.0, 1.0], "rows": [_row("s3d8", "f16", [100_000], [20.0])]}
    doc = tmp_path / "benchmarks.md"
    bench_mllama.write_report(result, argparse.Namespace(doc=doc, work=tmp_path))
    row = next(li for li in doc.read_text().splitlines() if li.startswith("| s3d8 |"))
    assert row.endswith("| 100.0 | 200.0 | 20.0 | - | - | - |")

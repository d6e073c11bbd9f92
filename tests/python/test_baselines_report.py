"""The baseline sweep's report (research/baselines_smollm2.py): Pareto lines, QAT rows, tables, plots."""

from __future__ import annotations

import json
from pathlib import Path

from research.baselines_smollm2 import load_qat, pareto_front, write_report

CONFIG = {"version": 1, "ctx": 512, "eval_tokens": 2048, "calib_tokens": 8192,
          "model": "SmolLM2-135M-Instruct (Q4_1 GGUF -> fp32)"}


def test_pareto_front_keeps_the_best_value_per_bit_budget() -> None:
    pts = [(3.5, 1.6), (2.1, 30.0), (2.7, 10.6), (3.1, 3.3), (2.5, 17.8), (3.25, 2.5), (4.1, 0.6), (3.7, 1.09)]
    assert pareto_front(pts) == [(2.1, 30.0), (2.5, 17.8), (2.7, 10.6), (3.1, 3.3), (3.25, 2.5), (3.5, 1.6),
                                 (3.7, 1.09), (4.1, 0.6)]
    # a point beaten by one with fewer bits is dropped; ties in value keep the cheaper one
    assert pareto_front([(3.0, 1.0), (2.0, 2.0), (2.5, 2.5), (4.0, 1.0), (1.0, 5.0)]) == [(1.0, 5.0), (2.0, 2.0),
                                                                                            (3.0, 1.0)]
    assert pareto_front([]) == []


def _entry(fid: str, family: str, method: str, bits: float, kl: float, ppl: float) -> dict:
    return {"id": fid, "family": family, "label": fid, "method": method, "bits_per_param": bits, "kl": kl,
            "kl_stderr": kl / 50, "ppl": ppl, "seconds_quantise": 1.0, "seconds_eval": 1.0}


def test_qat_rows_sit_next_to_their_format_only_when_the_eval_matches(tmp_path: Path) -> None:
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"config": {"ctx": 512, "eval_tokens": 2048, "model": CONFIG["model"]},
                                "results": [_entry("s3d8", "S3D8", "qat", 2.7, 0.9, 40.0)]}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"config": {"ctx": 256, "eval_tokens": 4096, "model": CONFIG["model"]},
                                 "results": [_entry("s3d8", "S3D8", "qat", 2.7, 0.5, 30.0)]}))
    (row,) = load_qat(same, None, CONFIG)
    assert row["comparable"] and row["method"] == "qat" and row["source"] == str(same)
    (row,) = load_qat(other, None, CONFIG)
    assert not row["comparable"]
    assert load_qat(tmp_path / "missing.json", None, CONFIG) == []

    data = {"config": CONFIG, "teacher": {"ppl": 17.2, "n_tokens": 2044, "n_params": 134_515_008},
            "results": [_entry("s3d8", "S3D8", "direct", 2.7, 8.7, 1e5), _entry("s3d8", "S3D8", "gptq", 2.7, 1.7, 84.0),
                        _entry("int8_g128", "INT", "direct", 3.14, 5.6, 900.0),
                        _entry("int8_g32", "INT", "gptq", 3.5, 1.67, 91.0)]}
    out = tmp_path / "report"
    out.mkdir()
    write_report(data, load_qat(same, None, CONFIG) + load_qat(other, None, CONFIG), [same, other], out, "## Findings")
    md = (out / "baselines.md").read_text()
    assert "| format | bits/param | KL direct | KL GPTQ | KL QAT | PPL direct | PPL GPTQ | PPL QAT |" in md
    assert "| s3d8 | 2.700 | 8.7000 ± 0.1740 | 1.7000 | 0.9000 ± 0.0180 | 1e+05 | 84.00 | 40.00 |" in md
    assert "| int8_g128 | 3.140 | 5.6000 ± 0.1120 | - | - | 900.00 | - | - |" in md
    assert "| s3d8 | 2.700 | 0.5000 | 30.00 |" in md  # the other eval's row: in the separate table
    assert md.index("| s3d8 | 2.700 | 8.7") < md.index("| int8_g128") < md.index("| int8_g32")  # sorted by bits
    for png in ("baselines_kl.png", "baselines_ppl.png"):
        assert (out / "img" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

"""The pure parts of benchmarks/bench_ik_kernels.py on hand-made output: the harness's JSON lines and
test-backend-ops' perf lines are parsed, rounds merge into medians, and the ik / S3D8 ratio is the median of per-round
ratios (each round's two processes run back to back), not the ratio of the medians. No timing is measured."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_ik_kernels as b  # type: ignore[import-not-found]  # noqa: E402


def _mm(tree: str, type_: str, round_: int, seconds: float, m: int = 1, k: int = 4096, n: int = 1024,
        threads: int = 1, bw: float | None = None) -> dict:
    weight_bytes = k * n * 3 // 8
    row = {"kind": "mul_mat", "tree": tree, "type": type_, "round": round_, "m": m, "k": k, "n": n, "threads": threads,
           "seconds": seconds, "gmacs": m * k * n / seconds / 1e9, "weight_bytes": weight_bytes,
           "weight_gbps": weight_bytes / seconds / 1e9}
    if bw is not None:
        row["bw_gbps"] = bw
    return row


def test_parse_harness_keeps_json_records_and_tags_them() -> None:
    text = ('{"kind": "bandwidth", "threads": 1, "gbps": 30.0, "mib": 1024}\n'
            "some warning from the library\n"
            '{"kind": "mul_mat", "type": "iq2_k", "m": 1, "k": 4096, "n": 1024, "threads": 1, "round": 0, '
            '"seconds": 0.0001, "gmacs": 41.9, "weight_bytes": 1245184, "weight_gbps": 12.4, "bw_gbps": 30.0}\n'
            "{not json\n")
    rows = b.parse_harness(text, "ik", 2)
    assert [r["kind"] for r in rows] == ["bandwidth", "mul_mat"]
    assert all(r["tree"] == "ik" and r["round"] == 2 for r in rows)  # the process's own round field is replaced


def test_parse_tbo_reads_gflops_and_strips_colours() -> None:
    out = ("  MUL_MAT(type_a=s3d8,type_b=f32,m=4096,n=512,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1):"
           "                 8 runs - 142857.25 us/run -  60.13 GFLOP/run - \x1b[1;34m420.90 GFLOPS\x1b[0m\n"
           "  MUL_MAT(type_a=q2_K,type_b=f32,m=4096,n=1,k=14336,bs=[1,1],nr=[1,1],per=[0,1,2,3],k_v=0,o=1):"
           "              1704 runs -   587.10 us/run - 117.44 MFLOP/run - \x1b[1;34m200.03 MFLOPS\x1b[0m\n")
    rows = b.parse_tbo(out)
    assert [(r["type"], r["n"], r["runs"]) for r in rows] == [("s3d8", 512, 8), ("q2_K", 1, 1704)]
    assert rows[0]["rate"] == 420.90 and rows[0]["unit"] == "GFLOPS"
    assert abs(rows[1]["rate"] - 0.20003) < 1e-9  # MFLOPS scaled to GFLOPS


def test_summarize_takes_median_seconds_and_bandwidth_fraction() -> None:
    rows = [_mm("ours", "s3d8", 0, 1e-4, bw=20.0), _mm("ours", "s3d8", 1, 3e-4, bw=10.0),
            _mm("ours", "s3d8", 2, 2e-4, bw=30.0), {"kind": "bandwidth", "threads": 1, "gbps": 30.0}]
    s = b.summarize(rows)[("ours", "s3d8", 1, 4096, 1024, 1)]
    assert s["seconds"] == 2e-4 and s["rounds"] == 3
    assert abs(s["gmacs"] - 4096 * 1024 / 2e-4 / 1e9) < 1e-9
    assert abs(s["bpw"] - 3.0) < 1e-12
    # per round: 15.7/20, 5.2/10, 7.9/30 GB/s -> fractions 0.786, 0.524, 0.262: the median is the round's, 0.524
    assert abs(s["bw_fraction"] - (4096 * 1024 * 3 / 8 / 3e-4 / 1e9) / 10.0) < 1e-12


def test_paired_ratio_is_the_median_of_per_round_ratios() -> None:
    # round 0 both slow (a neighbour's burst), round 1 both fast: the per-round ratios are 2.0, 2.0 and 1.0;
    # the ratio of the medians would be 3e-4 / 1e-4 = 3.0
    rows = [_mm("ours", "s3d8", 0, 8e-4), _mm("ik", "iq2_k", 0, 4e-4),
            _mm("ours", "s3d8", 1, 2e-4), _mm("ik", "iq2_k", 1, 1e-4),
            _mm("ours", "s3d8", 2, 3e-4), _mm("ik", "iq2_k", 2, 3e-4),
            _mm("ik", "iq2_k", 3, 1e-4)]  # a round without S3D8 has no pair and does not count
    r = b.paired_ratio(rows, ("ik", "iq2_k"), ("ours", "s3d8"), 1, 4096, 1024, 1)
    assert r == 2.0
    assert b.paired_ratio(rows, ("ik", "iq2_kl"), ("ours", "s3d8"), 1, 4096, 1024, 1) is None
    assert b.paired_ratio(rows, ("ik", "iq2_k"), ("ours", "s3d8"), 4, 4096, 1024, 1) is None


def test_fmt_ratio_marks_ik_faster_in_bold() -> None:
    assert b.fmt_ratio(1.234) == "**1.23x**"
    assert b.fmt_ratio(0.5) == "0.50x"
    assert b.fmt_ratio(None) == "-"


def test_report_has_both_thread_tables_and_the_ratio_columns() -> None:
    rows: list[dict] = [{"kind": "meta", "date": "2026-12-07", "cpu": "AMD EPYC", "cpus": 2, "load_before": [1.0, 1, 1],
                         "uptime_before": "up", "rounds": 1, "ik_source": "ik", "command": "python x.py"},
                        {"kind": "bandwidth", "threads": 1, "gbps": 30.0, "tree": "ours", "round": 0}]
    for t in (1, 2):
        rows += [_mm("ours", "s3d8", 0, 2e-4, threads=t, bw=30.0), _mm("ours", "q2_K", 0, 4e-4, threads=t, bw=30.0),
                 _mm("ik", "iq2_k", 0, 1e-4, threads=t, bw=30.0), _mm("ik", "iq2_k_r4", 0, 4e-4, threads=t, bw=30.0),
                 _mm("ik", "iq2_kl", 0, 2e-4, threads=t, bw=30.0), _mm("ik", "q2_K", 0, 2e-4, threads=t, bw=30.0)]
    rows.append({"kind": "meta_end", "load_after": [1.5, 1, 1], "uptime_after": "up", "seconds": 60})
    text = b.report(rows, None)
    assert "### 1 thread: GMAC/s" in text and "### 2 threads: GMAC/s" in text
    row = next(line for line in text.splitlines() if line.startswith("| 4096 x 1024 | 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[-4:] == ["**2.00x**", "0.50x", "1.00x", "2.00x"]  # IQ2_K, IQ2_K_R4, IQ2_KL / S3D8; Q2_K ik / ours

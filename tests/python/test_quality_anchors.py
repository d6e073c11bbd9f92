"""The pure parts of the anchors benchmark (benchmarks/quality_anchors.py), without building ik_llama.cpp or running
any tool: argument parsing, the variant-tensor rule and each project's override syntax, the GGUF directory reader
(ik_llama.cpp's own type ids, sizes checked against the offsets), the layout checks, the tools' output parsers, and
the report (markdown, plot, JSON round trip) from hand-made results."""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import quality_anchors as qa  # type: ignore[import-not-found]  # noqa: E402

Q8_0, F32, IQ2_S, IQ2_KL = 8, 0, 22, 157


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf(path: Path, tensors: list[tuple[str, tuple[int, ...], int, int]], alignment: int = 32) -> None:
    """A minimal GGUF v3: one metadata key (general.alignment, plus a numeric array to skip), then
    ``(name, shape, type id, data bytes)`` tensors laid out at aligned offsets, their data filled with the index."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 2)
    head += _gguf_string("general.alignment") + struct.pack("<II", 4, alignment)
    head += _gguf_string("tokenizer.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 1, 2, 3)
    offsets, off = [], 0
    for _, _, _, nbytes in tensors:
        offsets.append(off)
        off = -(-(off + nbytes) // alignment) * alignment
    for (name, shape, tid, _), o in zip(tensors, offsets):
        head += _gguf_string(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        head += struct.pack("<IQ", tid, o)
    head += b"\0" * (-len(head) % alignment)
    data = bytearray()
    for i, ((_, _, _, nbytes), o) in enumerate(zip(tensors, offsets)):
        data += b"\0" * (o - len(data)) + bytes([i + 1]) * nbytes
    path.write_bytes(head + bytes(data))


def _smollm2_like(path: Path, variant_type: int = IQ2_KL, variant_bytes: int = 2 * (2 + 86)) -> Path:
    write_gguf(path, [("token_embd.weight", (32, 4), Q8_0, 4 * 34),
                      ("blk.0.ffn_down.weight", (256, 2), variant_type, variant_bytes),
                      ("blk.0.ffn_up.weight", (32, 8), Q8_0, 8 * 34),
                      ("blk.0.ffn_norm.weight", (32,), F32, 128),
                      ("blk.1.ffn_down.weight", (256, 2), variant_type, variant_bytes)])
    return path


def test_extra_files_are_model_name_path() -> None:
    e = qa.parse_extra("smollm2:S3D8 GPTQ=.cache/main-job/x.gguf")
    assert (e.model, e.name, e.path) == ("smollm2", "S3D8 GPTQ", Path(".cache/main-job/x.gguf"))
    assert qa.parse_extra("gemma3:a=b=c.gguf").path == Path("b=c.gguf")  # the first '=' ends the name
    e = qa.parse_extra("gemma3:attn_output,ffn_down:S3D8 x=y.gguf")  # a spec with roles, then the name
    assert (e.model, e.name) == ("gemma3:attn_output,ffn_down", "S3D8 x")
    assert qa.parse_extra("gemma3:ffn_down:A=a.gguf").model == "gemma3"  # the default roles name the model alone
    for bad in ("smollm2=x.gguf", "smollm2:name", "llama:x=y.gguf", "smollm2:=y.gguf"):
        with pytest.raises(argparse.ArgumentTypeError):
            qa.parse_extra(bad)


def test_arguments_default_to_both_models_and_every_anchor() -> None:
    args = qa.build_parser().parse_args([])
    assert [m.key for m in args.models] == ["smollm2", "gemma3"] and args.threads == 2 and args.chunks == 24
    assert args.imatrix_chunks == 64 and args.extra == []
    assert args.ik_types == ["iq2_kl", "iq2_k", "iq2_ks", "iq2_s"]
    assert args.mainline_types == ["s3d8", "iq2_s", "iq2_m", "q2_k", "iq3_xxs"]
    args = qa.build_parser().parse_args(["--models", "gemma3", "--extra", "gemma3:A=a.gguf", "--extra",
                                         "smollm2:B=b.gguf", "--ik-types"])
    assert [m.key for m in args.models] == ["gemma3"] and [e.name for e in args.extra] == ["A", "B"]
    assert args.ik_types == []
    for bad in (["--models", "llama"], ["--models", "gemma3:attn output"]):
        with pytest.raises(SystemExit):
            qa.build_parser().parse_args(bad)


def test_model_specs_name_their_roles_and_folders() -> None:
    g = qa.parse_model_spec("gemma3")
    assert (g.key, g.folder, g.roles) == ("gemma3", "gemma3", ("ffn_down",))
    both = qa.parse_model_spec("gemma3:attn_output,ffn_down")
    assert both.key == "gemma3:attn_output,ffn_down" and both.folder == "gemma3-attn_output+ffn_down"
    assert both.base == "gemma3" and both.title == "Gemma-3-270M"
    assert both.is_variant("blk.3.attn_output.weight") and not g.is_variant("blk.3.attn_output.weight")
    assert qa.parse_model_spec("smollm2:ffn_down") == qa.MODELS["smollm2"]


def test_reproduce_command_quotes_arguments() -> None:
    cmd = qa.reproduce_command(["--extra", "smollm2:S3D8 GPTQ=x.gguf"])
    assert cmd == ".venv/bin/python benchmarks/quality_anchors.py --extra 'smollm2:S3D8 GPTQ=x.gguf'"


def test_variant_tensors_and_override_syntax_of_each_project() -> None:
    s, g = qa.MODELS["smollm2"], qa.parse_model_spec("gemma3:attn_output,ffn_down")
    assert s.is_variant("blk.12.ffn_down.weight") and not s.is_variant("blk.12.ffn_down.bias")
    assert not s.is_variant("blk.12.attn_output.weight") and g.is_variant("blk.3.attn_output.weight")
    assert not g.is_variant("blk.3.ffn_down_exps.weight") and not g.is_variant("output.weight")
    assert qa.tensor_type_args("mainline", {s.regex: "IQ2_S", qa.exact_regex("blk.0.ffn_down.weight"): "iq3_s"}) == [
        "--tensor-type", r"^blk\.[0-9]+\.ffn_down\.weight$=iq2_s",
        "--tensor-type", r"^blk\.0\.ffn_down\.weight$=iq3_s"]
    assert qa.tensor_type_args("ik", {g.regex: "iq2_kl"}) == [
        "--custom-q", r"^blk\.[0-9]+\.(attn_output|ffn_down)\.weight$=iq2_kl"]
    # ik splits --custom-q at ',' and each rule at its first '=': the regexes must hold neither
    assert "," not in g.regex and "=" not in g.regex


def test_gguf_reader_names_types_per_project_and_checks_sizes(tmp_path: Path) -> None:
    path = _smollm2_like(tmp_path / "ik.gguf")
    gf = qa.read_gguf(path, "ik")
    t = gf.by_name()
    assert t["blk.0.ffn_down.weight"].type_name == "IQ2_KL" and t["blk.0.ffn_down.weight"].nbytes == 176
    assert t["token_embd.weight"].type_name == "Q8_0" and t["blk.0.ffn_norm.weight"].type_name == "F32"
    assert qa.tensor_digest(gf, t["blk.0.ffn_up.weight"]) != qa.tensor_digest(gf, t["token_embd.weight"])
    lay = qa.layout(gf, qa.MODELS["smollm2"])
    assert lay.variant_types == {"IQ2_KL": 2} and lay.n_variant == 2
    assert lay.variant_bpw == pytest.approx(8 * 176 / 512)  # 2.6875 bpw + 2 bytes per row
    assert lay.outside_types == {"F32": 1, "Q8_0": 2}
    # mainline's table does not know id 157: the name says so and the size comes from the offsets
    assert qa.read_gguf(path, "mainline").by_name()["blk.0.ffn_down.weight"].type_name == "type157"
    # a size the type table contradicts is an error, not a silent wrong bpw
    bad = _smollm2_like(tmp_path / "bad.gguf", variant_bytes=2 * 86 + 64)
    with pytest.raises(ValueError, match="IQ2_KL"):
        qa.read_gguf(bad, "ik")
    (tmp_path / "not.gguf").write_bytes(b"GGML" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF"):
        qa.read_gguf(tmp_path / "not.gguf", "ik")


def test_layout_check_names_each_problem(tmp_path: Path) -> None:
    m = qa.MODELS["smollm2"]
    ref = qa.read_gguf(_smollm2_like(tmp_path / "ref.gguf", IQ2_S, 2 * 82), "mainline")
    ok = qa.read_gguf(_smollm2_like(tmp_path / "ok.gguf", IQ2_S, 2 * 82), "mainline")
    assert qa.check_layout(ok, m, None, ref) == []
    assert qa.check_layout(ok, m, {"blk.0.ffn_down.weight": "IQ2_S", "blk.1.ffn_down.weight": "IQ2_S"}, ref) == []
    assert qa.check_layout(ok, m, {"blk.0.ffn_down.weight": "IQ3_S", "blk.1.ffn_down.weight": "IQ2_S"}, ref) == [
        "blk.0.ffn_down.weight is IQ2_S, expected IQ3_S"]
    assert qa.outside_digests(ok, m) == qa.outside_digests(ref, m)
    other = tmp_path / "other.gguf"
    write_gguf(other, [("token_embd.weight", (32, 4), F32, 512), ("blk.0.ffn_down.weight", (256, 2), IQ2_S, 164)])
    problems = qa.check_layout(qa.read_gguf(other, "mainline"), m, None, ref)
    assert problems[0].startswith("tensor set differs from ref.gguf")
    assert "token_embd.weight is F32 outside the variant set, Q8_0 in ref.gguf" in problems


def test_dry_run_and_bench_output_parsers() -> None:
    out = ("[   8/ 272] blk.0.ffn_down.weight                - [  1536,    576,      1,      1], type =    f16, "
           "size =     1.69 MiB ->     0.36 MiB (iq3_s)\n"
           "[  10/ 272] blk.0.ffn_norm.weight                - [   576,      1,      1,      1], type =    f32, "
           "size =    0.002 MiB\n"
           "[  35/ 272] blk.3.ffn_down.weight                - [  1536,    576,      1,      1], type =    f16, "
           "size =     1.69 MiB ->     0.27 MiB (iq2_s)\n")
    assert qa.parse_dry_run(out) == {"blk.0.ffn_down.weight": "IQ3_S", "blk.3.ffn_down.weight": "IQ2_S"}
    warn = ("llama_tensor_get_type: blk.0.attn_output.weight             - applying manual override: q8_0 -> s3d8\n"
            "warning: blk.0.attn_output.weight             - 640 rows of 1024 are too few to hold a s3d8 slice "
            "(required for type s3d8) -> falling back to    q8_0\n")
    assert qa.parse_fallbacks(warn) == {"blk.0.attn_output.weight": "640 rows of 1024 are too few to hold a s3d8 "
                                        "slice (required for type s3d8), wrote q8_0"}
    bench = json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 612.5}, {"n_prompt": 0, "n_gen": 128, "avg_ts": 98.25}])
    assert qa.parse_bench(bench) == (612.5, 98.25)
    pp, tg = qa.parse_bench("[]")
    assert math.isnan(pp) and math.isnan(tg)


def _row(label: str, project: str, qtype: str, bpw: float, kld: float, error: str = "") -> dict:
    row = qa.Row(label, project, qtype, f"x/{label}.gguf", variant_types={label.split()[0]: 30}, variant_bpw=bpw,
                 file_mib=119.5, file_bpw=7.3, ppl=30.0, ppl_err=1.3, kld=kld, kld_err=0.009, same_top=80.0,
                 pp512=600.0, tg128=100.0, quant_s=4.2, ppl_s=40.0 if project == "ik" else 100.0, bench_load=0.5,
                 outside_same_as_project=True,
                 outside_same_as_mainline=project != "ik", error=error)
    return vars(row)


def _results() -> dict:
    rows = [_row("S3D8", "mainline", "s3d8", 2.6875, 0.476), _row("IQ2_KL", "ik", "iq2_kl", 2.6875, 0.407),
            _row("IQ2_S", "mainline", "iq2_s", 2.5625, 0.480), _row("IQ2_M mix", "mainline", "iq2_m", 2.75, 0.41),
            _row("S3D8 GPTQ", "extra", "", 2.6875, 0.385), _row("IQ2_KS", "ik", "iq2_ks", float("nan"), float("nan"),
                                                                 error="ik llama-perplexity failed")]
    model = {"key": "smollm2", "title": "SmolLM2-135M-Instruct", "variant_regex": qa.MODELS["smollm2"].regex,
             "n_variant_tensors": 30, "f16": {"path": "f16.gguf", "mib": 258.3,
                                              "rows": [{"project": "mainline", "ppl": 21.87, "ppl_err": 0.94,
                                                        "pp512": 500.0, "tg128": 60.0}]},
             "iq2_m_types": {"blk.0.ffn_down.weight": "IQ3_S", "blk.1.ffn_down.weight": "IQ2_S"},
             "notes": ["f16 file: the main job's"], "rows": rows, "times": {"imatrix:ik": 398.7, "quant:x": 1.0}, "phases": {"quantise": 12.0},
             "failures": ["smollm2 ik IQ2_KS: ik llama-perplexity failed"]}
    return {"version": 1, "date": "2026-12-06 10:00", "command": qa.reproduce_command([]),
            "machine": {"cpu": "Test CPU", "cores": 2, "threads": 2, "load_before": [1.0, 1.0, 1.0],
                        "load_after": [2.0, 2.0, 2.0]},
            "settings": {"chunks": 24, "ctx": 512, "imatrix_chunks": 64}, "ik": {"source": "ik sdist"},
            "mainline": {"source": "ours"}, "models": [model, dict(model, key="gemma3", title="Gemma-3-270M")],
            "phases": {"ik build (or check)": 3.0}, "seconds": 100.0}


def test_report_tables_sort_by_kld_and_name_failures(tmp_path: Path) -> None:
    md = qa.render_markdown(_results())
    assert "**Machine:** Test CPU (2 cores), 2 threads" in md
    assert ".venv/bin/python benchmarks/quality_anchors.py" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[1].startswith("| S3D8 GPTQ (extra)") and table[2].startswith("| IQ2_KL (ik_llama.cpp)")
    assert table[6].startswith("| IQ2_KS (ik_llama.cpp)") and "failed: ik llama-perplexity failed" in table[6]
    assert "| 0.4070 ± 0.0090 |" in table[2] and "| 2.6875 |" in table[2]
    assert "(IQ2_S ×1, IQ3_S ×1)" in md and "- smollm2 ik IQ2_KS: ik llama-perplexity failed" in md
    assert md.count("## ") == 2
    assert ("Recorded step times (wall, when done): ik imatrix 399 s, mainline llama-perplexity 100 s per file "
            "(median of 3), ik llama-perplexity 40 s per file (median of 1).") in md
    assert "| 100.0 | 0.5 | 4.2 |" in table[2]


def test_results_round_trip_through_strict_json_and_plot(tmp_path: Path) -> None:
    results = _results()
    path = tmp_path / "r.json"
    text = json.dumps(qa._json_safe(results))
    assert "NaN" not in text
    path.write_text(text)
    back = qa.load_results(path)
    ks = back["models"][0]["rows"][5]
    assert math.isnan(ks["kld"]) and math.isnan(ks["variant_bpw"]) and ks["outside_same_as_mainline"] is False
    assert qa.render_markdown(back) == qa.render_markdown(results)
    png = tmp_path / "p.png"
    qa.plot(back, png)
    assert png.read_bytes()[:4] == b"\x89PNG" and not list(tmp_path.glob(".*.tmp*"))
    args = qa.build_parser().parse_args(["--json", str(path), "--plot", str(tmp_path / "q.png"), "--markdown",
                                         str(tmp_path / "q.md"), "--report-only"])
    assert qa.main(["--json", str(path), "--plot", str(args.plot), "--markdown", str(args.markdown),
                    "--report-only"]) == 0
    assert (tmp_path / "q.md").read_text() == qa.render_markdown(back)


def test_perplexity_base_runs_of_both_projects() -> None:
    ik = qa.parse_perplexity("[1]17.2,[2]19.9,\nFinal estimate: PPL over 24 chunks for n_ctx=512 = 21.8711 +/- 0.94512\n",
                             kld=False)
    assert (ik.ppl, ik.ppl_err) == (21.8711, 0.94512)
    ours = qa.parse_perplexity("Final estimate: PPL = 21.8736 +/- 0.94529\n", kld=False)
    assert (ours.ppl, ours.ppl_err) == (21.8736, 0.94529)
    cmp = qa.parse_perplexity("Mean PPL(Q)                   :  29.720010 ±   1.299769\n"
                              "Mean    KLD:   0.476146 ±   0.008623\nSame top p: 71.340 ± 0.578 %\n", kld=True)
    assert (cmp.ppl, cmp.kld, cmp.same_top) == (29.72001, 0.476146, 71.34)
    with pytest.raises(ValueError):
        qa.parse_perplexity("nothing", kld=False)


def test_summary_puts_s3d8_against_its_anchors() -> None:
    rows = [r for r in _results()["models"][0]["rows"] if not r["error"]]
    lines = qa.summary_lines(rows)
    assert lines[0] == ("- S3D8 + imatrix: KLD 0.4760 against IQ2_KL (ik_llama.cpp, the exact-size peer) 0.4070: "
                        "**1.17×** at 2.6875 vs 2.6875 bits")
    assert lines[1].startswith("- S3D8 + imatrix: KLD 0.4760 against IQ2_S + imatrix (mainline) 0.4800: **0.99×**")
    assert lines[2].startswith("- S3D8 + imatrix: KLD 0.4760 against IQ2_M's types (mainline) 0.4100")
    assert len(lines) == 4 and lines[3] == ""  # no ik IQ2_S in the rows: no cross-check line
    assert qa.summary_lines([r for r in rows if r["qtype"] != "s3d8"]) == []


def test_bench_keeps_the_fastest_try() -> None:
    nan = float("nan")
    tries = [{"pp512": 600.0, "tg128": 1.0, "load1": 3.5, "quiet": False},
             {"pp512": 650.0, "tg128": nan, "load1": 0.9, "quiet": True},
             {"pp512": 120.0, "tg128": 95.0, "load1": 2.0, "quiet": True}]
    assert qa.best_of(tries) == {"pp512": 650.0, "tg128": 95.0, "load1": 0.9, "quiet": 2}
    assert math.isnan(qa.best_of([{"pp512": nan, "tg128": nan, "load1": 1.0}])["pp512"])
    assert qa.wait_quiet(0.0) is False


def test_runnable_others_counts_busy_processes() -> None:
    """Two spinning processes are always running or runnable (state R), whatever else the machine does: the count
    of other runnable processes sees at least both (it is what the benchmark waits on before it times)."""
    import subprocess
    import sys
    import time

    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        counts = [qa.runnable_others() for _ in range(5)]
    finally:
        for p in spin:
            p.kill()
            p.wait()
    assert min(counts) >= 2, counts
    assert qa.build_parser().parse_args([]).bench_tries == 3

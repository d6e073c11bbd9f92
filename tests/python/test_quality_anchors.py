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
    assert args.mainline_types == ["iq2_s", "iq2_m", "q2_k", "iq3_xxs"]
    assert args.s3d8_rows == ["iw1", "last", "gptq", "mix", "mix-noim", "noim"]
    assert args.variants == ["t2", "t1", "pert"] and args.nice == 10
    assert qa.build_parser().parse_args(["--s3d8-rows", "--variants", "t2"]).s3d8_rows == []
    with pytest.raises(SystemExit):
        qa.build_parser().parse_args(["--variants", "t3"])
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


def _row(label: str, project: str, qtype: str, bpw: float, kld: float, error: str = "", group: str = "",
         variant: str = "", sha256: str = "") -> dict:
    row = qa.Row(label, project, qtype, f"x/{label}.gguf", variant_types={label.split()[0]: 30}, variant_bpw=bpw,
                 file_mib=119.5, file_bpw=7.3, ppl=30.0, ppl_err=1.3, kld=kld, kld_err=0.009, same_top=80.0,
                 pp512=600.0, tg128=100.0, quant_s=4.2, ppl_s=40.0 if project == "ik" else 100.0, bench_load=0.5,
                 outside_same_as_project=True,
                 outside_same_as_mainline=project != "ik", error=error, group=group, variant=variant,
                 sha256=sha256 or f"{label}-{variant}")
    return vars(row)


def _s3d8(key: str, klds: dict[str, float], bpw: float = 2.6875, **kw) -> list[dict]:
    label = qa.S3D8_ROWS[key].label
    return [_row(label, "mainline", "s3d8", bpw, k, group=key, variant=v, **kw) for v, k in klds.items()]


def _results() -> dict:
    rows = [*_s3d8("iw1", {"t2": 0.476, "t1": 0.476, "pert": 0.562}),
            _row("IQ2_KL", "ik", "iq2_kl", 2.6875, 0.407),
            _row("IQ2_S", "mainline", "iq2_s", 2.5625, 0.480), _row("IQ2_M mix", "mainline", "iq2_m", 2.75, 0.41),
            _row("S3D8 GPTQ", "extra", "", 2.6875, 0.385), _row("IQ2_KS", "ik", "iq2_ks", float("nan"), float("nan"),
                                                                 error="ik llama-perplexity failed")]
    rows[1]["sha256"] = rows[0]["sha256"]  # t1 gave t2's bytes
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
            "settings": {"chunks": 24, "ctx": 512, "imatrix_chunks": 64, "variants": ["t2", "t1", "pert"]},
            "ik": {"source": "ik sdist"},
            "mainline": {"source": "ours"}, "models": [model, dict(model, key="gemma3", title="Gemma-3-270M")],
            "phases": {"ik build (or check)": 3.0}, "seconds": 100.0}


def test_report_tables_sort_by_kld_and_name_failures(tmp_path: Path) -> None:
    md = qa.render_markdown(_results())
    assert "**Machine:** Test CPU (2 cores), 2 threads" in md
    assert ".venv/bin/python benchmarks/quality_anchors.py" in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert table[1].startswith("| S3D8 GPTQ (extra)") and table[2].startswith("| IQ2_KL (ik_llama.cpp)")
    assert table[5].startswith("| S3D8 iw1 (mainline; worst of 3: pert)") and "| 0.5620 ± 0.0090 |" in table[5]
    assert table[6].startswith("| IQ2_KS (ik_llama.cpp)") and "failed: ik llama-perplexity failed" in table[6]
    assert "| 0.4070 ± 0.0090 |" in table[2] and "| 2.6875 |" in table[2]
    assert "(IQ2_S ×1, IQ3_S ×1)" in md and "- smollm2 ik IQ2_KS: ik llama-perplexity failed" in md
    assert md.count("\n## ") == 3  # the targets and the two models
    assert ("Recorded step times (wall, when done): ik imatrix 399 s, mainline llama-perplexity 100 s per file "
            "(median of 4), ik llama-perplexity 40 s per file (median of 1).") in md
    assert "| 100.0 | 0.5 | 4.2 |" in table[2]
    # the S3D8 variants, their worst case, the identical files and the ratios
    assert "| S3D8 iw1 | 2.6875 | 0.4760 | 0.4760 | 0.5620 | **0.5620** (pert) | 0.4760 → 0.5620 |" in md
    assert "- Same bytes, measured once: S3D8 iw1 (t2), S3D8 iw1 (t1)" in md
    assert "| S3D8 iw1 | 2.6875 | 0.5620 | 1.17× | 1.38× | 1.37× |" in md
    assert "÷ IQ2_S (0.4800 at 2.5625 bpw)" in md and "÷ Q2_K" not in md  # no Q2_K row: no column
    assert "*Note:*" not in md
    assert "*Note:* restarted once.\n" in qa.render_markdown(dict(_results(), run_notes=["restarted once."]))


def test_results_round_trip_through_strict_json_and_plot(tmp_path: Path) -> None:
    results = _results()
    path = tmp_path / "r.json"
    text = json.dumps(qa._json_safe(results))
    assert "NaN" not in text
    path.write_text(text)
    back = qa.load_results(path)
    ks = back["models"][0]["rows"][-1]
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


def test_summary_cross_checks_the_two_iq2_s() -> None:
    rows = [r for r in _results()["models"][0]["rows"] if not r["error"]]
    assert qa.summary_lines(rows) == []  # no ik IQ2_S in the rows: no cross-check line
    rows.append(_row("IQ2_S", "ik", "iq2_s", 2.5625, 0.479))
    assert qa.summary_lines(rows)[0].startswith("- Cross-check: IQ2_S made and measured by mainline 0.4800, by "
                                                "ik_llama.cpp 0.4790")


def test_variant_perturbation_moves_every_entry_by_its_fixed_sign(tmp_path: Path) -> None:
    import numpy as np

    from anchors import variants  # type: ignore[import-not-found]

    v = np.concatenate([np.array([1.0, 2.5, 1e-30, 3e5, 0.0, -7.25], dtype=np.float32),
                        np.random.default_rng(1).random(200, dtype=np.float32) + 0.1])
    a, b = variants.perturbed(v, np.random.default_rng(7)), variants.perturbed(v, np.random.default_rng(7))
    assert a.dtype == np.float32 and np.array_equal(a, b)  # the seed fixes the signs
    rel = (a.astype(np.float64) - v) / np.where(v == 0, 1, v)
    assert np.all(np.abs(np.abs(rel[v != 0]) - 1e-6) < 1e-7) and a[4] == 0  # each nonzero entry moves by 1e-6
    assert np.all(a[v != 0] != v[v != 0])
    signs = np.sign(rel[v != 0])
    assert set(signs) == {-1.0, 1.0}
    # an imatrix file: in_sum2 and in_sum move, counts stay; the same seed gives the same bytes
    gguf = pytest.importorskip("gguf")
    src = tmp_path / "im.gguf"
    w = gguf.GGUFWriter(str(src), arch="imatrix")
    w.add_type("imatrix")
    rng = np.random.default_rng(0)
    sums = {n: rng.random(64, dtype=np.float32) + 0.5 for n in ("blk.0.ffn_down.weight", "blk.1.ffn_down.weight")}
    for n, x in sums.items():
        w.add_tensor(f"{n}.in_sum2", x)
        w.add_tensor(f"{n}.in_sum", x - 0.75)
        w.add_tensor(f"{n}.counts", np.array([10.0], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    n = variants.perturb_imatrix(src, tmp_path / "p1.gguf", seed=3)
    variants.perturb_imatrix(src, tmp_path / "p2.gguf", seed=3)
    assert n == 4 * 64 and (tmp_path / "p1.gguf").read_bytes() == (tmp_path / "p2.gguf").read_bytes()
    before = {t.name: np.array(t.data) for t in gguf.GGUFReader(src).tensors}
    after = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / "p1.gguf").tensors}
    for name, x in before.items():
        if name.endswith(".counts"):
            assert np.array_equal(after[name], x)
        else:
            assert np.all(after[name] != x)
            assert np.allclose(after[name], x, rtol=1.2e-6, atol=0)
    with pytest.raises(ValueError, match="no .in_sum2"):
        variants.perturb_imatrix(tmp_path / "p1.gguf" if False else _no_sums(tmp_path, gguf), tmp_path / "x.gguf")
    assert variants.last_block(["blk.2.ffn_down.weight", "blk.29.ffn_down.weight", "output.weight"]) == 29


def _no_sums(tmp_path: Path, gguf) -> Path:
    import numpy as np

    path = tmp_path / "plain.gguf"
    w = gguf.GGUFWriter(str(path), arch="x")
    w.add_tensor("a.weight", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_worst_case_over_variants_and_the_targets() -> None:
    from anchors import targets, variants

    group = _s3d8("last", {"t2": 0.4271, "t1": 0.4271, "pert": 0.4292})
    s = variants.worst_case(group)
    assert s["worst"]["variant"] == "pert" and s["best"]["kld"] == 0.4271 and s["complete"] and s["n"] == 3
    failed = [dict(group[0]), dict(group[1]), dict(group[2], kld=float("nan"), error="llama-quantize failed")]
    s = variants.worst_case(failed)
    assert not s["complete"] and s["worst"]["kld"] == 0.4271  # never a worst case from a partial set
    assert variants.worst_case([dict(group[0], error="x", kld=float("nan"))])["worst"] is None

    def model(title: str, last: dict[str, float], gptq: dict[str, float], mix: dict[str, float]) -> dict:
        return {"title": title, "rows": [
            _row("IQ2_S", "mainline", "iq2_s", 2.5625, 0.480), _row("Q2_K", "mainline", "q2_k", 2.625, 0.555),
            _row("IQ2_KL", "ik", "iq2_kl", 2.6979, 0.406), *_s3d8("last", last), *_s3d8("gptq", gptq),
            *_s3d8("mix", mix, bpw=2.72)]}

    m1 = model("A", {"t2": 0.40, "t1": 0.41, "pert": 0.43}, {"t2": 0.37, "t1": 0.38, "pert": 0.381},
               {"t2": 0.47, "t1": 0.47, "pert": 0.49})
    m2 = model("B", {"t2": 0.40, "t1": 0.40, "pert": 0.40}, {"t2": 0.30, "t1": 0.36, "pert": 0.30},
               {"t2": 0.40, "t1": 0.40, "pert": 0.40})
    lines = targets.target_lines([m1, m2])
    assert len(lines) == len(targets.TARGETS) == 5
    # 0.43 > 0.9 x 0.48 = 0.432? no: 0.43 <= 0.432 passes on A, 0.40 on B
    assert lines[0].startswith("- **PASS**: S3D8 + last-layer X^T X ≤ 0.9 × IQ2_S + imatrix: A: 0.4300 (worst: pert) "
                               "vs 0.9 × 0.4800 = 0.4320, 0.90× at 2.6875 vs 2.5625 bpw (holds)")
    assert lines[1].startswith("- **PASS**: S3D8 + last-layer X^T X ≤ Q2_K + imatrix")
    assert lines[2].startswith("- **PASS**: S3D8 GPTQ") and "A: 0.3810 (worst: pert)" in lines[2]
    assert lines[3].startswith("- **FAIL** (goal): S3D8 GPTQ")  # 0.381 > 0.9 x 0.406 on A
    # matched bits: mainline's stock hull is IQ2_S (2.5625, 0.480) - Q2_K (2.625, 0.555) lies above it - and no
    # larger stock row here, so at 2.72 bpw the anchor stays IQ2_S's own KLD ("extrapolated")
    assert lines[4].startswith("- **FAIL**: S3D8 default mix")
    assert ("B: 0.4000 (worst: t2) vs 0.4800, 0.83× at 2.7200 vs 2.5625 bpw; at matched bits (2.7200 bpw, mainline's "
            "stock hull extrapolated beyond its last point): 0.4800, 0.83× (holds)") in lines[4]
    assert ("A: 0.4900 (worst: pert) vs 0.4800, 1.02× at 2.7200 vs 2.5625 bpw; at matched bits (2.7200 bpw, "
            "mainline's stock hull extrapolated beyond its last point): 0.4800, 1.02× (does not hold)") in lines[4]
    # with IQ3_XXS (3.0625, 0.26) the hull runs IQ2_S - IQ3_XXS: at 2.72 bpw 0.48 - 0.22 * 0.1575 / 0.5 = 0.41070
    for m in (m1, m2):
        m["rows"].append(_row("IQ3_XXS", "mainline", "iq3_xxs", 3.0625, 0.260))
    lines = targets.target_lines([m1, m2])
    assert "B: 0.4000 (worst: t2) vs 0.4800" in lines[4] and "between 2.5625 and 3.0625 bpw): 0.4107, 0.97× (holds)" in lines[4]
    assert lines[4].startswith("- **FAIL**: S3D8 default mix")  # A: 0.49 > 0.4107
    assert targets.stock_hull(m1["rows"]) == [(2.5625, 0.480), (3.0625, 0.260)]
    m2["rows"] = [dict(r, kld=0.395) if r.get("group") == "mix" else r for r in m2["rows"]]
    assert "0.3950 (worst: t2)" in targets.target_lines([m2])[4] and targets.target_lines([m2])[4].startswith("- **PASS**")
    for m in (m1, m2):
        m["rows"] = [r for r in m["rows"] if r["qtype"] != "iq3_xxs"]
    m2["rows"] = [r for r in m2["rows"] if r.get("group") != "gptq" or r["variant"] != "t1"] + [
        dict(_s3d8("gptq", {"t1": float("nan")})[0], error="failed")]
    assert targets.target_lines([m1, m2])[2].startswith("- **NOT DETERMINED**: S3D8 GPTQ")
    assert "B: 0.3000 (worst: t2) vs 0.4060" in targets.target_lines([m1, m2])[2]
    assert "(a variant failed: no worst case)" in targets.target_lines([m1, m2])[2]
    assert targets.target_lines([{"title": "C", "rows": []}])[0] == (
        "- **NOT DETERMINED**: S3D8 + last-layer X^T X ≤ 0.9 × IQ2_S + imatrix: C: not measured")


def test_s3d8_rows_made_once_show_one_file() -> None:
    from anchors import targets

    rows = [_row("S3D8 iw1, no imatrix", "mainline", "s3d8", 2.6875, 0.506, group="noim")]
    assert targets.variant_table(rows, ["t2", "t1", "pert"])[2] == (
        "| S3D8 iw1, no imatrix | 2.6875 | – | – | – | 0.5060 (one file) | – |")
    shown = targets.display_rows(rows)
    assert shown[0]["worst_of"] == "" and qa.row_name(shown[0]) == "S3D8 iw1, no imatrix (mainline)"


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


def test_xtx_variant_perturbs_every_entry_and_the_last_layer_is_a_subset(tmp_path: Path) -> None:
    import numpy as np

    from anchors import variants
    from gguf_s3d8 import xtx

    rng = np.random.default_rng(0)
    mats, dims, weights = {}, {}, {}
    for b in range(3):
        x = rng.standard_normal((40, 8)).astype(np.float32)
        mats[f"blk.{b}.ffn_down.weight.xtx"] = xtx.pack_lower(x.T @ x)
        dims[f"blk.{b}.ffn_down.weight.xtx"] = 8
        weights[f"blk.{b}.ffn_down.weight"] = (f"blk.{b}.ffn_down.weight.xtx", "")
    src = tmp_path / "xtx.gguf"
    xtx.write_xtx(src, xtx.XtxFile(mats, dims, {m: 40 for m in mats}, weights, ["train.txt"], "m.gguf"))
    assert variants.perturb_xtx(src, tmp_path / "p.gguf", seed=5) == 3 * 36
    variants.perturb_xtx(src, tmp_path / "q.gguf", seed=5)
    assert (tmp_path / "p.gguf").read_bytes() == (tmp_path / "q.gguf").read_bytes()  # a fixed seed
    a, p = xtx.read_xtx(src), xtx.read_xtx(tmp_path / "p.gguf")
    for w in weights:
        m, mp = a.matrix(w), p.matrix(w)
        assert np.array_equal(mp, mp.T)  # still exactly symmetric
        nz = m != 0
        assert np.all(mp[nz] != m[nz]) and np.allclose(mp, m, rtol=1.2e-6, atol=0)
    assert a.tokens == p.tokens and a.weights == p.weights
    names = list(weights)
    last = [n for n in names if n.startswith(f"blk.{variants.last_block(names)}.")]
    assert variants.xtx_subset(tmp_path / "p.gguf", tmp_path / "last.gguf", last) == ["blk.2.ffn_down.weight"]
    sub = xtx.read_xtx(tmp_path / "last.gguf")
    assert list(sub.matrices) == ["blk.2.ffn_down.weight.xtx"]
    assert np.array_equal(sub.matrix("blk.2.ffn_down.weight"), p.matrix("blk.2.ffn_down.weight"))
    with pytest.raises(ValueError, match="no X\\^T X for blk.7"):
        variants.xtx_subset(src, tmp_path / "x.gguf", ["blk.7.ffn_down.weight"])


def test_report_says_how_each_variant_was_made() -> None:
    from anchors import report

    results = _results()
    results["models"][0]["variants"] = {
        "t2": {"command": f"{qa.ROOT}/build/host/bin/llama-imatrix -t 2 -o {qa.ROOT}/.cache/q/.imatrix-t2.tmp.gguf "
                          f"--save-xtx {qa.ROOT}/.cache/q/.xtx-t2.tmp.gguf --xtx-include ffn_down", "seconds": 310.2,
               "same_imatrix_as_before": True},
        "derived:imatrix-pert.gguf": {"how": "t2 imatrix, perturbed"},
        "derived:xtx-last-t2.gguf": {"how": "the matrices of blk.29.ffn_down.weight (subset of xtx-t2.gguf)"},
        "t2-seed": {"from": ".cache/main-job/imatrix.gguf"}}
    lines = report.variant_notes(results, results["models"][0])
    assert lines == [
        "- `t2`: `build/host/bin/llama-imatrix -t 2 -o .cache/q/imatrix-t2.gguf --save-xtx .cache/q/xtx-t2.gguf "
        "--xtx-include ffn_down` (310 s, its imatrix byte-identical to the one made before)",
        "- `pert`: t2 imatrix, perturbed",
        "- last-layer X^T X: the matrices of blk.29.ffn_down.weight (subset of xtx-VARIANT.gguf) (written with the "
        "Python module, not by `--xtx-last-layer`), one file per variant",
        "- before the X^T X pass, t2's imatrix was the main job's (.cache/main-job/imatrix.gguf)"]

"""``convert.gptq_pipeline`` (GPTQ in C in one command, ``docs/convert.md``): the pass planner, the option checks
(the module's and the converter's ``--calibration-text``), and one small run on SmolLM2: its output is the bytes of
``llama-quantize --imatrix --hessian`` run by hand with the same files, and ``--sequential`` changes the X^T X of
every pass but the first (which runs on the f16 model, as the one-pass collection does).

The end-to-end test uses the binaries of ``$S3D8_BIN_DIR`` or ``build/host/bin`` and is skipped (with the reason)
when they lack ``--save-xtx`` / ``--hessian``; it puts the ffn_down of blocks 0-5 into S3D8 (GPTQ) and collects
on 2 x 256 tokens, in two passes of three blocks (4 llama-quantize and 3 llama-imatrix runs; 10.4 min for the whole
file, the SmolLM2 f16 conversion included, on 2 shared cores at load 6-8, 2026-12-07: not yet timed on an idle
machine).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from convert import gptq_pipeline as gp
from convert.to_gguf import main as convert_main
from gguf_s3d8 import xtx as xtx_file

MIB = 1 << 20


# ---------------------------------------------------------------------------------------------------- the planner


def test_plan_groups_consecutive_blocks_under_the_budget() -> None:
    k = 1536
    one = gp.sums_bytes(k)
    assert one == 4 * k * (k + 1)
    passes = gp.plan_passes([[k]] * 30, 6 * one)
    assert [(p.first, p.last) for p in passes] == [(0, 5), (6, 11), (12, 17), (18, 23), (24, 29)]
    assert all(p.bytes == 6 * one for p in passes)
    # just under six blocks' worth: five per pass
    assert [(p.first, p.last) for p in gp.plan_passes([[k]] * 12, 6 * one - 1)] == [(0, 4), (5, 9), (10, 11)]
    # everything fits: one pass
    assert [(p.first, p.last) for p in gp.plan_passes([[k]] * 30, 1 << 40)] == [(0, 29)]


def test_plan_respects_blocks_per_pass_and_mixed_widths() -> None:
    widths = [[576, 1536], [576, 1536, 576], [2048], [2048]]
    cost = [sum(gp.sums_bytes(k) for k in w) for w in widths]
    passes = gp.plan_passes(widths, 1 << 40, max_blocks=3)
    assert [(p.first, p.last, p.bytes) for p in passes] == [(0, 2, sum(cost[:3])), (3, 3, cost[3])]
    passes = gp.plan_passes(widths, cost[0] + cost[1])  # a 2048-wide block is 16.8 MB: one per pass
    assert [(p.first, p.last) for p in passes] == [(0, 1), (2, 2), (3, 3)]


def test_plan_skips_blocks_without_inputs_and_offsets() -> None:
    # blocks with nothing to collect join the pass around them, none before the first or after the last
    passes = gp.plan_passes([[], [128], [], [128], [128], []], 1 << 30, max_blocks=2)
    assert [(p.first, p.last) for p in passes] == [(1, 3), (4, 4)]
    # the last-layer plan: one block, numbered from first_block
    assert [(p.first, p.last) for p in gp.plan_passes([[1536]], 1 << 30, first_block=29)] == [(29, 29)]


def test_plan_a_block_over_the_budget_is_a_clear_error() -> None:
    with pytest.raises(gp.PipelineError, match=r"block 2 alone needs .* over the budget of .*--max-memory"):
        gp.plan_passes([[128], [128], [14336]], 100 * MIB)
    with pytest.raises(gp.PipelineError, match="no block has a weight"):
        gp.plan_passes([[], []], 1 << 30)
    with pytest.raises(gp.PipelineError, match="at least 1"):
        gp.plan_passes([[128]], 1 << 30, max_blocks=0)
    with pytest.raises(gp.PipelineError, match="positive"):
        gp.plan_passes([[128]], 0)


def test_finished_blocks_override() -> None:
    assert gp.finished_blocks_override(3) == r"^(?!blk\.(0|1|2)\.)=f16"
    import re

    pat = re.compile(gp.finished_blocks_override(12).split("=")[0])
    assert not pat.search("blk.0.ffn_down.weight") and not pat.search("blk.11.attn_q.weight")
    assert pat.search("blk.12.ffn_down.weight") and pat.search("blk.110.ffn_down.weight")
    assert pat.search("token_embd.weight") and pat.search("output.weight")


# ---------------------------------------------------------------------------------------------------- the options


def _opts(text: Path, **kw: object) -> gp.Options:
    return gp.Options(text=text, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kw, message", [
    ({"scope": "last-layer", "sequential": True}, "--sequential needs --scope all"),
    ({"scope": "some"}, "--scope some"),
    ({"threads": 0}, "at least 1"),
    ({"chunks": 0}, "at least 1"),
    ({"tensor_types": ("ffn_down",)}, "expected REGEX=TYPE"),
    ({"include": ("(",)}, "not a regular expression"),
])
def test_bad_options_are_refused(tmp_path: Path, kw: dict[str, object], message: str) -> None:
    text = tmp_path / "t.txt"
    text.write_text("text")
    with pytest.raises(gp.PipelineError, match=message):
        gp.check_options(_opts(text, **kw))


def test_missing_text_and_binaries(tmp_path: Path) -> None:
    with pytest.raises(gp.PipelineError, match="calibration text not found"):
        gp.check_options(_opts(tmp_path / "none.txt"))
    with pytest.raises(gp.PipelineError, match=r"llama-imatrix not found: build the tools with `bash ci/build.sh host`"):
        gp.find_tools(tmp_path)
    with pytest.raises(gp.PipelineError, match="positive"):
        gp.max_memory_bytes(0)
    assert gp.max_memory_bytes(1.5) == 3 << 29


def test_cli_exit_status_and_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text("text")
    rc = gp.main([str(tmp_path / "no.gguf"), str(text), "-o", str(tmp_path / "o.gguf")])
    assert rc == 2 and "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--gptq", "all"], "need --calibration-text"),
    (["--gptq-sequential"], "need --calibration-text"),
    (["--calibration-text", "T", "--type", "q8_0"], "add --type s3d8"),
    (["--calibration-text", "T", "--type", "s3d8", "--imatrix", "x.gguf"], "does not take --imatrix"),
    (["--calibration-text", "T", "--type", "s3d8", "--seed", "3"], "does not take --seed"),
    (["--calibration-text", "T", "--type", "s3d8", "--fallback-type", "f16"], "--fallback-type other than q8_0"),
    (["--calibration-text", "T", "--type", "s3d8", "--gptq", "last-layer", "--gptq-sequential"],
     "--sequential needs --scope all"),
    (["--calibration-text", "T", "--type", "s3d8", "--max-memory", "-1"], "positive number of GiB"),
])
def test_converter_refuses_bad_gptq_options(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            extra: list[str], message: str) -> None:
    """The converter's one command (``--calibration-text``): every clash is one line and exit status 2, before
    any work (the model path does not even exist)."""
    text = tmp_path / "t.txt"
    text.write_text("text")
    args = [str(text) if a == "T" else a for a in extra]
    rc = convert_main([str(tmp_path / "model"), "-o", str(tmp_path / "o.gguf"), *args])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert not (tmp_path / "o.gguf").exists()


def test_converter_without_the_new_options_keeps_the_old_errors(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc = convert_main([str(tmp_path / "model"), "--type", "s3d8", "--calibration", str(tmp_path / "t.txt")])
    assert rc == 2 and "no longer runs GPTQ" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- a real run

#: the S3D8 tensors of the run: ffn_down of blocks 0-5, three blocks per pass (two passes)
S3D8 = r"^blk\.[0-5]\.ffn_down\.weight$"


@pytest.fixture(scope="module")
def tools() -> dict[str, Path]:
    try:
        found = gp.find_tools()
    except gp.PipelineError as e:
        pytest.skip(str(e))
    help_im = subprocess.run([str(found["llama-imatrix"]), "--help"], capture_output=True, text=True)
    if "--xtx-layers" not in help_im.stdout + help_im.stderr:
        pytest.skip(f"{found['llama-imatrix']} has no --xtx-layers (a build without the GPTQ patches)")
    return found


def _run(f16: Path, text: Path, out: Path, work: Path, tools: dict[str, Path], **kw: object) -> dict[str, float]:
    opts = gp.Options(text=text, include=(S3D8,), ftype="Q8_0", tensor_types=(f"{S3D8}=s3d8",), ctx=256, chunks=2,
                      threads=2, **kw)  # type: ignore[arg-type]
    return gp.run_pipeline(f16, out, opts, work=work, tools=tools, progress=lambda _: None)


@pytest.fixture(scope="module")
def runs(tools: dict[str, Path], smollm2_f16_and_text: tuple[Path, Path],
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    f16, text = smollm2_f16_and_text
    d = tmp_path_factory.mktemp("gptq_pipeline")
    _run(f16, text, d / "one.gguf", d / "one", tools)
    _run(f16, text, d / "seq.gguf", d / "seq", tools, sequential=True, blocks_per_pass=3)
    return {"dir": d, "f16": f16, "text": text}


def test_the_one_command_writes_what_llama_quantize_writes_by_hand(tools: dict[str, Path],
                                                                   runs: dict[str, Path]) -> None:
    d = runs["dir"]
    files = sorted((d / "seq").glob("pass-*.xtx.gguf"))
    assert [f.name for f in files] == ["pass-0.xtx.gguf", "pass-1.xtx.gguf"]
    assert not list((d / "seq").glob("partial-*.gguf"))  # the partial models are removed once used
    by_hand = d / "by-hand.gguf"
    subprocess.run([str(tools["llama-quantize"]), "--imatrix", str(d / "seq" / "pass-0.imatrix.gguf"),
                    *(x for f in files for x in ("--hessian", str(f))), "--tensor-type", f"{S3D8}=s3d8",
                    str(runs["f16"]), str(by_hand), "Q8_0", "2"], check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert by_hand.read_bytes() == (d / "seq.gguf").read_bytes()
    log = (d / "seq" / "quantize.log").read_text()
    assert "GPTQ (--hessian) quantized 6 tensor(s)" in log, log[-2000:]


def test_sequential_changes_the_later_passes_only(runs: dict[str, Path]) -> None:
    d = runs["dir"]
    one = xtx_file.read_xtx(d / "one" / "pass-0.xtx.gguf")
    assert sorted(one.weights) == [f"blk.{i}.ffn_down.weight" for i in range(6)]
    for i, blocks in enumerate(((0, 1, 2), (3, 4, 5))):
        part = xtx_file.read_xtx(d / "seq" / f"pass-{i}.xtx.gguf")
        assert sorted(part.weights) == [f"blk.{b}.ffn_down.weight" for b in blocks]
        for w in part.weights:
            same = np.array_equal(part.matrix(w), one.matrix(w))
            # the first pass runs on the f16 model (the one-pass matrices bit for bit); later ones on a model whose
            # earlier blocks are S3D8 with GPTQ, so their inputs and X^T X differ
            assert same == (i == 0), (w, same)
            # the fingerprints are the f16 input's (the unfinished blocks stay F16 in the partial model)
            assert part.weights[w][1] == one.weights[w][1], w
    # the whole-model files differ where the later blocks' GPTQ saw other matrices
    assert (d / "one.gguf").read_bytes() != (d / "seq.gguf").read_bytes()


def test_a_second_run_reuses_the_pass_and_a_failed_tool_shows_its_log(tools: dict[str, Path], runs: dict[str, Path],
                                                                        tmp_path: Path) -> None:
    """A second run in the same work folder reuses the pass (its command and inputs are unchanged); llama-quantize
    refusing an option then fails the run with ToolFailed and its last log lines, and no output file is left."""
    said: list[str] = []
    opts = gp.Options(text=runs["text"], include=(S3D8,), ftype="NOT_A_TYPE", ctx=256, chunks=2, threads=2)
    out = tmp_path / "o.gguf"
    with pytest.raises(gp.ToolFailed, match=r"llama-quantize \(final\) failed \(exit status \d+; log .*\n"):
        gp.run_pipeline(runs["f16"], out, opts, work=runs["dir"] / "one", tools=tools, progress=said.append)
    assert any("reused" in s for s in said), said
    assert not out.exists() and not list(tmp_path.glob(".o.gguf.*"))

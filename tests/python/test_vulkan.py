"""The tools of the Vulkan build (``build/vulkan``, ggml-vulkan) with every layer offloaded (``-ngl 99``), on the first
Vulkan device - Mesa's lavapipe in CI (a conformant software Vulkan 1.3 driver on the CPU: it proves semantics, not a
phone GPU's speed; docs/gpu.md) - against the x86 CPU build, on the two tiny S3D8 models of the phone-path tests
(tests/mllama/builds.py):

* **where each op runs**: the parity tool's ``--placement`` lists every op that computed, by the buffer that holds its
  result: ``Vulkan0`` (device memory) for the GPU, a host buffer (``CPU``, ``Vulkan_Host``) for the CPU backend. No S3D8 MUL_MAT runs on the CPU (the token embedding's GET_ROWS does: libllama keeps the input
  layer in host memory, for every type), and both the text model and the vision encoder run S3D8 MUL_MATs on Vulkan.
* **bit for bit** where S3D8 makes it so: each dumped S3D8 matmul (attn_v of layer 0, the output layer, the vision
  projector) equals the codec's integer reference on the input the Vulkan build itself computed.
* **within TOL** elsewhere (the RMS norm, attention, softmax and the rest accumulate in other orders on the GPU):
  logits and the cross-attention states, the same TOL as the aarch64 builds (tests/python/test_phone_path.py says
  why). Greedy tokens only where the CPU reference's margin exceeds the noise bound (tests.mllama.margins).
* ``llama-cli``, ``llama-mtmd-cli`` and ``llama-server`` with ``-ngl 99`` answer as the CPU build does.
* the quantized KV caches (``q4_hqq``, ``q4_hqq_128``, ``tq3_0``, the cross-attention store's own types) with
  ``-ngl 99``: ggml-vulkan implements none of them, so their ops run on the CPU; the answer must still be the CPU
  build's with the same cache types, within TOL.

The binaries come from ``build/vulkan/bin`` (``bash ci/build.sh vulkan``, which ci/test.sh runs); without them, or
without a Vulkan device, the tests skip with the reason, and ci/summarize.py counts a skip as a failure.
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.mllama import harness, llama_server
from tests.mllama.builds import (ANSWER, IMAGE_QUESTION, MAX_MTMD_TOKENS, TEXT_NAMES, TOL, VISION_NAMES, DumpRun,
                                 assert_exact_s3d8, assert_mllama_close, cli_answer, decisions, decisive_answer, dump,
                                 finite_cols, mtmd_answer, rel_err)
from tests.mllama.margins import assert_decisive_chain, assert_same_argmax, assert_same_greedy_chain

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "build" / "vulkan" / "bin"
TOOLS = ("llama-cli", "llama-mtmd-cli", "llama-mllama-dump", "llama-server")
# the first Vulkan device (lavapipe where it is the only one, as in CI)
ENV = {"GGML_VK_VISIBLE_DEVICES": "0"}
NGL = ("-ngl", "99")
DEVICE = "Vulkan0"


@cache
def why_no_vulkan() -> str | None:
    """Why the Vulkan tests cannot run (None: they can)."""
    for name in TOOLS:
        if not (BIN / name).is_file():
            return f"{BIN / name} is missing: build it with `bash ci/build.sh vulkan` (ci/test.sh does)"
    p = subprocess.run([str(BIN / "llama-cli"), "--list-devices"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, **ENV}, stdin=subprocess.DEVNULL)
    if DEVICE not in p.stdout + p.stderr:
        return (f"no Vulkan device ({BIN / 'llama-cli'} --list-devices lists none; bash ci/setup.sh installs Mesa's "
                f"lavapipe, mesa-vulkan-drivers):\n{(p.stdout + p.stderr)[-2000:]}")
    return None


@pytest.fixture(autouse=True)
def _needs_vulkan():
    why = why_no_vulkan()
    if why is not None:
        pytest.skip(why)


def vk(name: str) -> list[str]:
    return [str(BIN / name)]


def cpu(name: str) -> list[str]:
    return [str(harness.binary(name))]


# ---------------------------------------------------------------------------------------------------
# models and runs (each once per module)


def read_placement(out: Path) -> list[tuple[str, str, str, int]]:
    rows = []
    for line in (out / "op_placement.tsv").read_text().splitlines():
        op, src0, buf, n = line.split("\t")
        rows.append((op, src0, buf, int(n)))
    return rows


@pytest.fixture(scope="module")
def llama_runs(tiny_llama, tmp_path_factory) -> tuple[DumpRun, DumpRun, list[tuple[str, str, str, int]]]:
    """(CPU build, Vulkan build with -ngl 99, the Vulkan run's op placement) of the tiny Llama."""
    n_steps = len(tiny_llama.chain) - 2
    ref = dump(cpu("llama-mllama-dump"), tiny_llama.gguf, tiny_llama.ids, tmp_path_factory.mktemp("llama-cpu"),
               n_steps=n_steps, names=TEXT_NAMES)
    out = tmp_path_factory.mktemp("llama-vulkan")
    got = dump(vk("llama-mllama-dump"), tiny_llama.gguf, tiny_llama.ids, out, n_steps=n_steps, names=TEXT_NAMES,
               extra=(*NGL, "--placement"), env=ENV)
    return ref, got, read_placement(out)


@pytest.fixture(scope="module")
def mllama_runs(tiny_mllama, tmp_path_factory) -> tuple[DumpRun, DumpRun, list[tuple[str, str, str, int]]]:
    """(CPU build, Vulkan build with -ngl 99 (the vision encoder on the GPU too), its op placement) of the tiny
    Llama 3.2 Vision with an image."""
    kw = dict(n_steps=MAX_MTMD_TOKENS, names=TEXT_NAMES + VISION_NAMES, mmproj=tiny_mllama.mmproj,
              image=tiny_mllama.image)
    ref = dump(cpu("llama-mllama-dump"), tiny_mllama.text, tiny_mllama.ids, tmp_path_factory.mktemp("mllama-cpu"),
               **kw)
    out = tmp_path_factory.mktemp("mllama-vulkan")
    got = dump(vk("llama-mllama-dump"), tiny_mllama.text, tiny_mllama.ids, out, extra=(*NGL, "--placement"),
               env=ENV, **kw)
    return ref, got, read_placement(out)


# ---------------------------------------------------------------------------------------------------
# checks


def assert_s3d8_matmuls_on_vulkan(placement: list[tuple[str, str, str, int]], what: str) -> None:
    on_cpu = [r for r in placement if r[0] in ("MUL_MAT", "MUL_MAT_ID") and r[1] == "s3d8" and r[2] != DEVICE]
    on_gpu = sum(n for op, src0, buf, n in placement if op == "MUL_MAT" and src0 == "s3d8" and buf == DEVICE)
    assert not on_cpu, f"{what}: S3D8 matmuls off the GPU: {on_cpu}"
    assert on_gpu > 0, f"{what}: no S3D8 MUL_MAT ran on {DEVICE}: {placement}"


def assert_all_on_vulkan_but_embedding(placement: list[tuple[str, str, str, int]], what: str) -> None:
    """Every S3D8 matmul on the GPU, and every other op too, but the token embedding's GET_ROWS (libllama keeps the
    input layer in host memory)."""
    assert_s3d8_matmuls_on_vulkan(placement, what)
    off = {(op, src0) for op, src0, buf, _ in placement if buf != DEVICE}
    assert off <= {("GET_ROWS", "s3d8")}, f"{what}: ops off the GPU: {sorted(off)}"


def test_llama_ops_on_vulkan(llama_runs):
    """Every S3D8 MUL_MAT of the tiny Llama runs on the GPU, and so does the rest of the layers' work."""
    _, _, placement = llama_runs
    assert_all_on_vulkan_but_embedding(placement, "tiny Llama")


def test_llama_logits_on_vulkan(tiny_llama, llama_runs):
    ref, got, _ = llama_runs
    what = "Vulkan tiny Llama"
    assert ref.tokens == tiny_llama.chain[1:], (ref.tokens, tiny_llama.chain)
    assert_exact_s3d8(got, tiny_llama.gguf, what=what)
    e_norm = rel_err(got.tensors["attn_norm-0"], ref.tensors["attn_norm-0"])
    assert e_norm <= TOL, f"{what}: attn_norm-0 rel err {e_norm:.3g}"
    assert_decisive_chain(decisions(ref), TOL, what="tiny Llama answer")  # so every step compares
    e_prompt = rel_err(got.prompt_logits, ref.prompt_logits)
    e_steps = rel_err(got.step_logits, ref.step_logits)
    assert e_prompt <= TOL and e_steps <= TOL, f"{what}: logits rel err prompt {e_prompt:.3g}, steps {e_steps:.3g}"
    assert_same_argmax(got.prompt_logits, ref.prompt_logits, TOL, min_rows=8, what=f"{what} prompt")
    assert_same_greedy_chain(got.tokens, ref.tokens, decisions(ref), TOL, what=f"{what} vs CPU")


def test_llama_cli_answers_on_vulkan(tiny_llama, llama_runs):
    ref, _, _ = llama_runs
    assert_decisive_chain(decisions(ref), TOL, what="tiny Llama answer")
    assert cli_answer(vk("llama-cli"), tiny_llama, 16, extra=NGL, env=ENV) == ANSWER.encode()


def test_mllama_ops_on_vulkan(mllama_runs):
    """The S3D8 matmuls of the text model (with cross-attention) and of the vision encoder run on the GPU; every op
    that does not is one ggml-vulkan reports unsupported (the list is docs/gpu.md's table)."""
    _, _, placement = mllama_runs
    assert_all_on_vulkan_but_embedding(placement, "tiny mllama")


def test_mllama_logits_on_vulkan(tiny_mllama, mllama_runs):
    ref, got, _ = mllama_runs
    what = "Vulkan tiny mllama"
    assert_exact_s3d8(got, tiny_mllama.text, mmproj=tiny_mllama.mmproj, what=what)
    assert_mllama_close(got, ref, what=what, ref_name="CPU")


def test_mtmd_cli_answers_on_vulkan(tiny_mllama, mllama_runs):
    ref, _, _ = mllama_runs
    n, answer = decisive_answer(tiny_mllama, ref)
    assert mtmd_answer(cpu("llama-mtmd-cli"), tiny_mllama, n) == answer
    assert mtmd_answer(vk("llama-mtmd-cli"), tiny_mllama, n, extra=NGL, env=ENV) == answer


def test_server_image_chat_on_vulkan(tiny_mllama, mllama_runs, tmp_path):
    """llama-server -ngl 99 answers an image chat (the image and question of the CLI test) with the CPU's decisive
    tokens."""
    ref, _, _ = mllama_runs
    n, answer = decisive_answer(tiny_mllama, ref)
    try:
        # the prompt in one ubatch (-ub 512 after the test servers' -ub 1): a prompt split across ubatches crashes
        # lavapipe here (docs/gpu.md, "Known issue")
        srv = llama_server.start(BIN / "llama-server", tiny_mllama.text, tiny_mllama.mmproj, tmp_path / "server.log",
                                 n_parallel=1, n_ctx=512, extra=(*NGL, "-ub", "512"), env=ENV)
    except llama_server.ServerError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        body = llama_server.chat_body(llama_server.data_url(tiny_mllama.image.read_bytes()), IMAGE_QUESTION)
        body.update(max_tokens=n, temperature=0)
        r = requests.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        assert content.encode().strip(b"\n") == answer, (content, answer)
    finally:
        srv.stop()


# the cache types of the series, self-attention and cross-attention store; flash attention on (a quantized V needs it)
KV_CASES = {
    "q4_hqq": ("-ctk", "q4_hqq", "-ctv", "q4_hqq", "-fa", "on"),
    "q4_hqq_128+tq3_0-cross": ("-ctk", "q4_hqq_128", "-ctv", "q4_hqq_128", "-ctkx", "tq3_0", "-ctvx", "tq3_0",
                               "-fa", "on"),
}


@pytest.mark.parametrize("case", list(KV_CASES))
def test_mllama_kv_types_on_vulkan(case, tiny_mllama, tmp_path):
    """With -ngl 99 and a quantized cache the cache stays in host memory (ggml-vulkan cannot write these types: libllama
    keeps such a cache on the CPU, llama_kv_cache_layer_buft) and the answer is the CPU build's with the same cache.

    The bound: a quantized cache rounds K and V to its levels, and the GPU's K and V differ from the CPU's in the last
    bits, so some values land on a neighbouring level. Each run is then within the quantized cache's own error e_q of
    the f16-cache model (measured here on the CPU), and the two within 2 * e_q of each other (triangle inequality);
    never less than TOL. Measured (AMD EPYC, lavapipe): q4_hqq 0.053 (e_q 0.089), q4_hqq_128 + tq3_0 0.101 (e_q 0.116)."""
    kv = KV_CASES[case]
    kw = dict(n_steps=MAX_MTMD_TOKENS, names=(), mmproj=tiny_mllama.mmproj, image=tiny_mllama.image)
    f16 = dump(cpu("llama-mllama-dump"), tiny_mllama.text, tiny_mllama.ids, tmp_path / "cpu-f16", extra=("-fa", "on"),
               **kw)
    ref = dump(cpu("llama-mllama-dump"), tiny_mllama.text, tiny_mllama.ids, tmp_path / "cpu", extra=kv,
               **kw)
    got = dump(vk("llama-mllama-dump"), tiny_mllama.text, tiny_mllama.ids, tmp_path / "vulkan",
               extra=(*kv, *NGL, "--placement"), env=ENV, **kw)
    placement = read_placement(tmp_path / "vulkan")
    what = f"Vulkan tiny mllama, cache {case}"
    assert_s3d8_matmuls_on_vulkan(placement, what)
    # (the CPU backend's results are in host buffers: "CPU", or "Vulkan_Host", pinned memory the GPU can copy from)
    on_cpu = {op for op, _, buf, _ in placement if buf != DEVICE}
    assert {"SET_ROWS", "FLASH_ATTN_EXT"} <= on_cpu, f"{what}: the cache's writes and reads are not on the CPU: {on_cpu}"
    e_q = rel_err(ref.prompt_logits, f16.prompt_logits)
    bound = max(TOL, 2 * e_q)
    e_prompt = rel_err(got.prompt_logits, ref.prompt_logits)
    assert e_prompt <= bound, f"{what}: prompt logits rel err {e_prompt:.3g} > {bound:.3g} (the cache's own {e_q:.3g})"
    assert np.isfinite(finite_cols(got.step_logits)).all()
    # No greedy token is compared: a cache within `bound` of the reference may move every logit by bound * max|logits|
    # (measured 0.05-0.1), more than any margin of this tiny model's answer (at most 0.66 against a tie bound of 1.1-1.3
    # here), so no token is implied. The check above, on the logits, is this test's; the tokens compare in
    # test_llama_logits_on_vulkan and assert_mllama_close, where the bound is TOL.

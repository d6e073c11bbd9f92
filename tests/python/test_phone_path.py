"""The phone path end to end under QEMU (issue 14 part 5): the aarch64 tools on S3D8 models, against x86.

For each cross build (``aarch64-dotprod``: armv8.2-a+dotprod, ``aarch64-i8mm``: armv8.6-a+dotprod+i8mm, both
static, run as ``qemu-aarch64 -cpu max`` without ``-L``) and two tiny models whose weight matrices are all S3D8:

* ``llama-cli`` answers a chat prompt with a plain Llama (the SmolLM2 architecture at 2 layers x 1152, quantised
  by ``llama-quantize``), ``llama-mtmd-cli`` answers about an image with the tiny Llama 3.2 Vision model of the
  parity tests (tests/mllama); the answers are the bytes the x86 build prints;
* ``llama-mllama-dump`` (the parity tool, it runs plain Llamas too) runs the same token sequences and writes the
  logits and single tensors of the graph, which are compared with the x86 build's.

What is compared, and how strictly:

* **bit for bit** where the computation is exact by construction. The first S3D8 matmul of each text model
  (``Vcur-0`` = attn_v of layer 0) sees the RMS norm of dequantised S3D8 embedding rows (ggml's rms_norm is a
  scalar double sum, the same on every CPU) and S3D8 matmuls are integer arithmetic with a fixed fp32 epilogue:
  ``attn_norm-0`` and ``Vcur-0`` equal x86's. Every S3D8 matmul that is dumped also equals the codec's integer
  reference on the input the aarch64 build itself computed (attn_v of layer 0, the output layer, the vision
  projector), with i8mm as with dotprod kernels.
* **within TOL** elsewhere: attention (f32 matmuls), softmax, SiLU/GELU, the f16 patch convolution and the layer
  norms accumulate in other orders on x86 (AVX2/AVX512) than on NEON, and differently again with the armv8.6-a
  build (measured: the cross-attention scores of the tiny mllama differ by ~2e-7 between all three), and S3D8's
  per-row int8 activation quantisation turns such a change into a step of one activation row now and then (one
  int8 value or the bf16 scale: a ~1e-2 change of that matmul's output, see tests/python/test_mllama_s3d8.py).
  TOL = 6e-2 as there (max |aarch64 - x86| / max |x86| per logits array and for the cross-attention states).
  Measured: the dotprod build's logits equal x86's bit for bit on both models, the i8mm build's on the tiny
  Llama; on the mllama one row of layer 1 steps (as above) and the prompt logits differ by 1.6e-2.
* **greedy tokens** only where the x86 margin exceeds 2 * TOL * max|logits| (tests.mllama.margins), with
  enough such positions asserted; decode-step logits only as far as the greedy tokens are decided that way
  (after a near tie the two builds may go on from different tokens). The tiny Llama's output layer is built
  so that greedy decoding follows a fixed chain of printable tokens (``It is Paris.`` then end of turn: each
  answer token's output row is the previous token's embedding, so the margins are large by construction while
  the layers still move every logit); for the random mllama, the CLI is asked for as many tokens as the x86
  reference decides outside the noise (at least MIN_MTMD_TOKENS).

The binaries come from ``build/<variant>/bin`` (``bash ci/build.sh aarch64-dotprod aarch64-i8mm``, which
ci/test.sh runs first); without them the tests skip with that command, and ci/summarize.py counts a skip as a
failure. Measured run times and the errors seen: docs/reliability.md, "The phone path under QEMU".
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.mllama import harness
from tests.mllama.builds import (ANSWER, MAX_MTMD_TOKENS, TEXT_NAMES, TOL, VISION_NAMES, DumpRun, assert_exact_s3d8,
                                 assert_mllama_close, cli_answer, decisions, decisive_answer, dump, mtmd_answer,
                                 rel_err)
from tests.mllama.margins import assert_decisive_chain, assert_same_argmax, assert_same_greedy_chain

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("aarch64-dotprod", "aarch64-i8mm")
TOOLS = ("llama-cli", "llama-mtmd-cli", "llama-mllama-dump")


# ---------------------------------------------------------------------------------------------------
# binaries


def why_no_cross(variant: str) -> str | None:
    """Why the tests of an aarch64 build cannot run (None: they can)."""
    if os.environ.get("S3D8_SKIP_CROSS") == "1":  # as ci/test.sh: no aarch64 build this run, stale ones unused
        return "the aarch64 builds are skipped by S3D8_SKIP_CROSS=1 (counted as a failure)"
    if shutil.which("qemu-aarch64") is None:
        return "qemu-aarch64 is not installed (bash ci/setup.sh installs qemu-user)"
    for name in TOOLS:
        path = REPO / "build" / variant / "bin" / name
        if not path.is_file():
            return (f"{path} is missing: build it with `bash ci/build.sh {variant}` (ci/test.sh does; "
                    f"S3D8_SKIP_CROSS=1 skips it, which counts as a failure)")
    return None


# the variants as test parameters, skipped (before any fixture runs) when their binaries are absent
VARIANT_PARAMS = [pytest.param(v, marks=pytest.mark.skipif(why_no_cross(v) is not None, reason=why_no_cross(v) or ""))
                  for v in VARIANTS]


def cross_binary(variant: str, name: str) -> Path:
    why = why_no_cross(variant)
    if why is not None:
        pytest.skip(why)
    return REPO / "build" / variant / "bin" / name


def elf_header(path: Path) -> tuple[int, str | None]:
    """(e_machine, PT_INTERP path or None) of a 64-bit little-endian ELF file; no interpreter = static."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, f"{path}: not a 64-bit little-endian ELF file"
    e_machine, = struct.unpack_from("<H", data, 18)
    e_phoff, = struct.unpack_from("<Q", data, 32)
    e_phentsize, e_phnum = struct.unpack_from("<HH", data, 54)
    for i in range(e_phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from("<IIQQQQ", data, e_phoff + i * e_phentsize)
        if p_type == 3:  # PT_INTERP: the kernel starts the dynamic loader named here
            return e_machine, data[p_offset:p_offset + p_filesz].rstrip(b"\0").decode()
    return e_machine, None


def tool(variant: str | None, name: str) -> list[str]:
    """The command prefix of a tool: the x86 build (variant None) or an aarch64 build under QEMU, without -L."""
    if variant is None:
        return [str(harness.binary(name))]
    binary = cross_binary(variant, name)
    qemu = shutil.which("qemu-aarch64")
    assert qemu is not None, "qemu-aarch64 is not installed (ci/setup.sh installs it)"
    return [qemu, "-cpu", "max", str(binary)]


# ---------------------------------------------------------------------------------------------------
# models


# ---------------------------------------------------------------------------------------------------
# models and runs (each once per module: the emulated ones take seconds to tens of seconds)


@pytest.fixture(scope="module")
def llama_x86(tiny_llama, tmp_path_factory) -> DumpRun:
    return dump(tool(None, "llama-mllama-dump"), tiny_llama.gguf, tiny_llama.ids,
                tmp_path_factory.mktemp("llama-x86"),
                n_steps=len(tiny_llama.chain) - 2, names=TEXT_NAMES)


@pytest.fixture(scope="module")
def mllama_x86(tiny_mllama, tmp_path_factory) -> DumpRun:
    return dump(tool(None, "llama-mllama-dump"), tiny_mllama.text, tiny_mllama.ids,
                tmp_path_factory.mktemp("mllama-x86"),
                n_steps=MAX_MTMD_TOKENS, names=TEXT_NAMES + VISION_NAMES, mmproj=tiny_mllama.mmproj,
                image=tiny_mllama.image)


@pytest.fixture(scope="module")
def aarch64_dump(tiny_llama, tiny_mllama, tmp_path_factory):
    """aarch64_dump(variant, "llama" | "mllama"): the emulated dump, run once per module."""
    _runs: dict[tuple[str, str], DumpRun] = {}

    def get(variant: str, which: str) -> DumpRun:
        key = (variant, which)
        if key not in _runs:
            out = tmp_path_factory.mktemp(f"{which}-{variant}")
            if which == "llama":
                _runs[key] = dump(tool(variant, "llama-mllama-dump"), tiny_llama.gguf, tiny_llama.ids, out,
                                  n_steps=len(tiny_llama.chain) - 2,
                                  names=TEXT_NAMES)
            else:
                _runs[key] = dump(tool(variant, "llama-mllama-dump"), tiny_mllama.text, tiny_mllama.ids, out,
                                  n_steps=MAX_MTMD_TOKENS,
                                  names=TEXT_NAMES + VISION_NAMES, mmproj=tiny_mllama.mmproj, image=tiny_mllama.image)
        return _runs[key]
    return get


# ---------------------------------------------------------------------------------------------------
# checks


# ---------------------------------------------------------------------------------------------------
# checks




@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_binaries_are_static(variant):
    """The cross builds are static aarch64 executables (no ELF interpreter: they need no aarch64 libraries, and
    every emulated run below is `qemu-aarch64 -cpu max` without -L)."""
    # the check itself: the host build is dynamically linked and says so
    assert elf_header(harness.binary("llama-cli"))[1] is not None
    for name in TOOLS:
        path = cross_binary(variant, name)
        machine, interp = elf_header(path)
        assert machine == 183, f"{path}: e_machine {machine}, not aarch64 (183)"
        assert interp is None, f"{path} is dynamically linked (interpreter {interp})"


# --- llama-cli on the tiny S3D8 Llama --------------------------------------------------------------------


def test_llama_reference_is_decisive(tiny_llama, llama_x86):
    """The x86 reference answers ANSWER, and every greedy decision of it (and enough prompt positions) is outside
    the noise bound: the token comparisons below cannot hinge on a near tie."""
    assert llama_x86.tokens == tiny_llama.chain[1:], (llama_x86.tokens, tiny_llama.chain)
    assert_decisive_chain(decisions(llama_x86), TOL, what="tiny Llama answer")
    assert cli_answer(tool(None, "llama-cli"), tiny_llama, 16) == ANSWER.encode()


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_llama_cli_answers_like_x86(variant, tiny_llama, llama_x86):
    # the x86 chain is decisive (test above): within TOL of it, the emulated CLI must print the same answer
    assert_decisive_chain(decisions(llama_x86), TOL, what="tiny Llama answer")
    assert cli_answer(tool(variant, "llama-cli"), tiny_llama, 16) == ANSWER.encode()


def dump_like_x86(aarch64_dump, variant, model: str, x86, what: str):
    """The emulated ``variant``'s dump of the tiny ``model`` ("llama" or "mllama"), whose first layer's attention
    norm and V are those of the x86 dump ``x86`` exactly."""
    got = aarch64_dump(variant, model)
    for name in ("attn_norm-0", "Vcur-0"):
        assert np.array_equal(got.tensors[name], x86.tensors[name]), f"{what}: {name} differs from x86"
    return got


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_llama_logits_against_x86(variant, tiny_llama, llama_x86, aarch64_dump):
    what = f"{variant} tiny Llama"
    got = dump_like_x86(aarch64_dump, variant, "llama", llama_x86, what)
    assert_exact_s3d8(got, tiny_llama.gguf, what=what)
    e_prompt = rel_err(got.prompt_logits, llama_x86.prompt_logits)
    assert_decisive_chain(decisions(llama_x86), TOL, what="tiny Llama answer")  # so every step compares
    e_steps = rel_err(got.step_logits, llama_x86.step_logits)
    assert e_prompt <= TOL and e_steps <= TOL, f"{what}: logits rel err prompt {e_prompt:.3g}, steps {e_steps:.3g}"
    # measured: 12 of the 35 prompt positions decisive (margins 0.24-0.69 of max|logits|, bound 0.12)
    assert_same_argmax(got.prompt_logits, llama_x86.prompt_logits, TOL, min_rows=8, what=f"{what} prompt")
    assert_same_greedy_chain(got.tokens, llama_x86.tokens, decisions(llama_x86), TOL, what=f"{what} vs x86")


# --- llama-mtmd-cli on the tiny S3D8 Llama 3.2 Vision, with an image ----------------------------------


def test_mllama_reference_is_decisive(tiny_mllama, mllama_x86):
    n, answer = decisive_answer(tiny_mllama, mllama_x86)
    assert mtmd_answer(tool(None, "llama-mtmd-cli"), tiny_mllama, n) == answer


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_mtmd_cli_answers_like_x86(variant, tiny_mllama, mllama_x86):
    n, answer = decisive_answer(tiny_mllama, mllama_x86)
    assert mtmd_answer(tool(variant, "llama-mtmd-cli"), tiny_mllama, n) == answer


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_mllama_logits_against_x86(variant, tiny_mllama, mllama_x86, aarch64_dump):
    what = f"{variant} tiny mllama"
    got = dump_like_x86(aarch64_dump, variant, "mllama", mllama_x86, what)
    assert_exact_s3d8(got, tiny_mllama.text, mmproj=tiny_mllama.mmproj, what=what)
    assert_mllama_close(got, mllama_x86, what=what, ref_name="x86")

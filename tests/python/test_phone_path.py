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
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.mllama import harness, tiny_model as T
from tests.mllama.margins import assert_decisive_chain, assert_same_argmax, margins, tie_bound

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("aarch64-dotprod", "aarch64-i8mm")
TOOLS = ("llama-cli", "llama-mtmd-cli", "llama-mllama-dump")
TOL = 6e-2
THREADS = "2"
TIMEOUT = 900  # seconds per emulated run (measured: under 30 s each on a loaded 2-core machine)

QUESTION = "What is the capital of France?"
ANSWER = "It is Paris."
IMAGE_QUESTION = "Describe this picture in one sentence, please."
MIN_MTMD_TOKENS = 2
MAX_MTMD_TOKENS = 8

# graph tensors the dump tool writes besides the logits (tools/mllama-dump --dump-name)
TEXT_NAMES = ("attn_norm-0", "Vcur-0", "result_norm", "result_output")
VISION_NAMES = ("vision_out", "projected")


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


def run(cmd: list[str], what: str) -> bytes:
    p = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        raise AssertionError(f"{what} failed ({p.returncode}):\n{' '.join(cmd)}\n"
                             f"{p.stderr.decode(errors='replace')[-4000:]}")
    return p.stdout


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


def chat_ids(tok, content) -> list[int]:
    enc = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)


def gguf_types(path: Path) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@dataclass
class TinyLlama:
    gguf: Path
    tok: object
    ids: list[int]          # the chat prompt llama-cli feeds
    chain: list[int]        # the greedy answer by construction, then end of turn


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> TinyLlama:
    """A 2-layer Llama (hidden 1152, 9 heads / 3 kv heads, ffn 1280, the toy tokenizer of tests/mllama: 512 rows,
    every matrix S3D8-eligible), converted to f32 by convert/to_gguf.py and quantised by llama-quantize to S3D8.

    Weights are random (std 0.02; embeddings 0.1) except for the answer: the output row of each token of
    ``ANSWER`` (and of end of turn) is the embedding of the token before it, the first after the prompt's last
    token, so the greedy answer to any chat prompt is ``ANSWER`` with large margins."""
    from transformers import AutoTokenizer

    from convert.synthetic import llama_tensors, write_tiny_llama

    tok_dir = T.get()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = chat_ids(tok, QUESTION)
    chain = [ids[-1]] + tok.encode(ANSWER, add_special_tokens=False) + [T.EOT_ID]
    assert len(set(chain)) == len(chain), f"the answer's tokens must be distinct: {chain}"

    dims: dict[str, Any] = dict(hidden=1152, layers=2, heads=9, kv_heads=3, ffn=1280, vocab=512)
    tensors = llama_tensors(**dims, tied=False, seed=0, std=0.02)
    emb = (np.random.default_rng(1).standard_normal((512, 1152)) * 0.1).astype(np.float32)
    tensors["model.embed_tokens.weight"] = emb
    for prev, nxt in zip(chain[:-1], chain[1:]):
        tensors["lm_head.weight"][nxt] = emb[prev] * (0.02 / 0.1)  # the std of the other rows
    out = tmp_path_factory.mktemp("tiny-llama")
    hf = write_tiny_llama(out / "hf", tok_dir, tensors=tensors, tied=False, **dims,
                          config_overrides={"bos_token_id": T.BOS_ID, "eos_token_id": [T.EOS_ID, T.EOT_ID]})
    f32, s3d8 = out / "f32.gguf", out / "s3d8.gguf"
    run([sys.executable, "-m", "convert.to_gguf", str(hf), "--type", "f32", "--tokenizer-pre", "llama-bpe",
         "-o", str(f32), "--no-progress"], "convert.to_gguf")
    run([str(harness.binary("llama-quantize")), str(f32), str(s3d8), "S3D8", "2"], "llama-quantize")
    f32.unlink()
    types = gguf_types(s3d8)
    matrices = {n: t for n, t in types.items() if not n.endswith("norm.weight")}
    assert set(matrices.values()) == {"S3D8"} and len(matrices) == 2 + 7 * 2, types
    return TinyLlama(s3d8, tok, ids, chain)


@dataclass
class TinyMllama:
    text: Path
    mmproj: Path
    tok: object
    ids: list[int]
    image: Path


@pytest.fixture(scope="module")
def tiny_mllama(tmp_path_factory) -> TinyMllama:
    """The S3D8 tiny Llama 3.2 Vision of tests/python/test_mllama_s3d8.py (the same cached conversion) and a
    one-tile image."""
    from PIL import Image
    from transformers import AutoTokenizer

    model_dir = T.get()
    text, mmproj = harness.convert(model_dir, None, "s3d8")
    types = {**gguf_types(text), **gguf_types(mmproj)}
    assert {n for n, t in types.items() if t not in ("S3D8", "F32")} == {"v.patch_embd.weight"}, types
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = chat_ids(tok, [{"type": "image"}, {"type": "text", "text": IMAGE_QUESTION}])
    image = tmp_path_factory.mktemp("image") / "img.png"
    rng = np.random.default_rng(10)  # measured margins of the first 3 answer tokens: 0.21, 0.18, 0.14 (bound 0.12)
    Image.fromarray(rng.integers(0, 256, (T.IMAGE_SIZE, T.IMAGE_SIZE, 3), dtype=np.uint8)).save(image)
    return TinyMllama(text, mmproj, tok, ids, image)


# ---------------------------------------------------------------------------------------------------
# runs (each once per module: the emulated ones take seconds to tens of seconds)


@dataclass
class DumpRun:
    prompt_logits: np.ndarray
    step_logits: np.ndarray
    tokens: list[int]
    cross: list[np.ndarray]
    tensors: dict[str, np.ndarray]


def dump(variant: str | None, model: Path, ids: list[int], out: Path, *, n_steps: int, names: tuple[str, ...],
         mmproj: Path | None = None, image: Path | None = None) -> DumpRun:
    tdir = out / "tensors"
    tdir.mkdir(parents=True, exist_ok=True)
    cmd = tool(variant, "llama-mllama-dump") + [
        "-m", str(model), "--tokens", ",".join(map(str, ids)), "--n-steps", str(n_steps), "-ctk", "f32",
        "-ctv", "f32", "-fa", "off", "-t", THREADS, "-o", str(out), "--dump-tensors", str(tdir)]
    for name in names:
        cmd += ["--dump-name", name]
    if mmproj is not None:
        cmd += ["--mmproj", str(mmproj), "--image", str(image)]
    run(cmd, "llama-mllama-dump")
    return DumpRun(np.load(out / "prompt_logits.npy"), np.load(out / "step_logits.npy"),
                   [int(t) for t in np.load(out / "tokens.npy")],
                   [np.load(out / "cross_0.npy")] if image is not None else [],
                   {name: np.load(tdir / f"{name}.npy") for name in names})


def cli_answer(variant: str | None, model: TinyLlama, n_predict: int) -> bytes:
    out = run(tool(variant, "llama-cli") + ["-m", str(model.gguf), "-p", QUESTION, "-n", str(n_predict), "-st",
                                            "--temp", "0", "-t", THREADS, "-c", "256"], "llama-cli")
    # the chat UI prints a banner, "> <prompt>", the answer, then "[ Prompt: ... t/s | Generation: ... ]"
    marker = f"> {QUESTION}\n".encode()
    assert marker in out and b"\n[ Prompt:" in out, out[-2000:]
    return out.split(marker, 1)[1].split(b"\n[ Prompt:", 1)[0].strip(b"\n")


def mtmd_answer(variant: str | None, model: TinyMllama, n_predict: int) -> bytes:
    out = run(tool(variant, "llama-mtmd-cli") + [
        "-m", str(model.text), "--mmproj", str(model.mmproj), "--image", str(model.image), "-p", IMAGE_QUESTION,
        "-n", str(n_predict), "--temp", "0", "-t", THREADS, "-ctk", "f32", "-ctv", "f32", "-fa", "off"],
        "llama-mtmd-cli")
    return out.strip(b"\n")


@pytest.fixture(scope="module")
def llama_x86(tiny_llama, tmp_path_factory) -> DumpRun:
    return dump(None, tiny_llama.gguf, tiny_llama.ids, tmp_path_factory.mktemp("llama-x86"),
                n_steps=len(tiny_llama.chain) - 2, names=TEXT_NAMES)


@pytest.fixture(scope="module")
def mllama_x86(tiny_mllama, tmp_path_factory) -> DumpRun:
    return dump(None, tiny_mllama.text, tiny_mllama.ids, tmp_path_factory.mktemp("mllama-x86"),
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
                _runs[key] = dump(variant, tiny_llama.gguf, tiny_llama.ids, out, n_steps=len(tiny_llama.chain) - 2,
                                  names=TEXT_NAMES)
            else:
                _runs[key] = dump(variant, tiny_mllama.text, tiny_mllama.ids, out, n_steps=MAX_MTMD_TOKENS,
                                  names=TEXT_NAMES + VISION_NAMES, mmproj=tiny_mllama.mmproj, image=tiny_mllama.image)
        return _runs[key]
    return get


# ---------------------------------------------------------------------------------------------------
# checks


def s3d8_reference(model: Path, name: str, x: np.ndarray) -> np.ndarray:
    """The codec's integer reference of ``x @ W^T`` for the S3D8 tensor ``name`` (ggml's arithmetic, bit for bit)."""
    import gguf

    from gguf_s3d8.activations import quantize_activations
    from gguf_s3d8.quantize import decode_int8
    from gguf_s3d8.reference import epilogue, integer_matmul
    from gguf_s3d8.scales import scales_to_fp32

    t = next(t for t in gguf.GGUFReader(model).tensors if t.name == name)
    assert t.tensor_type.name == "S3D8", (name, t.tensor_type.name)
    w_int, alpha = decode_int8(np.asarray(t.data))
    x_q, s_bits = quantize_activations(np.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=np.float32))
    return epilogue(integer_matmul(x_q, w_int), scales_to_fp32(s_bits), alpha).astype(np.float32)


def assert_exact_s3d8(run_: DumpRun, text: Path, *, mmproj: Path | None = None, what: str) -> None:
    """Each dumped S3D8 matmul output is the integer reference on the input this build computed."""
    v = run_.tensors["Vcur-0"]
    assert np.array_equal(v.reshape(-1, v.shape[-1] * (v.shape[-2] if v.ndim == 3 else 1)),
                          s3d8_reference(text, "blk.0.attn_v.weight", run_.tensors["attn_norm-0"])), \
        f"{what}: Vcur-0 is not the S3D8 integer reference of attn_norm-0"
    logits = run_.tensors["result_output"]
    want = s3d8_reference(text, "output.weight", run_.tensors["result_norm"])
    logits = logits.reshape(-1, logits.shape[-1])
    # mllama: the tokenizer has one more token than the output layer (<|image|>), whose logit is -inf
    assert np.all(np.isneginf(logits[:, want.shape[1]:])), f"{what}: logits beyond the output layer are not -inf"
    assert np.array_equal(logits[:, :want.shape[1]], want), \
        f"{what}: the output layer is not the S3D8 integer reference of result_norm"
    if mmproj is not None:
        import gguf

        bias = next(t for t in gguf.GGUFReader(mmproj).tensors if t.name == "mm.0.bias")
        want = s3d8_reference(mmproj, "mm.0.weight", run_.tensors["vision_out"]) + np.asarray(bias.data, np.float32)
        got = run_.tensors["projected"]
        assert np.array_equal(got.reshape(want.shape), want), \
            f"{what}: the vision projector is not the S3D8 integer reference (+ bias) of vision_out"


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| over the finite entries (the mllama output has -inf for <|image|>)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    fin = np.isfinite(b)
    assert np.array_equal(fin, np.isfinite(a)), "the non-finite entries differ"
    return float(np.max(np.abs(a[fin] - b[fin])) / max(np.max(np.abs(b[fin])), 1e-30))


def finite_cols(logits: np.ndarray) -> np.ndarray:
    return logits[:, np.isfinite(logits).all(axis=0)]


def decisions(ref: DumpRun) -> list[tuple[np.ndarray, np.ndarray]]:
    """The greedy decisions of a dump, each with the array whose scale the tolerance is taken of."""
    pl, sl = finite_cols(ref.prompt_logits), finite_cols(ref.step_logits) if ref.step_logits.size else None
    return [(pl[-1], pl)] + ([(row, sl) for row in sl] if sl is not None else [])


def leading_decisive(ref: DumpRun, tol: float) -> int:
    """How many of the reference's greedy decisions, from the first on, lie outside the noise bound."""
    n = 0
    for row, arr in decisions(ref):
        if float(margins(row)) <= tie_bound(arr, tol):
            break
        n += 1
    return n


# --- the binaries --------------------------------------------------------------------------------------


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
    assert cli_answer(None, tiny_llama, 16) == ANSWER.encode()


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_llama_cli_answers_like_x86(variant, tiny_llama, llama_x86):
    # the x86 chain is decisive (test above): within TOL of it, the emulated CLI must print the same answer
    assert_decisive_chain(decisions(llama_x86), TOL, what="tiny Llama answer")
    assert cli_answer(variant, tiny_llama, 16) == ANSWER.encode()


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_llama_logits_against_x86(variant, tiny_llama, llama_x86, aarch64_dump):
    got = aarch64_dump(variant, "llama")
    what = f"{variant} tiny Llama"
    for name in ("attn_norm-0", "Vcur-0"):
        assert np.array_equal(got.tensors[name], llama_x86.tensors[name]), f"{what}: {name} differs from x86"
    assert_exact_s3d8(got, tiny_llama.gguf, what=what)
    e_prompt = rel_err(got.prompt_logits, llama_x86.prompt_logits)
    assert_decisive_chain(decisions(llama_x86), TOL, what="tiny Llama answer")  # so every step compares
    e_steps = rel_err(got.step_logits, llama_x86.step_logits)
    assert e_prompt <= TOL and e_steps <= TOL, f"{what}: logits rel err prompt {e_prompt:.3g}, steps {e_steps:.3g}"
    # measured: 12 of the 35 prompt positions decisive (margins 0.24-0.69 of max|logits|, bound 0.12)
    assert_same_argmax(got.prompt_logits, llama_x86.prompt_logits, TOL, min_rows=8, what=f"{what} prompt")
    assert got.tokens == llama_x86.tokens, f"{what}: greedy tokens {got.tokens} vs x86 {llama_x86.tokens}"


# --- llama-mtmd-cli on the tiny S3D8 Llama 3.2 Vision, with an image ----------------------------------


def decisive_answer(tiny_mllama, mllama_x86) -> tuple[int, bytes]:
    """The number n of leading greedy decisions of the x86 reference outside the noise bound (at least
    MIN_MTMD_TOKENS, asserted) and the bytes of those tokens (end-of-turn tokens left out)."""
    n = leading_decisive(mllama_x86, TOL)
    assert n >= MIN_MTMD_TOKENS, (f"only {n} greedy decisions of the x86 reference lie outside the noise bound, "
                                  f"{MIN_MTMD_TOKENS} needed: the image or the question must change")
    answer = [t for t in mllama_x86.tokens[:n] if t not in (T.EOT_ID, T.EOS_ID)]
    return n, T.token_bytes(tiny_mllama.tok, answer).strip(b"\n")


def test_mllama_reference_is_decisive(tiny_mllama, mllama_x86):
    n, answer = decisive_answer(tiny_mllama, mllama_x86)
    assert mtmd_answer(None, tiny_mllama, n) == answer


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_mtmd_cli_answers_like_x86(variant, tiny_mllama, mllama_x86):
    n, answer = decisive_answer(tiny_mllama, mllama_x86)
    assert mtmd_answer(variant, tiny_mllama, n) == answer


@pytest.mark.parametrize("variant", VARIANT_PARAMS)
def test_mllama_logits_against_x86(variant, tiny_mllama, mllama_x86, aarch64_dump):
    got = aarch64_dump(variant, "mllama")
    what = f"{variant} tiny mllama"
    for name in ("attn_norm-0", "Vcur-0"):
        assert np.array_equal(got.tensors[name], mllama_x86.tensors[name]), f"{what}: {name} differs from x86"
    assert_exact_s3d8(got, tiny_mllama.text, mmproj=tiny_mllama.mmproj, what=what)
    e_cross = rel_err(got.cross[0], mllama_x86.cross[0])
    e_prompt = rel_err(got.prompt_logits, mllama_x86.prompt_logits)
    assert e_cross <= TOL, f"{what}: cross-attention states rel err {e_cross:.3g}"
    assert e_prompt <= TOL, f"{what}: prompt logits rel err {e_prompt:.3g}"
    n = leading_decisive(mllama_x86, TOL)
    assert n >= MIN_MTMD_TOKENS, f"the x86 reference decides only {n} tokens outside the noise bound"
    assert got.tokens[:n] == mllama_x86.tokens[:n], f"{what}: greedy tokens {got.tokens} vs x86 {mllama_x86.tokens}"
    # decode step s is fed token s: the first n steps run on tokens decided outside the noise, so they compare
    e_steps = rel_err(got.step_logits[:n], mllama_x86.step_logits[:n])
    assert e_steps <= TOL, f"{what}: decode-step logits rel err {e_steps:.3g} (first {n} steps)"
    # measured: 13 of the 37 prompt positions decisive (margins 0.12-0.25 of max|logits|)
    assert_same_argmax(finite_cols(got.prompt_logits), finite_cols(mllama_x86.prompt_logits), TOL, min_rows=3,
                       what=f"{what} prompt")

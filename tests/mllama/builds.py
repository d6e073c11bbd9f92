"""One tiny model, two builds: the pieces that compare another build of the tools with the x86 CPU build.

Used by tests/python/test_phone_path.py (the aarch64 builds under QEMU) and tests/python/test_vulkan.py (the Vulkan
build on Mesa's lavapipe): the two tiny S3D8 models (a plain Llama whose greedy answer is fixed by construction, the
tiny Llama 3.2 Vision of tests/mllama), the parity tool's dump of logits and single tensors, the CLIs' answers, and
the checks: S3D8 matmuls equal the codec's integer reference on the input the build itself computed, other arrays
within TOL (max |a - b| / max |b|), greedy tokens only where the reference's margin exceeds the noise bound
(tests.mllama.margins). test_phone_path.py's docstring says why TOL is what it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.mllama import harness, tiny_model as T
from tests.mllama.margins import assert_same_argmax, assert_same_greedy_chain, chain_margins, decisive_count

TOL = 6e-2
THREADS = "2"
TIMEOUT = 900  # seconds per run (measured: under 30 s each under QEMU on a loaded 2-core machine)

QUESTION = "What is the capital of France?"
ANSWER = "It is Paris."
IMAGE_QUESTION = "Describe this picture in one sentence, please."
MIN_MTMD_TOKENS = 2
MAX_MTMD_TOKENS = 8

# graph tensors the dump tool writes besides the logits (tools/mllama-dump --dump-name)
TEXT_NAMES = ("attn_norm-0", "Vcur-0", "result_norm", "result_output")
VISION_NAMES = ("vision_out", "projected")


def run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> bytes:
    p = subprocess.run(cmd, capture_output=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL,
                       env=None if env is None else {**os.environ, **env})
    if p.returncode != 0:
        raise AssertionError(f"{what} failed ({p.returncode}):\n{' '.join(cmd)}\n"
                             f"{p.stderr.decode(errors='replace')[-4000:]}")
    return p.stdout


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


def make_tiny_llama(out: Path) -> TinyLlama:
    """A 2-layer Llama (hidden 1152, 9 heads / 3 kv heads, ffn 1280, the toy tokenizer of tests/mllama: 512 rows,
    every matrix S3D8-eligible), converted to f32 by convert/to_gguf.py and quantised by llama-quantize to S3D8.

    Weights are random (std 0.02; embeddings 0.1) except for the answer: the output row of each token of
    ``ANSWER`` (and of end of turn) is the embedding of the token before it, the first after the prompt's last
    token, so the greedy answer to any chat prompt is ``ANSWER`` with large margins."""
    from transformers import AutoTokenizer

    from fixtures.synthetic import llama_tensors, write_tiny_llama

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
    hf = write_tiny_llama(out / "hf", tok_dir, tensors=tensors, tied=False, **dims,
                          config_overrides={"bos_token_id": T.BOS_ID, "eos_token_id": [T.EOS_ID, T.EOT_ID]})
    f32, s3d8 = out / "f32.gguf", out / "s3d8.gguf"
    run([sys.executable, "-m", "convert.to_gguf", str(hf), "--type", "f32", "--tokenizer-pre", "llama-bpe",
         "-o", str(f32), "--no-progress"], "convert.to_gguf")
    # --pure: every matrix S3D8 (the S3D8 file type otherwise gives the last block's ffn_down IQ4_XS)
    run([str(harness.binary("llama-quantize")), "--pure", str(f32), str(s3d8), "S3D8", "2"], "llama-quantize")
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


def make_tiny_mllama(out: Path) -> TinyMllama:
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
    image = out / "img.png"
    rng = np.random.default_rng(10)  # measured margins of the first 3 answer tokens: 0.21, 0.18, 0.14 (bound 0.12)
    Image.fromarray(rng.integers(0, 256, (T.IMAGE_SIZE, T.IMAGE_SIZE, 3), dtype=np.uint8)).save(image)
    return TinyMllama(text, mmproj, tok, ids, image)


@dataclass
class DumpRun:
    prompt_logits: np.ndarray
    step_logits: np.ndarray
    tokens: list[int]
    cross: list[np.ndarray]
    tensors: dict[str, np.ndarray]


def dump(prefix: list[str], model: Path, ids: list[int], out: Path, *, n_steps: int, names: tuple[str, ...],
         mmproj: Path | None = None, image: Path | None = None, extra: tuple[str, ...] = (),
         env: dict[str, str] | None = None) -> DumpRun:
    """The parity tool (prefix: its command, e.g. under QEMU) on the token ids, with extra options."""
    tdir = out / "tensors"
    tdir.mkdir(parents=True, exist_ok=True)
    cmd = prefix + [
        "-m", str(model), "--tokens", ",".join(map(str, ids)), "--n-steps", str(n_steps), "-ctk", "f32",
        "-ctv", "f32", "-fa", "off", "-t", THREADS, "-o", str(out), "--dump-tensors", str(tdir)]
    for name in names:
        cmd += ["--dump-name", name]
    if mmproj is not None:
        cmd += ["--mmproj", str(mmproj), "--image", str(image)]
    run(cmd + list(extra), "llama-mllama-dump", env)
    return DumpRun(np.load(out / "prompt_logits.npy"), np.load(out / "step_logits.npy"),
                   [int(t) for t in np.load(out / "tokens.npy")],
                   [np.load(out / "cross_0.npy")] if image is not None else [],
                   {name: np.load(tdir / f"{name}.npy") for name in names})


def cli_answer(prefix: list[str], model: TinyLlama, n_predict: int, extra: tuple[str, ...] = (),
               env: dict[str, str] | None = None) -> bytes:
    out = run(prefix + ["-m", str(model.gguf), "-p", QUESTION, "-n", str(n_predict), "-st",
                                            "--temp", "0", "-t", THREADS, "-c", "256", *extra], "llama-cli", env)
    # the chat UI prints a banner, "> <prompt>", the answer, then "[ Prompt: ... t/s | Generation: ... ]"
    marker = f"> {QUESTION}\n".encode()
    assert marker in out and b"\n[ Prompt:" in out, out[-2000:]
    return out.split(marker, 1)[1].split(b"\n[ Prompt:", 1)[0].strip(b"\n")


def mtmd_answer(prefix: list[str], model: TinyMllama, n_predict: int, extra: tuple[str, ...] = (),
                env: dict[str, str] | None = None) -> bytes:
    out = run(prefix + [
        "-m", str(model.text), "--mmproj", str(model.mmproj), "--image", str(model.image), "-p", IMAGE_QUESTION,
        "-n", str(n_predict), "--temp", "0", "-t", THREADS, "-ctk", "f32", "-ctv", "f32", "-fa", "off", *extra],
        "llama-mtmd-cli", env)
    return out.strip(b"\n")


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
    return decisive_count(*chain_margins(decisions(ref), tol))


# --- the binaries --------------------------------------------------------------------------------------
def decisive_answer(tiny_mllama, mllama_x86) -> tuple[int, bytes]:
    """The number n of leading greedy decisions of the x86 reference outside the noise bound (at least
    MIN_MTMD_TOKENS, asserted) and the bytes of those tokens (end-of-turn tokens left out)."""
    n = leading_decisive(mllama_x86, TOL)
    assert n >= MIN_MTMD_TOKENS, (f"only {n} greedy decisions of the x86 reference lie outside the noise bound, "
                                  f"{MIN_MTMD_TOKENS} needed: the image or the question must change")
    answer = [t for t in mllama_x86.tokens[:n] if t not in (T.EOT_ID, T.EOS_ID)]
    return n, T.token_bytes(tiny_mllama.tok, answer).strip(b"\n")


def assert_mllama_close(got: DumpRun, ref: DumpRun, *, what: str, ref_name: str) -> None:
    """A build's run of the tiny mllama against the reference build's: cross-attention states and prompt logits within
    TOL, the greedy tokens the reference decides outside the noise bound (at least MIN_MTMD_TOKENS), the decode steps
    fed those tokens within TOL, and the argmax of the decisive prompt positions (at least 3)."""
    e_cross = rel_err(got.cross[0], ref.cross[0])
    e_prompt = rel_err(got.prompt_logits, ref.prompt_logits)
    assert e_cross <= TOL, f"{what}: cross-attention states rel err {e_cross:.3g}"
    assert e_prompt <= TOL, f"{what}: prompt logits rel err {e_prompt:.3g}"
    n = assert_same_greedy_chain(got.tokens, ref.tokens, decisions(ref), TOL, what=f"{what} vs {ref_name}",
                                 min_decisive=MIN_MTMD_TOKENS)
    # decode step s is fed token s: the first n steps run on tokens decided outside the noise, so they compare
    e_steps = rel_err(got.step_logits[:n], ref.step_logits[:n])
    assert e_steps <= TOL, f"{what}: decode-step logits rel err {e_steps:.3g} (first {n} steps)"
    # measured (x86 reference): 13 of the 37 prompt positions decisive (margins 0.12-0.25 of max|logits|)
    assert_same_argmax(finite_cols(got.prompt_logits), finite_cols(ref.prompt_logits), TOL, min_rows=3,
                       what=f"{what} prompt")

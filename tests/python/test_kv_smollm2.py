"""KV-cache types on a real model (issue 13 part 3): SmolLM2-135M-Instruct (head size 64, 3 KV heads) with
K-only, V-only and K+V caches of Q4_HQQ and TQ3_0 (and the write-up's K Q4_HQQ + V TQ3_0) keeps its text.

Measured with llama-perplexity --kl-divergence against the same model with an F16 cache (flash attention
on in both, the pinned tree's Hadamard rotation on, as it is by default for quantised caches), on held-out
Wikipedia text: mean KLD and the share of positions whose top token is unchanged (teacher-forced greedy
agreement, robust to the fp-order differences between AVX2, AVX512 and NEON builds, unlike comparing one
free-running greedy continuation, which a near tie can fork). Each bound sits well above the measured
value (docs/kv-cache.md has the figures) and far below a broken K or V path: a K.Q kernel that pairs the
wrong blocks gives a KLD of several nats and a top-token agreement near chance, as the write-up's
gibberish TQ3_0 K did.

Also: a 128-value block type cannot serve 64-wide heads - a clear error before any allocation, with and
without flash attention (it used to fail an assertion in ggml_view without it); an unknown type is refused.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fixtures import assets
from qat import llama_perplexity

REPO = Path(__file__).resolve().parents[2]
CTX, CHUNKS, THREADS = "256", "4", "2"


def tool(name: str) -> str:
    exe = Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin")) / name
    if not exe.is_file():
        pytest.fail(f"{exe} not found: build llama.cpp first (`bash ci/build.sh host`) or set S3D8_BIN_DIR")
    return str(exe)


def run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                          env={**os.environ, "OMP_NUM_THREADS": THREADS, **(env or {})})


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("kv")
    text = d / "eval.txt"
    text.write_text(assets.wiki_text("eval")[:40000], encoding="utf-8")
    model = assets.smollm2_gguf_path()
    logits = d / "f16-cache.kld"
    r = run([tool("llama-perplexity"), "-m", str(model), "-f", str(text), "-c", CTX, "--chunks", CHUNKS,
             "-t", THREADS, "-fa", "on", "--kl-divergence-base", str(logits)])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return {"model": model, "text": text, "logits": logits}


def kld(base: dict[str, Path], k: str, v: str, env: dict[str, str] | None = None, *, logits: Path | None = None,
        chunks: str = CHUNKS, extra: tuple[str, ...] = (), threads: str = THREADS) -> tuple[float, float]:
    """Mean KLD (nats) and same-top-token share (%) of a K/V cache type pair against the F16 cache's logits
    (``base["logits"]`` unless given; ``chunks`` and ``extra`` options as that base was made with)."""
    r = run([tool("llama-perplexity"), "-m", str(base["model"]), "-f", str(base["text"]), "-c", CTX,
             "--chunks", chunks, *extra, "-t", threads, "-fa", "on", "-ctk", k, "-ctv", v,
             "--kl-divergence-base", str(logits or base["logits"]), "--kl-divergence"], env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    result = llama_perplexity.parse(out, kld=True)
    return result.kld, result.same_top


# (K, V): (max mean KLD, min same-top %). Measured at this commit (x86 AVX512, 4 x 256 tokens): see
# docs/kv-cache.md; the limits leave about 2x head-room on the KLD and 5-7 points on the agreement.
BOUNDS = {                            # measured: KLD, same top %
    ("q4_hqq", "f16"):    (0.08, 87.0),   # 0.0386, 92.5   (Q4_1 K 0.0438, Q4_0 K 0.0482)
    ("f16", "q4_hqq"):    (0.03, 89.0),   # 0.0120, 93.9   (Q4_1 V 0.0138, Q4_0 V 0.0139)
    ("q4_hqq", "q4_hqq"): (0.10, 84.0),   # 0.0490, 88.8   (Q4_1 0.0499, Q4_0 0.0573)
    ("tq3_0", "f16"):     (0.35, 74.0),   # 0.187,  80.7
    ("f16", "tq3_0"):     (0.09, 83.0),   # 0.0424, 88.6
    ("tq3_0", "tq3_0"):   (0.45, 71.0),   # 0.242,  78.0
    ("q4_hqq", "tq3_0"):  (0.15, 80.0),   # 0.0739, 85.8
}


@pytest.mark.parametrize(("k", "v"), list(BOUNDS), ids=[f"K-{k}-V-{v}" for k, v in BOUNDS])
def test_kv_cache_type_keeps_the_text(base: dict[str, Path], k: str, v: str) -> None:
    max_kld, min_top = BOUNDS[(k, v)]
    got_kld, got_top = kld(base, k, v)
    assert got_kld <= max_kld and got_top >= min_top, f"K {k} V {v}: KLD {got_kld}, same top {got_top} %"


# The decode path: one token per llama_decode (-ub 1), as in generation, teacher-forced on one 256-token chunk
# against the F16 cache decoded the same way. (Comparing free-running greedy llama-cli text instead, as this test
# first did, hinged on near ties: on a later build the TQ3_0 answer forked after "Photosynthesis is a vital
# process that occurs in plants, algae, and some" into a repetition naming one topic word, and the test failed.)
# Two chunks (256 scored tokens): one chunk alone is too few for a same-top bound - measured on one chunk
# TQ3_0 K+V 0.208, 67.7 +- 4.2 % (AMD EPYC Zen 5, 2026-12-02), below the 71 % that was set against two chunks.
# Measured on two chunks (same machine): TQ3_0 K+V 0.168, 79.9 +- 2.5 %; Q4_HQQ K+V 0.0335, 91.7 +- 1.7 %
# (an earlier build: 0.181, 83.5 %; 0.0388, 91.7 %). The bounds leave 2.5x on the KLD and 3.5-4.5 standard
# errors on the agreement.
# One thread: 512 single-token decodes are 512 rounds of thread barriers, and with the suite's workers and a busy
# loop on each of the 2 cores a waiting thread spins while the other one is descheduled - 2 threads took 407 s
# for one such run under that load (issue 14, run 4; 12 s unloaded), against the harness's 600 s per command.
DECODE = ("-ub", "1")
DECODE_CHUNKS = "2"
DECODE_THREADS = "1"
DECODE_BOUNDS = {("tq3_0", "tq3_0"): (0.45, 71.0), ("q4_hqq", "q4_hqq"): (0.10, 84.0)}


@pytest.fixture(scope="module")
def decode_base(base: dict[str, Path]) -> Path:
    logits = base["logits"].with_name("f16-cache-decode.kld")
    r = run([tool("llama-perplexity"), "-m", str(base["model"]), "-f", str(base["text"]), "-c", CTX,
             "--chunks", DECODE_CHUNKS, *DECODE, "-t", DECODE_THREADS, "-fa", "on", "--kl-divergence-base", str(logits)])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return logits


@pytest.mark.parametrize(("k", "v"), list(DECODE_BOUNDS), ids=[f"K-{k}-V-{v}" for k, v in DECODE_BOUNDS])
def test_decode_path_keeps_the_text(base: dict[str, Path], decode_base: Path, k: str, v: str) -> None:
    """Token-by-token decoding with a quantised cache (the generation path; the 3-bit K is the one the
    write-up's bug broke) keeps the F16 cache's predictions, teacher-forced: a broken K or V path gives
    several nats and near-chance agreement."""
    max_kld, min_top = DECODE_BOUNDS[(k, v)]
    got_kld, got_top = kld(base, k, v, logits=decode_base, chunks=DECODE_CHUNKS, extra=DECODE, threads=DECODE_THREADS)
    assert got_kld <= max_kld and got_top >= min_top, f"K {k} V {v}: KLD {got_kld}, same top {got_top} %"


def test_llama_cli_generates_with_a_3_bit_cache(base: dict[str, Path]) -> None:
    """llama-cli runs a chat turn with TQ3_0 K and V caches and prints an answer (what it says is the decode
    test's business: free-running greedy text forks at near ties)."""
    prompt = "Explain in a few sentences how photosynthesis works."
    r = run([tool("llama-cli"), "-m", str(base["model"]), "-p", prompt, "-n", "16", "-st", "--temp", "0",
             "-t", THREADS, "-c", "256", "-fa", "on", "-ctk", "tq3_0", "-ctv", "tq3_0"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert r.stdout.split(f"> {prompt}", 1)[-1].split("[ Prompt:", 1)[0].strip(), r.stdout[-3000:]


def test_rotation_off_works(base: dict[str, Path]) -> None:
    """LLAMA_ATTN_ROT_DISABLE=1: the caches still work (without rotation outlier channels hurt: worse, not broken)."""
    got_kld, got_top = kld(base, "q4_hqq", "q4_hqq", {"LLAMA_ATTN_ROT_DISABLE": "1"})
    assert got_kld <= 0.25 and got_top >= 78.0, (got_kld, got_top)   # measured 0.105, 85.0


@pytest.mark.parametrize("fa", ["on", "off"])
def test_block_128_on_head_64_is_a_clear_error(base: dict[str, Path], fa: str) -> None:
    r = run([tool("llama-perplexity"), "-m", str(base["model"]), "-f", str(base["text"]), "-c", CTX,
             "--chunks", "1", "-t", THREADS, "-fa", fa, "-ctk", "q4_hqq_128"])
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "GGML_ASSERT" not in out, out[-3000:]
    assert "K cache type q4_hqq_128 with block size 128 does not divide n_embd_head_k=64" in out, out[-3000:]


def test_unknown_cache_type_is_refused(base: dict[str, Path]) -> None:
    r = run([tool("llama-perplexity"), "-m", str(base["model"]), "-ctv", "tq3_1"])
    assert r.returncode != 0 and "Unsupported cache type: tq3_1" in r.stdout + r.stderr


def test_quantised_v_without_flash_attention_is_a_clear_error(base: dict[str, Path]) -> None:
    r = run([tool("llama-perplexity"), "-m", str(base["model"]), "-f", str(base["text"]), "-c", CTX,
             "--chunks", "1", "-t", THREADS, "-fa", "off", "-ctv", "tq3_0"])
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "quantized V cache requires flash_attn to be enabled" in out, out[-3000:]


@pytest.mark.parametrize("name", ["llama-cli", "llama-server", "llama-mtmd-cli", "llama-perplexity"])
def test_every_tool_lists_the_types(name: str) -> None:
    """-ctk/-ctv of the common argument parser (llama-bench has its own parser, tested above)."""
    r = run([tool(name), "--help"])
    text = " ".join((r.stdout + r.stderr).split())   # the help text wraps the list
    assert "allowed values: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1, q4_hqq, q4_hqq_128, tq3_0" in text


def test_quantised_v_turns_flash_attention_on(base: dict[str, Path]) -> None:
    """-fa auto (the default) with a quantised V: flash attention is enabled, with a log line (an info line
    of llama_init_from_model, shown from verbosity 4 on, -lv 4)."""
    r = run([tool("llama-perplexity"), "-m", str(base["model"]), "-f", str(base["text"]), "-c", CTX,
             "--chunks", "1", "-t", THREADS, "-fa", "auto", "-ctk", "q4_hqq", "-ctv", "tq3_0", "-lv", "4"])
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "enabling flash_attn since it is required for quantized V cache" in out, out[-3000:]


def test_llama_bench_takes_the_types(base: dict[str, Path]) -> None:
    r = run([tool("llama-bench"), "-m", str(base["model"]), "-p", "8", "-n", "2", "-r", "1", "-t", THREADS,
             "-fa", "1", "-ctk", "q4_hqq", "-ctv", "tq3_0", "-o", "csv"])
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if '"q4_hqq","tq3_0"' in ln]
    assert len(rows) == 2, r.stdout


def test_llama_quantize_takes_the_hqq_weight_types(base: dict[str, Path], tmp_path: Path) -> None:
    """Q4_HQQ / Q4_HQQ_128 as weight types (the write-up's other use): four layers' matrices (576-wide rows
    cannot take 128-blocks, ffn_down's 1536 can), the model loads and its perplexity stays close."""
    out = tmp_path / "hqq.gguf"
    r = run([tool("llama-quantize"), "--allow-requantize",
             "--tensor-type", r"blk\.[0-3]\.ffn_down.*=q4_hqq_128",
             "--tensor-type", r"blk\.[0-3]\.(attn|ffn_up|ffn_gate).*=q4_hqq",
             str(base["model"]), str(out), "Q8_0", THREADS])
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert log.count("converting to q4_hqq_128") == 4 and log.count("converting to q4_hqq ") == 24, log[-3000:]
    ppl = []
    for m in (base["model"], out):
        p = run([tool("llama-perplexity"), "-m", str(m), "-f", str(base["text"]), "-c", CTX, "--chunks", "1",
                 "-t", THREADS])
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
        ppl.append(llama_perplexity.parse(p.stdout + p.stderr, kld=False).ppl)
    # measured on 2 chunks: 9.95 (the Q4_1 original) -> 10.34
    assert ppl[1] < 1.1 * ppl[0], ppl

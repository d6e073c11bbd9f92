#!/usr/bin/env python3
"""Mutation check: does the suite notice a small fault where it matters? (docs/reliability.md, "Mutation check")

A curated list of faults (``MUTANTS``), each one edit of one line of the applied series (``work/llama.cpp``) or of
the Python codec: an off-by-one in the triple packing, a sign bit dropped, a wrong rounding mode, a swapped epilogue
order, a bounds check removed from a loader, a cross-attention mask shifted by a row, a KV dequantisation off by a
block, an HQQ zero point ignored, a flash-attention tile boundary, the GPTQ update's sign, the imatrix column
mapping, the Vulkan shaders' arithmetic... For each, one at a time: apply it, rebuild what the tests of that code
need, run only those tests (``SUITES``), and restore the line. A mutant is *killed* when the tests fail, *survived*
when they pass (the suite missed the fault), *timed out* when they run past the suite's limit. A mutant whose line
is not found exactly once, or that does not build, is *stale* (the list must follow the code): an error.

    python3 ci/mutants.py --list                       # the faults
    python3 ci/mutants.py                              # all of them; writes docs/data/mutants.json and the table
    python3 ci/mutants.py --only cpu-decode-w1-shift   # some (comma-separated ids)
    python3 ci/mutants.py --sample 5 --seed 20261207   # CI: five drawn by the day's seed; fails on a survivor

A fault that needs a CPU feature this machine lacks (an AVX-512 kernel on an AVX2 machine) is reported as
*not applicable*. Restoring replaces the mutated line by the original again (so concurrent edits elsewhere in the
file survive) and the binaries are rebuilt at the end; an interrupted run restores too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = str(REPO / ".venv" / "bin" / "python")


@dataclass(frozen=True)
class Suite:
    """The tests that cover some code: what to build (preset, targets) and the command that runs them."""
    builds: tuple[tuple[str, tuple[str, ...]], ...]
    command: tuple[str, ...]
    timeout: int = 900


def ctest(preset: str, regex: str) -> tuple[str, ...]:
    return ("ctest", "--test-dir", f"build/{preset}", "-R", regex, "--output-on-failure", "-j2")


def pytest(*args: str) -> tuple[str, ...]:
    return (PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args)


HOST_S3D8 = ("test-s3d8-kernels", "test-s3d8-ops", "test-s3d8-golden", "test-backend-ops")
REPLAYS = ("fuzz-s3d8-rows-replay", "fuzz-gguf-model-replay", "fuzz-mllama-text-replay", "fuzz-mmproj-replay",
           "fuzz-image-replay", "test-image-bomb")
MLLAMA_TOOLS = ("llama-mllama-dump", "llama-mtmd-cli", "llama-cli")

SUITES: dict[str, Suite] = {
    # the S3D8 CPU kernels, activation quantisation and epilogue: exact against independent references
    "cpu-s3d8": Suite((("host", HOST_S3D8),),
                      ctest("host", "^(test-s3d8-kernels|test-s3d8-ops|test-s3d8-golden|test-backend-ops-s3d8)$")),
    # the S3D8 container validator: the fuzz replays (expected outcomes) and the op tests
    "s3d8-validate": Suite((("host", HOST_S3D8 + ("fuzz-s3d8-rows-replay",)),),
                           ctest("host", "^(fuzz-replay-s3d8-rows|test-s3d8-ops|test-s3d8-golden)$")),
    # the loaders of GGUF models, projectors and images
    "loaders": Suite((("host", REPLAYS),), ctest("host", "^(fuzz-replay-.*|test-image-bomb)$")),
    # the KV-cache types
    "kv": Suite((("host", ("test-kv-types",)),), ctest("host", "^test-kv-types$")),
    # the CPU flash attention of the vision encoder and the vector GELU
    "encoder": Suite((("host", ("test-backend-ops",)),), ctest("host", "^test-backend-ops-encoder$")),
    # mllama's text model against transformers (cross-attention, its mask and gates)
    "mllama": Suite((("host", MLLAMA_TOOLS),), pytest("tests/python/test_mllama_parity.py"), 1200),
    # GPTQ in C and the X^T X that llama-imatrix saves for it
    "gptq": Suite((("host", ("llama-quantize", "llama-imatrix")),),
                  pytest("tests/python/test_gptq_c.py", "-k", "xtx_file or matches_the_torch or lowers"), 1500),
    # the Vulkan shaders: test-backend-ops against the CPU backend on lavapipe, and their arithmetic compiled as C++
    "vulkan": Suite((("vulkan", ("test-backend-ops",)), ("host", ("test-vulkan-s3d8-arith",))),
                    ("sh", "-c", "ctest --test-dir build/vulkan -R '^test-backend-ops-vulkan-s3d8' -E no-case "
                                 "--output-on-failure && ctest --test-dir build/host -R '^test-vulkan-s3d8-arith$' "
                                 "--output-on-failure"), 1500),
    # the numpy codec: its unit tests, the golden files and the format-spec reader
    "codec": Suite((), pytest(*sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "python").glob("test_codec_*.py")))),
}


@dataclass(frozen=True)
class Mutant:
    id: str
    path: str            # relative to the repository (tree files under work/llama.cpp/)
    old: str             # must occur exactly once in the file
    new: str
    suite: str
    what: str
    needs: tuple[str, ...] = field(default=())   # /proc/cpuinfo flags the mutated code runs only with
    equivalent: str = ""  # why no test can kill it (it changes no behaviour): a survival is then "equivalent"


T = "work/llama.cpp/"
CPU = T + "ggml/src/ggml-cpu/s3d8.c"
X86 = T + "ggml/src/ggml-cpu/arch/x86/s3d8.c"
S3D8 = T + "ggml/src/ggml-s3d8.c"
KVQ = T + "ggml/src/ggml-kvq.c"
KVQ_CPU = T + "ggml/src/ggml-cpu/kvq.c"
SH = T + "ggml/src/ggml-vulkan/vulkan-shaders/"

MUTANTS: tuple[Mutant, ...] = (
    # --- S3D8 CPU: decode, kernels, activations, epilogue ---------------------------------------------------------
    Mutant("cpu-decode-w1-shift", CPU, "*w1 = tab->s[1][(b >> 1) & 0x3f];", "*w1 = tab->s[1][(b >> 2) & 0x3f];",
           "cpu-s3d8", "the generic decode reads row 1's index one bit off"),
    Mutant("cpu-decode-s2-dropped", CPU, "*w2 = tab->s[2][(b & 0x3f) ^ (b >> 7)];", "*w2 = tab->s[2][(b & 0x3f)];",
           "cpu-s3d8", "the generic decode drops row 2's sign bit (the xor with bit 7)"),
    Mutant("cpu-gemv-row-swap", CPU, "a2 += (int32_t) x[j] * w2;", "a2 += (int32_t) x[j] * w1;",
           "cpu-s3d8", "the generic gemv accumulates row 1's weight into row 2"),
    Mutant("cpu-gemm-triple-packing", CPU, "int8_t * w2 = w + (3*p + 2)*k;", "int8_t * w2 = w + (3*p + 1)*k;",
           "cpu-s3d8", "the generic gemm decodes a triple's third row over its second (off by one)"),
    Mutant("cpu-unsigned-table-bias", CPU, "t->u[d][i] = (uint8_t) (t->s[d][i] + 128);",
           "t->u[d][i] = (uint8_t) (t->s[d][i] + 127);", "cpu-s3d8",
           "the u8 tables of the VNNI kernels biased by 127 instead of 128"),
    Mutant("cpu-act-scale-127", CPU, "GGML_BF16_TO_FP32(GGML_FP32_TO_BF16(amax / 127.0f))",
           "GGML_BF16_TO_FP32(GGML_FP32_TO_BF16(amax / 128.0f))", "cpu-s3d8", "the activation scale divides by 128"),
    Mutant("cpu-act-round-half-away", CPU, "(int32_t) nearbyintf(v) : 0", "(int32_t) roundf(v) : 0", "cpu-s3d8",
           "activations rounded half away from zero instead of half to even"),
    Mutant("cpu-act-clamp-128", CPU, "v = v < -127.0f ? -127.0f : v;", "v = v < -128.0f ? -128.0f : v;",
           "cpu-s3d8", "activations clamped at -128"),
    Mutant("cpu-act-nan-max", CPU, "u &= 0u - (uint32_t) (u <= 0x7f800000u);", "/* NaN kept */",
           "cpu-s3d8", "a NaN activation becomes the row's maximum (its scale NaN) instead of counting as 0"),
    Mutant("cpu-epilogue-order-gemv", CPU, "y[r] = ((float) acc[r] * s) * alpha[r];",
           "y[r] = (float) acc[r] * (s * alpha[r]);", "cpu-s3d8", "the one-token epilogue multiplies s * alpha first"),
    Mutant("cpu-epilogue-order-gemm", CPU, "y[r] = ((float) a[r] * s) * alpha[r];",
           "y[r] = (float) a[r] * (s * alpha[r]);", "cpu-s3d8", "the many-token epilogue multiplies s * alpha first"),
    Mutant("x86-unbias-xsum", X86, "return (int32_t) ((uint32_t) sum - 128u*(uint32_t) xsum);",
           "return (int32_t) ((uint32_t) sum - 127u*(uint32_t) xsum);", "cpu-s3d8",
           "the VNNI kernels remove 127 * sum(x) of the +128 bias", ("avx512_vnni",)),
    # --- the S3D8 format: tables, validator, GPTQ -------------------------------------------------------------------
    Mutant("tables-l1-sign", S3D8, "tables[1][32 + l]  = (int8_t) -c1;", "tables[1][32 + l]  = (int8_t)  c1;",
           "cpu-s3d8", "the decode table of row 1 loses its negative half"),
    Mutant("tables-l0-interleave", S3D8, "tables[0][2*l + 1] = (int8_t) -c0;", "tables[0][2*l + 1] = (int8_t) c0;",
           "cpu-s3d8", "the decode table of row 0 loses the sign bit"),
    Mutant("validate-size-bound", S3D8, "if (slice > nbytes) {", "if (slice > nbytes + 1) {", "s3d8-validate",
           "the validator accepts a container one byte shorter than its shape needs"),
    Mutant("validate-codebook-range", S3D8, "if (cb[i] > GGML_S3D8_CODE_MAX) {", "if (cb[i] > GGML_S3D8_CODE_MAX + 1) {",
           "s3d8-validate", "the validator accepts a codebook entry of 128"),
    Mutant("validate-scale-finite", S3D8, "if ((bits & 0x7f80) == 0x7f80) {", "if ((bits & 0x7fff) == 0x7f80) {",
           "s3d8-validate", "the validator accepts a NaN scale (only +-inf rejected)"),
    Mutant("gptq-update-sign", S3D8, "w[b] -= x*l[b];", "w[b] += x*l[b];", "gptq",
           "GPTQ spreads a column's error with the wrong sign"),
    # --- loaders --------------------------------------------------------------------------------------------------
    Mutant("gguf-kv-type-bound", T + "ggml/src/gguf.cpp", "if (t < 0 || t >= GGUF_TYPE_COUNT) {",
           "if (t < 0 || t > GGUF_TYPE_COUNT) {", "loaders", "gguf accepts the value type one past the last"),
    Mutant("gguf-nelements-overflow", T + "ggml/src/gguf.cpp", "if (INT64_MAX / info.t.ne[i] <= current_nelements) {",
           "if (false && INT64_MAX / info.t.ne[i] <= current_nelements) {", "loaders",
           "gguf no longer checks a tensor's element count for overflow"),
    Mutant("gguf-tensor-type-bound", T + "ggml/src/gguf.cpp", "if (type < 0 || type >= GGML_TYPE_COUNT) {",
           "if (type < 0 || type > GGML_TYPE_COUNT + 1000000000) {", "loaders",
           "gguf accepts a tensor type beyond the known ones"),
    Mutant("llama-block-count", T + "src/llama-model.cpp",
           "if (hparams.n_layer_all == 0 || hparams.n_layer_all > LLAMA_MAX_LAYERS) {",
           "if (hparams.n_layer_all > LLAMA_MAX_LAYERS) {", "loaders", "a model with 0 blocks loads"),
    Mutant("llama-norm-eps", T + "src/llama-model.cpp",
           "if (!(hparams.f_norm_eps >= 0.0f) || !(hparams.f_norm_rms_eps >= 0.0f)) {",
           "if (!(hparams.f_norm_eps >= 0.0f)) {", "loaders", "a negative or NaN RMS norm epsilon loads"),
    Mutant("llama-duplicate-tokens", T + "src/llama-vocab.cpp", "if (id_to_token.size() != token_to_id.size()) {",
           "if (false) {", "loaders", "a vocabulary with duplicate tokens loads"),
    Mutant("llama-slice-validate", T + "src/llama-model-loader.cpp",
           "if (!ggml_slice_validate_tensor(t, data, size, err, sizeof(err))) {", "if (false) {", "loaders",
           "S3D8 tensors are not validated at load"),
    Mutant("clip-block-count", T + "tools/mtmd/clip.cpp", "if (hparams.n_layer < 0 || hparams.n_layer > 4096) {",
           "if (hparams.n_layer < 0) {", "loaders", "the projector's block count is not bounded"),
    Mutant("mtmd-max-pixels", T + "tools/mtmd/mtmd-helper.cpp", "if (n_pixels > MTMD_HELPER_MAX_IMAGE_PIXELS) {",
           "if (n_pixels > 4*MTMD_HELPER_MAX_IMAGE_PIXELS) {", "loaders",
           "images four times the pixel limit are decoded"),
    Mutant("mtmd-no-pixels", T + "tools/mtmd/mtmd-helper.cpp", "if (data && (nx <= 0 || ny <= 0)) {",
           "if (false) {", "loaders", "a decoded image without pixels is accepted"),
    # --- KV-cache types -------------------------------------------------------------------------------------------
    Mutant("hqq-zero-ignored", KVQ, "y[32*b + j]      = d*(float) (qs[16*b + j] & 0x0F) + m;",
           "y[32*b + j]      = d*(float) (qs[16*b + j] & 0x0F);", "kv", "HQQ dequantisation ignores the zero point"),
    Mutant("hqq-scale-off-by-one", KVQ, "kvq_dequantize_hqq(x[i].d, x[i].m, x[i].qs, QK4_HQQ, y + i*QK4_HQQ);",
           "kvq_dequantize_hqq(x[i > 0 ? i - 1 : 0].d, x[i].m, x[i].qs, QK4_HQQ, y + i*QK4_HQQ);", "kv",
           "q4_hqq dequantisation takes the previous block's scale"),
    Mutant("tq3-high-bit", KVQ, "y[i*QK_TQ3_0 + j] = d*(float) kvalues_tq3_0[q];",
           "y[i*QK_TQ3_0 + j] = d*(float) kvalues_tq3_0[q & 3];", "kv", "tq3_0 dequantisation drops the high bit"),
    Mutant("tq3-level-midpoint", KVQ, "(v > 20.5f)", "(v > 21.5f)", "kv",
           "tq3_0 quantisation puts a level boundary off the midpoint"),
    Mutant("kv-dot-generic-high-bit", KVQ_CPU,
           "& 1) << 2);\n            sumi += kvalues_tq3_0[q]*y[i].qs[j];",
           "& 1) << 1);\n            sumi += kvalues_tq3_0[q]*y[i].qs[j];", "kv",
           "the generic tq3_0 dot product reads the high bit as the middle one"),
    # --- mllama: cross-attention ----------------------------------------------------------------------------------
    Mutant("cross-mask-shifted", T + "src/llama-kv-cache-cross.cpp",
           "std::fill(row.begin() + s.e->row0, row.begin() + s.e->row0 + s.e->n_valid, 0.0f);",
           "std::fill(row.begin() + s.e->row0 + 1, row.begin() + s.e->row0 + s.e->n_valid + 1, 0.0f);", "mllama",
           "the cross-attention mask is shifted by one row"),
    Mutant("cross-ffn-gate-mask", T + "src/llama-kv-cache-cross.cpp", "f_data[i] = attends    ? 1.0f : 0.0f;",
           "f_data[i] = 1.0f;", "mllama", "tokens that attend no image keep the cross-attention MLP's output"),
    Mutant("cross-attn-gate-tanh", T + "src/models/mllama.cpp",
           "cur = ggml_mul(ctx0, cur, ggml_tanh(ctx0, layer.cross_attn_gate));",
           "cur = ggml_mul(ctx0, cur, layer.cross_attn_gate);", "mllama", "the attention gate without its tanh"),
    # --- the encoder's flash attention ----------------------------------------------------------------------------
    Mutant("fa-kv-tile-boundary", T + "ggml/src/ggml-cpu/ops.cpp",
           "const int     kv_tile = (int) std::min((int64_t) KV_TILE_SZ, nek1 - ic);",
           "const int     kv_tile = (int) std::min((int64_t) KV_TILE_SZ - 1, nek1 - ic);", "encoder",
           "the tiled flash attention drops the last key of every full tile"),
    Mutant("fa-mask-summary", T + "ggml/src/ggml-cpu/ops.cpp",
           "if (summary[(mask_r0 + tq)*n_kv_tiles + it] != GGML_FA_MASK_TILE_INF) {",
           "if (summary[(mask_r0 + tq)*n_kv_tiles + it] == GGML_FA_MASK_TILE_INF) {", "encoder",
           "the mask summary skips the tiles that have unmasked keys"),
    # --- imatrix's X^T X ------------------------------------------------------------------------------------------
    Mutant("imatrix-xtx-columns", T + "tools/imatrix/imatrix.cpp", "m_xt[(size_t) j*rows + r] = x[j];",
           "m_xt[(size_t) j*rows + r] = x[k - 1 - j];", "gptq", "X^T X collected with the input columns reversed"),
    Mutant("imatrix-xtx-triangle", T + "tools/imatrix/imatrix.cpp",
           "row[b] = (float) srow[b];", "row[b] = (float) srow[a - b];", "gptq",
           "X^T X written with each packed row of its lower triangle reversed"),
    Mutant("quantize-xtx-mirror", T + "src/llama-quant.cpp",
           "h[(size_t) a*e.k + b] = h[(size_t) b*e.k + a];", "h[(size_t) a*e.k + b] = 0.0f;", "gptq",
           "llama-quantize unpacks X^T X without its upper triangle"),
    # --- the Vulkan shaders ---------------------------------------------------------------------------------------
    Mutant("vk-epilogue-order", SH + "s3d8_mul_mat.comp", "y = y*s3d8_alpha(base, row);",
           "y = float(red[i][0])*(s*s3d8_alpha(base, row));", "vulkan",
           "the Vulkan epilogue multiplies s * alpha first"),
    Mutant("vk-w2-sign", SH + "s3d8_mul_mat.comp", "const int w2 = lut[128u + (i0 ^ (byte >> 7))];",
           "const int w2 = lut[128u + i0];", "vulkan", "the Vulkan matmul drops row 2's sign bit"),
    Mutant("vk-get-rows-row1", SH + "s3d8_get_rows.comp", "d == 1u ? lut[64u + ((byte >> 1) & 63u)]",
           "d == 1u ? lut[64u + (byte & 63u)]", "vulkan", "Vulkan GET_ROWS reads row 1's index one bit off"),
    Mutant("vk-act-clamp", SH + "s3d8_quantize.comp", "v = v < -127.0 ? -127.0 : v;", "v = v < -128.0 ? -128.0 : v;",
           "vulkan", "the Vulkan activation quantiser clamps at -128",
           equivalent="the shader returns +-127 for infinities before the clamp, and a finite x * inv is at most "
                      "127 * (1 + 2^-8) in magnitude (s is amax/127 rounded to bf16), which rounds to 127: the clamp "
                      "never acts (on the CPU, where infinities reach it, cpu-act-clamp-128 is killed)"),
    Mutant("vk-div127-rounding", SH + "s3d8_funcs.glsl", "return s3d8_round_f32(num / 127u, num % 127u, 127u, int(max(eb, 1u)) - 157);",
           "return s3d8_round_f32(num / 127u, 0u, 127u, int(max(eb, 1u)) - 157);", "vulkan",
           "a / 127 truncated instead of rounded to nearest even"),
    Mutant("vk-bf16-rne", SH + "s3d8_funcs.glsl", "return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;",
           "return (u + 0x8000u) >> 16;", "vulkan", "bf16 rounding half up instead of half to even"),
    # --- the numpy codec -----------------------------------------------------------------------------------------
    Mutant("py-pack-s2-xor", "gguf_s3d8/packing.py", "((b0 ^ b2) << np.uint8(7))", "(b2 << np.uint8(7))", "codec",
           "the packer stores S2 without the xor with S0"),
    Mutant("py-bf16-rne", "gguf_s3d8/bf16.py",
           "rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)",
           "rounded = (u + np.uint32(0x8000)) >> np.uint32(16)", "codec", "bf16 rounding half up"),
    Mutant("py-act-rint", "gguf_s3d8/activations.py", "q = np.clip(np.rint(scaled), -ACT_QMAX, ACT_QMAX)",
           "q = np.clip(np.floor(scaled + 0.5), -ACT_QMAX, ACT_QMAX)", "codec",
           "activations rounded half up instead of half to even"),
    Mutant("py-epilogue-order", "gguf_s3d8/reference.py", "return (acc.astype(np.float32) * s[:, None]) * alpha[None, :]",
           "return acc.astype(np.float32) * (s[:, None] * alpha[None, :])", "codec",
           "the numpy reference's epilogue multiplies s * alpha first"),
    Mutant("py-sign-zero", "gguf_s3d8/packing.py", "return np.less(normalised, np.float32(0))",
           "return np.signbit(normalised)", "codec", "-0 weights stored as negative"),
)


def cpuinfo(key: str) -> str:
    """The value of the first /proc/cpuinfo line of ``key`` ('flags', 'model name'), or ''."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.split(":", 1)[0].strip() == key), "")


def cpu_flags() -> set[str]:
    return set(cpuinfo("flags").split())


class Stale(RuntimeError):
    """The mutant's line is not in the code once (the list must follow the code), or it does not build."""


def apply(m: Mutant, forward: bool) -> None:
    path = REPO / m.path
    text = path.read_text()
    old, new = (m.old, m.new) if forward else (m.new, m.old)
    n = text.count(old)
    if n != 1:
        raise Stale(f"{m.id}: the {'line' if forward else 'mutated line'} occurs {n} times in {m.path}")
    path.write_text(text.replace(old, new))


def run(cmd: tuple[str, ...] | list[str], timeout: int, log: Path) -> int | None:
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        try:
            return subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return None


def build(suite: Suite, log: Path) -> bool:
    for preset, targets in suite.builds:
        cmd = ["cmake", "--build", f"build/{preset}", "-j", str(os.cpu_count() or 2), "--target", *targets]
        if run(cmd, 3600, log) != 0:
            return False
    return True


def check(m: Mutant, log: Path) -> tuple[str, float]:
    """killed / survived / timed out / not applicable, and the seconds it took."""
    if m.needs and not set(m.needs) <= cpu_flags():
        return "not applicable", 0.0
    suite = SUITES[m.suite]
    t0 = time.monotonic()
    apply(m, True)
    try:
        if not build(suite, log):
            raise Stale(f"{m.id}: does not build (see {log})")
        rc = run(suite.command, suite.timeout, log)
    finally:
        apply(m, False)
    result = "timed out" if rc is None else ("equivalent" if m.equivalent else "survived") if rc == 0 else "killed"
    return result, time.monotonic() - t0


def draw(seed: int, n: int) -> list[Mutant]:
    return random.Random(seed).sample(list(MUTANTS), min(n, len(MUTANTS)))


def table(results: list[dict]) -> str:
    lines = ["| fault | where | tests | result | s |", "|---|---|---|---|---:|"]
    for r in results:
        why = f" ({r['equivalent']})" if r.get("equivalent") else ""
        lines.append(f"| `{r['id']}`: {r['what']}{why} | `{r['path'].removeprefix(T)}` | {r['suite']} | "
                     f"**{r['result']}** | {r['seconds']:.0f} |")
    return "\n".join(lines)


REPORT = REPO / "docs" / "data" / "mutants.json"


def tally(results: list[dict]) -> tuple[dict[str, int], int]:
    """The count of each result, and of the mutants that count for the score (all but the equivalent ones and those
    not applicable on this machine)."""
    counts = {k: sum(r["result"] == k for r in results)
              for k in ("killed", "survived", "timed out", "equivalent", "not applicable")}
    return counts, len(results) - counts["not applicable"] - counts["equivalent"]


def write_report(results: list[dict], machine: str, merge: bool = False) -> None:
    """docs/data/mutants.json and the table in docs/reliability.md; ``merge``: these results replace the same
    mutants' in the last report (a rerun of some), the others are kept as they were."""
    from gguf_s3d8.fsio import atomic_write  # noqa: PLC0415 (the codec is importable from the repo root)

    if merge and REPORT.exists():
        new = {r["id"]: r for r in results}
        old = {r["id"]: r for r in json.loads(REPORT.read_text())["results"]}
        results = [new.get(m.id) or old[m.id] for m in MUTANTS if m.id in new or m.id in old]
    counts, applicable = tally(results)
    score = counts["killed"] / applicable if applicable else 0.0
    date = time.strftime("%Y-%m-%d %H:%M")
    data = {"machine": machine, "date": date, "counts": counts, "score": score, "results": results}
    atomic_write(REPORT, (json.dumps(data, indent=1) + "\n").encode())
    doc = REPO / "docs" / "reliability.md"
    text = doc.read_text()
    begin, end = "<!-- mutants:begin -->", "<!-- mutants:end -->"
    if begin in text and end in text:
        body = (f"{begin}\n{machine}, {date}: **{counts['killed']} of {applicable} killed "
                f"({100 * score:.0f} %)**, {counts['survived']} survived, {counts['timed out']} timed out, "
                f"{counts['equivalent']} equivalent (no test can kill it: the reason is in the list), "
                f"{counts['not applicable']} not applicable here.\n\n{table(results)}\n{end}")
        text = text[:text.index(begin)] + body + text[text.index(end) + len(end):]
        atomic_write(doc, text.encode())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the faults and exit")
    ap.add_argument("--only", help="comma-separated mutant ids")
    ap.add_argument("--suite", help="only the mutants of this suite")
    ap.add_argument("--sample", type=int, help="draw this many mutants (with --seed)")
    ap.add_argument("--seed", type=int, default=int(time.strftime("%Y%m%d")), help="the draw's seed (default: today)")
    ap.add_argument("--no-report", action="store_true", help="do not write docs/data/mutants.json and the table")
    ap.add_argument("--log", type=Path, default=REPO / ".cache" / "mutants.log", help="build and test output")
    ap.add_argument("--junitxml", type=Path, help="also write one JUnit case per mutant (ci/summarize.py counts them)")
    args = ap.parse_args(argv)

    if args.list:
        for m in MUTANTS:
            print(f"{m.id:28s} {m.suite:14s} {m.what}")
        print(f"{len(MUTANTS)} mutants")
        return 0
    chosen = list(MUTANTS)
    if args.only:
        ids = args.only.split(",")
        unknown = set(ids) - {m.id for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutant ids: {sorted(unknown)}")
        chosen = [m for m in MUTANTS if m.id in ids]
    if args.suite:
        chosen = [m for m in chosen if m.suite == args.suite]
    if args.sample:
        chosen = draw(args.seed, args.sample)
        print(f"[mutants] seed {args.seed}: {', '.join(m.id for m in chosen)}", flush=True)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    args.log.write_bytes(b"")

    results, stale, touched = [], [], set()
    try:
        for i, m in enumerate(chosen, 1):
            print(f"[mutants] {i}/{len(chosen)} {m.id} ({m.suite}) ...", end=" ", flush=True)
            touched.add(m.suite)  # rebuilt at the end, also when the mutant did not build
            try:
                result, secs = check(m, args.log)
            except Stale as e:
                stale.append(str(e))
                print("STALE", flush=True)
                continue
            print(f"{result} ({secs:.0f} s)", flush=True)
            results.append({"id": m.id, "path": m.path, "suite": m.suite, "what": m.what, "result": result,
                            "seconds": round(secs, 1), **({"equivalent": m.equivalent} if m.equivalent else {})})
    finally:
        # the binaries as the code is (every mutated line is restored; the rebuilds are ccache hits)
        for s in sorted(touched):
            build(SUITES[s], args.log)
    if args.junitxml:
        write_junit(args.junitxml, results, stale)
    survivors = [r["id"] for r in results if r["result"] == "survived"]
    counts, applicable = tally(results)
    print(f"[mutants] {counts['killed']} of {applicable} killed; survived: {survivors or 'none'}; stale: {stale or 'none'}")
    if not args.no_report and not args.sample:
        write_report(results, os.environ.get("S3D8_MACHINE", cpu_model()), merge=bool(args.only or args.suite))
    return 1 if survivors or stale else 0


def write_junit(path: Path, results: list[dict], stale: list[str]) -> None:
    """A killed, timed-out or not-applicable mutant is a passed case (the suite did not pass with the fault); a
    survivor is a failure and a stale entry an error."""
    from xml.sax.saxutils import quoteattr  # noqa: PLC0415

    cases = []
    for r in results:
        body = (f'<failure message={quoteattr("survived: " + r["what"])}/>' if r["result"] == "survived" else "")
        cases.append(f'<testcase classname="mutants" name={quoteattr(r["id"] + " (" + r["result"] + ")")} '
                     f'time="{r["seconds"]}">{body}</testcase>')
    cases += [f'<testcase classname="mutants" name="stale"><error message={quoteattr(s)}/></testcase>' for s in stale]
    path.write_text(f'<testsuite name="mutants">{"".join(cases)}</testsuite>\n')


def cpu_model() -> str:
    return f"{cpuinfo('model name') or 'unknown CPU'}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())

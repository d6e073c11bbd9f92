"""The mllama cross-attention store in its own types (issue 13 part 5; docs/kv-cache.md, "The cross-attention store").

* its size, as printed by libllama from the tensors it allocated, at the 11B model's cache geometry (8 cross-attention
  layers, 8 KV heads x 128, 4 tiles x 1601 = 6404 rows per image): a text model with exactly that geometry (small
  everywhere else) is fed 6404 rows of states through llama-mllama-dump;
* bad input is a clear error before anything is allocated: a type whose block size does not divide the head size, a
  quantised V without flash attention, an unknown type;
* llama-cli, llama-server, llama-mtmd-cli and llama-perplexity take -ctkx/-ctvx (and their environment variables), and
  llama-mtmd-cli and llama-server run an image with them.

The quality of each type against transformers is in test_mllama_parity.py (test_cross_store_*).
"""

from __future__ import annotations

import copy
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import requests

from tests.mllama import harness, llama_server, tiny_model as T

# the cache geometry of Llama-3.2-11B-Vision: 8 heads of 128 (K and V: 1024 values per row), 8 cross-attention
# layers (of 9: one self-attention layer keeps the model a decoder); the rest is as small as the converter allows
GEOMETRY_11B: dict = copy.deepcopy(T.QAT_CONFIG)
GEOMETRY_11B["text_config"].update({"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8,
                                    "intermediate_size": 256, "num_hidden_layers": 9,
                                    "cross_attention_layers": [1, 2, 3, 4, 5, 6, 7, 8]})
ROWS_PER_IMAGE = 4 * 1601   # 4 tiles x (40 x 40 patches + the class token)
ROWS_PADDED = 6656          # the store pads its rows to 256 (LLAMA_CROSS_ROWS_PAD)

SIZE_LINE = re.compile(r"llama_kv_cache_cross: size = ([0-9.]+) MiB per (\d+) rows \((\d+) layers, buffers [0-9.]+ MiB\), "
                       r"K \((\w+)\): ([0-9.]+) MiB, V \((\w+)\): ([0-9.]+) MiB")


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    # errors="replace": the answers of the random model are not always valid UTF-8
    return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


def size_line(log: str) -> tuple[float, int, int, str, float, str, float]:
    m = SIZE_LINE.search(log)
    assert m, log[-3000:]
    total, rows, layers, tk, mk, tv, mv = m.groups()
    return float(total), int(rows), int(layers), tk, float(mk), tv, float(mv)


@pytest.fixture(scope="module")
def geometry_11b(tmp_path_factory) -> tuple[Path, Path]:
    """The text GGUF (f16) of the 11B-geometry model and 6404 rows of states for it."""
    from convert.common import ConversionOptions
    from convert.mllama import convert

    harness.binary("llama-mllama-dump")
    d = tmp_path_factory.mktemp("geometry")
    text = d / "text-f16.gguf"
    convert(T.get(GEOMETRY_11B), text, ConversionOptions(out_type="f16"), tokenizer_pre="llama-bpe", progress=False)
    states = d / "states.npy"
    np.save(states, np.random.default_rng(0).standard_normal((ROWS_PER_IMAGE, 1024), dtype=np.float32))
    return text, states


# (type, MiB per image): 8 layers x 6656 rows x 1024 values x bits/8, K and V. The target of issue 13: <= 46 MiB at
# TQ3_0 (3.5 bits: 45.5 MiB); F16 is the 208 MiB of docs/kv-cache.md's table
@pytest.mark.parametrize("cross_type,mib", [("tq3_0", 45.5), ("q4_hqq_128", 55.25), ("f16", 208.0)])
def test_store_size_at_11b_geometry(geometry_11b, tmp_path, cross_type, mib):
    text, states = geometry_11b
    out = harness.run_dump(text, [T.BOS_ID, T.IMAGE_TOKEN_ID, 40], tmp_path, cross=[(states, ROWS_PER_IMAGE)],
                           cache_type="f16", cross_type=cross_type, flash_attn="on", timeout=600)
    total, rows, layers, tk, mk, tv, mv = size_line(out.log)
    print(f"11B geometry, {cross_type}: {total} MiB per {rows} rows (one 4-tile image), K {mk} MiB, V {mv} MiB")
    assert (rows, layers, tk, tv) == (ROWS_PADDED, 8, cross_type, cross_type)
    # printed with 2 decimals: the exact figures (27.625 MiB is printed 27.62) within the last printed digit
    assert abs(total - mib) <= 0.005 and abs(mk - mib / 2) <= 0.005 and mk == mv
    if cross_type == "tq3_0":
        assert total <= 46.0


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory) -> tuple[Path, Path]:
    return harness.convert(T.get(), tmp_path_factory.mktemp("gguf"), "f32")


def image(tmp_path: Path) -> Path:
    from PIL import Image

    path = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (28, 84, 3), dtype=np.uint8)).save(path)
    return path


def dump_fails(text: Path, tmp_path: Path, args: list[str]) -> str:
    cmd = [str(harness.binary("llama-mllama-dump")), "-m", str(text), "--tokens", f"{T.BOS_ID},40", "-t", "2",
           "-o", str(tmp_path), *args]
    r = run(cmd)
    log = r.stdout + r.stderr
    assert r.returncode != 0 and "GGML_ASSERT" not in log, log[-3000:]
    # before any allocation: not even the self-attention cache was created
    assert "llama_kv_cache: size" not in log and "llama_kv_cache_cross" not in log, log[-3000:]
    return log


@pytest.mark.parametrize("which,flag", [("K", "-ctkx"), ("V", "-ctvx")])
def test_block_size_that_does_not_divide_the_head_is_a_clear_error(tiny_f32, tmp_path, which, flag):
    """Through the API (the common tools' type list has no type with blocks over 128): Q4_K's 256-blocks on heads of
    128, with flash attention on (the V check applies with it)."""
    log = dump_fails(tiny_f32[0], tmp_path, [flag, "q4_K", "-fa", "on"])
    head = "n_embd_head_k" if which == "K" else "n_embd_head_v"
    assert f"{which} cross-attention cache type q4_K with block size 256 does not divide {head}=128" in log, log[-3000:]


def test_quantised_v_without_flash_attention_is_a_clear_error(tiny_f32, tmp_path):
    text, mmproj = tiny_f32
    r = run([str(harness.binary("llama-mtmd-cli")), "-m", str(text), "--mmproj", str(mmproj), "--image",
             str(image(tmp_path)), "-p", "hi", "-n", "2", "-t", "2", "-fa", "off", "-ctvx", "tq3_0"])
    log = r.stdout + r.stderr
    assert r.returncode != 0 and "GGML_ASSERT" not in log, log[-3000:]
    assert "quantized V cross-attention cache (tq3_0) requires flash_attn to be enabled" in log, log[-3000:]
    assert "llama_kv_cache: size" not in log, log[-3000:]
    # the API refuses it the same way (the dump tool sets the context parameters directly)
    log = dump_fails(text, tmp_path, ["-ctvx", "tq3_0", "-fa", "off"])
    assert "quantized V cross-attention cache (tq3_0) requires flash_attn to be enabled" in log, log[-3000:]


@pytest.mark.parametrize("name", ["llama-mtmd-cli", "llama-server"])
@pytest.mark.parametrize("flag", ["-ctkx", "-ctvx"])
def test_unknown_cross_type_is_refused(tiny_f32, name, flag):
    text, mmproj = tiny_f32
    r = run([str(harness.binary(name)), "-m", str(text), "--mmproj", str(mmproj), flag, "tq3_1"], timeout=60)
    assert r.returncode != 0 and "Unsupported cache type: tq3_1" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]


@pytest.mark.parametrize("name", ["llama-cli", "llama-server", "llama-mtmd-cli", "llama-perplexity"])
def test_every_tool_lists_the_cross_flags(name):
    r = run([str(harness.binary(name)), "--help"], timeout=60)
    text = " ".join((r.stdout + r.stderr).split())   # the help text wraps
    types = "allowed values: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1, q4_hqq, q4_hqq_128, tq3_0"
    for flags, env in (("-ctkx, --cache-type-k-cross TYPE", "LLAMA_ARG_CACHE_TYPE_K_CROSS"),
                       ("-ctvx, --cache-type-v-cross TYPE", "LLAMA_ARG_CACHE_TYPE_V_CROSS")):
        i = text.find(flags)
        assert i >= 0 and types in text[i:i + 400] and f"env: {env}" in text[i:i + 400], text[-3000:]


def test_mtmd_cli_runs_an_image_with_its_own_cross_types(tiny_f32, tmp_path):
    """-ctkx on the command line, the V type from the environment; -fa auto turns flash attention on for it."""
    text, mmproj = tiny_f32
    r = run([str(harness.binary("llama-mtmd-cli")), "-m", str(text), "--mmproj", str(mmproj), "--image",
             str(image(tmp_path)), "-p", "What does the image show?", "-n", "4", "--temp", "0", "-t", "2",
             "-ctkx", "q4_hqq_128", "-lv", "4"], env={"LLAMA_ARG_CACHE_TYPE_V_CROSS": "tq3_0"})
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-3000:]
    assert "enabling flash_attn since it is required for quantized V cross-attention cache" in log, log[-3000:]
    _, rows, layers, tk, _, tv, _ = size_line(log)
    assert (tk, tv, layers) == ("q4_hqq_128", "tq3_0", 2) and rows % 256 == 0
    assert "K (f16):" in log   # the self-attention cache keeps its default type


def test_server_runs_an_image_with_its_own_cross_types(tmp_path):
    text, mmproj = harness.convert(T.get(), tmp_path, "f16")
    log = tmp_path / "server.log"
    try:
        srv = llama_server.start(harness.binary("llama-server"), text, mmproj, log, n_parallel=1, n_ctx=512,
                                 extra=["-ctkx", "tq3_0", "-ctvx", "q8_0", "-lv", "4"])
    except llama_server.ServerError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        r = requests.post(f"{srv.url}/v1/chat/completions", timeout=120,
                          json=llama_server.chat_body(llama_server.png_data_url(28, 84, 1)))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
    finally:
        srv.stop()
    _, _, _, tk, _, tv, _ = size_line(log.read_text(errors="replace"))
    assert (tk, tv) == ("tq3_0", "q8_0")

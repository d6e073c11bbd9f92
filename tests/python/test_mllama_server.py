"""llama-server with a tiny mllama model: OpenAI-style chat requests with image parts.

One server (2 slots) serves the whole module: plain and streamed answers about an image, two concurrent requests
with different images, a malformed image (HTTP 400 with a message) after which the server keeps serving.
"""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.mllama import harness, llama_server, tiny_model as T
from tests.mllama.llama_server import N_PREDICT, chat_body, png_data_url
from tests.mllama.margins import assert_greedy_match, margins


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    exe = harness.binary("llama-server")
    text, mmproj = harness.convert(T.get(), tmp_path_factory.mktemp("gguf"), "f16")
    log = tmp_path_factory.mktemp("log") / "server.log"
    try:
        srv = llama_server.start(exe, text, mmproj, log, n_parallel=2, n_ctx=1024)
    except llama_server.ServerError as e:
        pytest.fail(str(e), pytrace=False)
    try:
        yield srv.url
    finally:
        srv.stop()


def answer(server: str, body: dict) -> dict:
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_image_answer(server):
    res = answer(server, chat_body(png_data_url(28, 84, 1)))
    msg = res["choices"][0]["message"]["content"]
    assert isinstance(msg, str) and msg
    assert res["usage"]["completion_tokens"] == N_PREDICT
    # the image is a single <|image|> token of the prompt
    assert res["usage"]["prompt_tokens"] > 5


def test_image_answer_is_deterministic_and_depends_on_the_image(server):
    a = greedy_answer(server, png_data_url(28, 84, 1))
    b = greedy_answer(server, png_data_url(28, 84, 1))
    llama_server.assert_same_answer(b, a, what="the same request twice")
    # the answer must depend on the image (different images give at least two different answers)
    answers = {answer(server, chat_body(png_data_url(hh, ww, seed)))["choices"][0]["message"]["content"]
               for hh, ww, seed in [(28, 84, 1), (84, 28, 2), (56, 56, 3), (28, 28, 4)]}
    assert len(answers) > 1, answers


def test_stream(server):
    body = llama_server.with_logprobs(chat_body(png_data_url(56, 56, 3), stream=True))
    chunks = []
    with requests.post(f"{server}/v1/chat/completions", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        pieces = []
        done = False
        for line in r.iter_lines():
            if not line:
                continue
            line = line.decode()
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            chunks.append(chunk)
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            if delta.get("content"):
                pieces.append(delta["content"])
    assert done
    assert pieces
    streamed = llama_server.parse_stream(chunks)
    assert "".join(pieces) == streamed.text, (pieces, streamed.pieces)  # the deltas are the listed tokens' pieces
    # the streamed answer is the non-streamed one
    llama_server.assert_same_answer(streamed, greedy_answer(server, png_data_url(56, 56, 3)), what="streamed vs plain")


# Two concurrent requests are served from other cells of the KV cache and other rows of the cross-attention store than
# the same request alone, so the attention sums run in another order: llama_server.LOGPROB_TOL bounds how far that
# moves the log-probabilities (attending the other image moves them by ~0.5); greedy answers are compared through
# llama_server.assert_same_answer, which compares tokens only where the margin exceeds twice that.


def greedy_answer(server: str, image_url: str, **body_fields) -> llama_server.Answer:
    """The greedy answer with the log-probabilities of its TOP_LOGPROBS best candidates per token and the server's
    timings (cache_n: prompt tokens taken from the cache)."""
    body = llama_server.with_logprobs({**chat_body(image_url), **body_fields})
    return llama_server.parse_answer(answer(server, body))


def test_concurrent_requests_with_different_images(server):
    # (each answer's first tokens are whole UTF-8, so the server lists their margins: llama_server._entries)
    images = [png_data_url(28, 84, 52), png_data_url(56, 56, 53)]
    # each answer alone first
    alone = [greedy_answer(server, img) for img in images]
    # the images are told apart by far more than the tolerance (else the test below could not fail)
    gap = llama_server.logprob_deviation(alone[1], alone[0])
    assert gap > 10 * llama_server.LOGPROB_TOL, gap
    with ThreadPoolExecutor(max_workers=4) as pool:
        futs = [pool.submit(greedy_answer, server, img) for img in images * 2]
        results = [f.result() for f in futs]
    # served in parallel (2 slots), every request attends its own image only
    for i, (got, ref) in enumerate(zip(results, alone * 2)):
        llama_server.assert_same_answer(got, ref, what=f"request {i} in parallel vs alone")


def test_cached_prompt_prefix_is_not_reused_for_another_image(server):
    """The tokens before the image attend it too (uniformly, as in transformers), so the memory of a cached prompt
    computed with another image must not be reused, even for the text before the image; with the same image it is."""
    other, image = png_data_url(56, 28, 20), png_data_url(28, 84, 55)  # used by no other test
    answer(server, chat_body(other))  # a prompt with the same text and another image is now in a slot and cached
    got = greedy_answer(server, image)
    assert got.timings["cache_n"] == 0, "the cached prefix of a prompt with another image was reused"
    uncached = greedy_answer(server, image, cache_prompt=False)
    assert uncached.timings["cache_n"] == 0
    llama_server.assert_same_answer(got, uncached, what="after a prompt with another image vs uncached")
    # the same image again: all the prompt but its last token comes from the cache
    again = greedy_answer(server, image)
    assert again.timings["prompt_n"] == 1 and again.timings["cache_n"] > 0
    llama_server.assert_same_answer(again, got, what="the same image again, from the cache")


def test_malformed_image_is_rejected_and_server_stays_up(server):
    bad = "data:image/png;base64," + base64.b64encode(b"this is not an image").decode()
    r = requests.post(f"{server}/v1/chat/completions", json=chat_body(bad), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"]
    assert requests.get(f"{server}/health", timeout=5).status_code == 200
    res = answer(server, chat_body(png_data_url(28, 28, 5)))
    assert res["choices"][0]["message"]["content"]


# transformers (f32) against the server's f16 weights and f16 cache with flash attention: the log-probabilities of the
# text-only answer move by the f16 rounding (measured 2026-12-07: 3.0e-3, the answer's smallest margin 0.27); a
# text request attending an image instead of no image would move them by ~0.5
# (test_concurrent_requests_with_different_images)
TEXT_LOGPROB_TOL = 2e-2


def reference_answer(ref, top: int = llama_server.TOP_LOGPROBS) -> llama_server.Answer:
    """transformers' greedy answer (fixtures/reference.py: prompt logits, then decode steps) as an Answer."""
    import numpy as np

    rows = [ref.prompt_logits[-1], *ref.step_logits]
    cands = []
    for row in rows:
        lp = row.astype(np.float64) - np.logaddexp.reduce(row.astype(np.float64))
        best = np.argsort(lp)[::-1][:top]
        cands.append({int(t): float(lp[t]) for t in best})
    return llama_server.Answer(list(ref.tokens), [""] * len(ref.tokens), cands, "length")


def test_text_only_request(server):
    """A request without an image on the server with the projector: the answer is transformers' text-only one (the
    cross-attention layers skipped), token for token where the margins decide it, within TEXT_LOGPROB_TOL."""
    from transformers import AutoTokenizer

    from tests.mllama import reference as R

    question = "What does the image show?"  # with no image: an answer of whole-UTF-8 tokens, each decisive
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": N_PREDICT, "temperature": 0.0}
    got = llama_server.parse_answer(answer(server, llama_server.with_logprobs(body)))
    assert len(got.ids) == N_PREDICT or got.finish_reason == "stop", (len(got.ids), got.finish_reason)

    model_dir = T.get()
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  tokenize=True)
    ids = list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)
    ref = reference_answer(R.run(R.load_model(model_dir), ids, [], n_steps=N_PREDICT - 1))
    llama_server.assert_same_answer(got, ref, what="text-only request vs transformers", tol=TEXT_LOGPROB_TOL,
                         min_decisive=N_PREDICT // 2)


# transformers against the server on f32 files with an f32 cache and without flash attention: only rounding differs
# (the parity tests bound the logits' relative error by 1e-4); at the cap the image still moves them by far more
CAP_LOGPROB_TOL = 1e-3


def test_image_max_tiles(tmp_path):
    """llama-server --image-max-tiles 1: the log-probabilities of the answer's first token are transformers' with
    max_image_tiles=1 (fixtures/reference.py), and not those of the uncapped model (4 tiles)."""
    import numpy as np
    import skimage.data
    import torch
    from PIL import Image
    from transformers import AutoTokenizer

    from tests.mllama import reference as R
    from tests.mllama.llama_server import data_url

    model_dir = T.get()
    (tmp_path / "gguf").mkdir()
    text, mmproj = harness.convert(model_dir, tmp_path / "gguf", "f32")
    img = Image.fromarray(skimage.data.astronaut())
    png = tmp_path / "astronaut.png"
    img.save(png)
    question = "What does the image show?"

    tok = AutoTokenizer.from_pretrained(model_dir)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ids = list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)
    hf = R.load_model(model_dir)
    ref = {cap: torch.log_softmax(torch.from_numpy(R.run(hf, ids, [img], max_tiles=cap).prompt_logits[-1]), 0).numpy()
           for cap in (1, 4)}

    srv = llama_server.start(harness.binary("llama-server"), text, mmproj, tmp_path / "server.log", n_parallel=1,
                             n_ctx=1024, extra=["--image-max-tiles", "1", "-ctk", "f32", "-ctv", "f32", "-fa", "off"])
    try:
        body = chat_body(data_url(png.read_bytes()), question)
        body = llama_server.with_logprobs({**body, "max_tokens": 1})
        choice = answer(srv.url, body)["choices"][0]
    finally:
        srv.stop()
    assert "logprobs" in choice, f"no logprobs in the answer {choice['message']['content']!r}: choose another image"
    first = {t["id"]: t["logprob"] for t in choice["logprobs"]["content"][0]["top_logprobs"]}
    dev = {cap: max(abs(lp - float(ref[cap][t])) for t, lp in first.items()) for cap in ref}
    assert dev[1] <= CAP_LOGPROB_TOL, dev
    assert dev[4] > 10 * CAP_LOGPROB_TOL, dev
    # the token: transformers' argmax, which no deviation within the tolerance can flip (margin above 2 * tol)
    assert_greedy_match([choice["logprobs"]["content"][0]["id"]], [int(np.argmax(ref[1]))], [float(margins(ref[1]))],
                        2 * CAP_LOGPROB_TOL, what="first token at --image-max-tiles 1 vs transformers", min_decisive=1)

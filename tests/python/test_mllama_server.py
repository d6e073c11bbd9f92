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
    a = answer(server, chat_body(png_data_url(28, 84, 1)))["choices"][0]["message"]["content"]
    b = answer(server, chat_body(png_data_url(28, 84, 1)))["choices"][0]["message"]["content"]
    assert a == b
    # the answer must depend on the image (different images give at least two different answers)
    answers = {answer(server, chat_body(png_data_url(hh, ww, seed)))["choices"][0]["message"]["content"]
               for hh, ww, seed in [(28, 84, 1), (84, 28, 2), (56, 56, 3), (28, 28, 4)]}
    assert len(answers) > 1, answers


def test_stream(server):
    body = chat_body(png_data_url(56, 56, 3), stream=True)
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
            delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
            if delta.get("content"):
                pieces.append(delta["content"])
    assert done
    assert pieces
    # the streamed answer is the same as the non-streamed one
    full = answer(server, chat_body(png_data_url(56, 56, 3)))["choices"][0]["message"]["content"]
    assert "".join(pieces) == full


# Two concurrent requests are served from other cells of the KV cache and other rows of the cross-attention store than
# the same request alone, so the attention sums run in another order: on this random tiny model (f16 weights and
# cache) the log-probabilities move by up to ~2e-3 (measured), while attending the other image moves them by ~0.5.
# LOGPROB_TOL sits between the two; a greedy token may flip only where the two best tokens are tied within it.
LOGPROB_TOL = 1e-2
TOP_LOGPROBS = 10
END_OF_GENERATION = (T.EOS_ID, T.EOT_ID)


Answer = list[tuple[int, dict[int, float]]]


def answer_with_logprobs(server: str, image_url: str, **body_fields) -> tuple[Answer, dict]:
    """The greedy answer as (token id, {candidate id: logprob} of the TOP_LOGPROBS best candidates) per token, and the
    server's timings (cache_n: prompt tokens taken from the cache)."""
    body = chat_body(image_url)
    body.update(logprobs=True, top_logprobs=TOP_LOGPROBS, **body_fields)
    res = answer(server, body)
    choice = res["choices"][0]
    # the server lists no log-probabilities for an answer that is all incomplete UTF-8 (held back as it streams)
    assert "logprobs" in choice, f"no logprobs in the answer {choice['message']['content']!r}: choose another image"
    tokens = [(c["id"], {t["id"]: t["logprob"] for t in c["top_logprobs"]}) for c in choice["logprobs"]["content"]]
    return tokens, res["timings"]


def token_logprobs(server: str, image_url: str) -> Answer:
    return answer_with_logprobs(server, image_url)[0]


def candidates_deviation(a: dict[int, float], b: dict[int, float]) -> float:
    """A lower bound of max |logprob difference| over the vocabulary from two top lists: exact for the candidates both
    list; a candidate only one lists is at most the other's last listed logprob there."""
    def one_sided(x: dict[int, float], y: dict[int, float]) -> float:
        floor = min(y.values())
        return max((abs(lp - y[t]) if t in y else max(0.0, lp - floor) for t, lp in x.items()), default=0.0)
    return max(one_sided(a, b), one_sided(b, a))


def logprob_deviation(got: Answer, ref: Answer) -> tuple[float, bool]:
    """Largest |logprob difference| over the candidates both answers list, up to where the greedy tokens part (after
    that the contexts differ), and whether they part at a near tie (the other answer's token is within LOGPROB_TOL of
    the chosen one) or not at all. An answer that ends first chose an end-of-generation token there (not listed)."""
    assert got and ref
    dev = 0.0
    for (tok_g, cand_g), (tok_r, cand_r) in zip(got, ref):
        assert tok_g in cand_g and tok_r in cand_r
        dev = max(dev, candidates_deviation(cand_g, cand_r))
        if tok_g != tok_r:
            return dev, tok_g in cand_r and cand_r[tok_r] - cand_r[tok_g] <= LOGPROB_TOL
    if len(got) == len(ref):
        return dev, True
    tok, cand = max(got, ref, key=len)[min(len(got), len(ref))]
    return dev, any(t in cand and cand[tok] - cand[t] <= LOGPROB_TOL for t in END_OF_GENERATION)


def test_concurrent_requests_with_different_images(server):
    images = [png_data_url(28, 84, 10), png_data_url(84, 28, 11)]
    # each answer alone first
    alone = [token_logprobs(server, img) for img in images]
    # the images are told apart by far more than the tolerance (else the test below could not fail)
    gap, _ = logprob_deviation(alone[1], alone[0])
    assert gap > 10 * LOGPROB_TOL, gap
    with ThreadPoolExecutor(max_workers=4) as pool:
        futs = [pool.submit(token_logprobs, server, img) for img in images * 2]
        results = [f.result() for f in futs]
    # served in parallel (2 slots), every request attends its own image only
    for i, (got, ref) in enumerate(zip(results, alone * 2)):
        dev, parted_at_tie = logprob_deviation(got, ref)
        assert dev <= LOGPROB_TOL, f"request {i}: log-probabilities differ by {dev:.3g} from the same request alone"
        assert parted_at_tie, f"request {i}: the greedy answer parts from the same request alone without a near tie"


def test_cached_prompt_prefix_is_not_reused_for_another_image(server):
    """The tokens before the image attend it too (uniformly, as in transformers), so the memory of a cached prompt
    computed with another image must not be reused, even for the text before the image; with the same image it is."""
    other, image = png_data_url(56, 28, 20), png_data_url(28, 84, 21)  # used by no other test
    answer(server, chat_body(other))  # a prompt with the same text and another image is now in a slot and cached
    got, timings = answer_with_logprobs(server, image)
    assert timings["cache_n"] == 0, "the cached prefix of a prompt with another image was reused"
    uncached, timings = answer_with_logprobs(server, image, cache_prompt=False)
    assert timings["cache_n"] == 0
    dev, parted_at_tie = logprob_deviation(got, uncached)
    assert dev <= LOGPROB_TOL and parted_at_tie, dev
    # the same image again: all the prompt but its last token comes from the cache
    again, timings = answer_with_logprobs(server, image)
    assert timings["prompt_n"] == 1 and timings["cache_n"] > 0
    dev, parted_at_tie = logprob_deviation(again, got)
    assert dev <= LOGPROB_TOL and parted_at_tie, dev


def test_malformed_image_is_rejected_and_server_stays_up(server):
    bad = "data:image/png;base64," + base64.b64encode(b"this is not an image").decode()
    r = requests.post(f"{server}/v1/chat/completions", json=chat_body(bad), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"]
    assert requests.get(f"{server}/health", timeout=5).status_code == 200
    res = answer(server, chat_body(png_data_url(28, 28, 5)))
    assert res["choices"][0]["message"]["content"]


def test_text_only_request(server):
    body = {"messages": [{"role": "user", "content": "Describe a cat."}], "max_tokens": N_PREDICT,
            "temperature": 0.0}
    res = answer(server, body)
    assert res["usage"]["completion_tokens"] >= 1


# transformers against the server on f32 files with an f32 cache and without flash attention: only rounding differs
# (the parity tests bound the logits' relative error by 1e-4); at the cap the image still moves them by far more
CAP_LOGPROB_TOL = 1e-3


def test_image_max_tiles(tmp_path):
    """llama-server --image-max-tiles 1: the log-probabilities of the answer's first token are transformers' with
    max_image_tiles=1 (tests/mllama/reference.py), and not those of the uncapped model (4 tiles)."""
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
        body.update(logprobs=True, top_logprobs=TOP_LOGPROBS, max_tokens=1)
        choice = answer(srv.url, body)["choices"][0]
    finally:
        srv.stop()
    assert "logprobs" in choice, f"no logprobs in the answer {choice['message']['content']!r}: choose another image"
    first = {t["id"]: t["logprob"] for t in choice["logprobs"]["content"][0]["top_logprobs"]}
    dev = {cap: max(abs(lp - float(ref[cap][t])) for t, lp in first.items()) for cap in ref}
    assert dev[1] <= CAP_LOGPROB_TOL, dev
    assert dev[4] > 10 * CAP_LOGPROB_TOL, dev
    assert int(np.argmax(ref[1])) == choice["logprobs"]["content"][0]["id"]

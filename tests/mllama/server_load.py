"""Load and bad input for llama-server with an mllama model (issue 14, part 3).

Starts llama-server (``--parallel 4``, a small context per slot so that "longer than the context" is reachable) on a
free loopback port and sends it a seeded mix of requests from concurrent clients, round after round:

* valid image chats, plain and streamed (``chat``, ``stream``), and two fixed greedy requests (``greedy``: temperature
  0, fixed ``max_tokens``, one with a fixed image and one text-only; plain and streamed) whose answers must be the same
  every time;
* clients that go away: mid-stream after the first event, or right after sending (``cancel``);
* bad input: malformed JSON and JSON of the wrong shape (``bad_json``), wrong content types (``content_type``),
  invalid base64 (``bad_base64``), bytes that are no image (``not_image``), oversized images and bodies
  (``oversized``), prompts at and past the context (``long_prompt``).

Every response is classified: ``answer`` (200, chat completion JSON), ``sse`` (200, a stream of JSON events ending
with ``[DONE]``), ``4xx`` (a client error with a JSON error message), ``cancelled``/``disconnected`` (the client
left); anything else - a 5xx, a 4xx without a message, a broken stream, a reset connection, a timeout - and any
outcome a request's variant does not allow is a failure. Between rounds the driver waits until every slot is idle
and samples the server's VmRSS; at the end the server must be alive and healthy, shut down cleanly, and its RSS be
within ``--rss-tolerance`` of the RSS after the first round.

    python -m tests.mllama.server_load --requests 600 --clients 8 --seed 1 --report load.json

The server runs with one thread, a small prompt cache and a fixed glibc mmap threshold (``Config`` says why).
Standard library for the HTTP side (http.client, a concurrent.futures thread pool); numpy and Pillow for the images.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import math
import os
import platform
import random
import socket
import struct
import sys
import time
import zlib
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.mllama import llama_server as S  # noqa: E402

PATH = "/v1/chat/completions"
JSON = "application/json"

#: Greedy decisions whose two best log-probabilities are closer than this could flip between runs of the same request
#: (concurrent requests move the log-probabilities by up to ~2e-3, test_mllama_server.py bounds them by 1e-2 each):
#: the greedy requests must have a larger margin at every generated token (checked before the run).
GREEDY_MARGIN_MIN = 2 * S.LOGPROB_TOL

#: What a log line of the server must never contain.
CRASH_MARKERS = ("GGML_ASSERT", "GGML_ABORT", "terminate called", "Segmentation fault", "AddressSanitizer",
                 "runtime error:", "core dumped", "double free", "corrupted")

OK_OUTCOMES = ("answer", "sse", "4xx", "cancelled", "disconnected")


# --------------------------------------------------------------------------------------------------------------------
# request bodies


def jbody(obj) -> bytes:
    return json.dumps(obj).encode()


def image_chat(url: str, text: str = "What does the image show?", **fields) -> dict:
    body = S.chat_body(url, text)
    body.pop("stream")
    body.update(fields)
    return body


def text_chat(text: str, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": S.N_PREDICT, "temperature": 0.0}
    body.update(fields)
    return body


@lru_cache(maxsize=None)
def png(h: int, w: int, seed: int) -> bytes:
    return S.png_bytes(h, w, seed)


@lru_cache(maxsize=None)
def jpeg(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(png(h, w, seed))).save(buf, format="JPEG", quality=80)
    return buf.getvalue()


@lru_cache(maxsize=None)
def gradient_png(h: int, w: int) -> bytes:
    """A large image that compresses well (cheap to send, expensive to decode and resize)."""
    from PIL import Image

    a = np.zeros((h, w, 3), np.uint8)
    a[..., 0] = (np.arange(w) * 255 // max(w - 1, 1))[None, :]
    a[..., 1] = (np.arange(h) * 255 // max(h - 1, 1))[:, None]
    a[..., 2] = 128
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG", optimize=False, compress_level=9)
    return buf.getvalue()


def _png_chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))


@lru_cache(maxsize=None)
def png_bomb(w: int, h: int) -> bytes:
    """A few kB that claim w x h pixels (the pixel data stops after 64 rows)."""
    idat = zlib.compress(b"\x00" * (w * 3 + 1) * 64, 9)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + _png_chunk(b"IDAT", idat) + _png_chunk(b"IEND", b""))


GREEDY_IMAGE = (28, 84, 1)  # h, w, seed


def greedy_body(**fields) -> dict:
    """The fixed greedy request: temperature 0, a fixed image, max_tokens N_PREDICT."""
    return image_chat(S.png_data_url(*GREEDY_IMAGE), **fields)


# (its answer, like GREEDY_IMAGE's, is whole UTF-8 tokens: the server lists every decision's margin)
GREEDY_TEXT = "What does the image show?"


def greedy_text_body(**fields) -> dict:
    """The fixed text-only greedy request (its prompt starts as the image chats do, up to the image)."""
    return text_chat(GREEDY_TEXT, seed=42, **fields)


#: the greedy requests by name: their answers must not change during the run
GREEDY = {"image": greedy_body, "text": greedy_text_body}


# --------------------------------------------------------------------------------------------------------------------
# the catalogue of request variants


@dataclass(frozen=True)
class Variant:
    kind: str
    name: str
    build: Callable[[random.Random], bytes]   # the body (may be random: a per-request Random is passed)
    expect: frozenset[str]                    # the outcomes that count as correct
    mode: str = "plain"                       # plain | stream | cancel | disconnect
    content_type: str | None = JSON
    greedy: str | None = None                 # its answer must equal the reference of GREEDY[greedy]


@dataclass
class Context:
    """What the catalogue needs to know about the server: the context of a slot, and how many prompt tokens a
    text-only chat has: base + per_word * k for k words ("word word ..."), plus pads[d] appended for d more."""

    n_ctx_slot: int
    base: int
    per_word: int
    pads: dict[int, str] = field(default_factory=dict)

    def text_for(self, n_tokens: int) -> str:
        """A text whose text-only chat has exactly n_tokens prompt tokens."""
        k, rem = divmod(n_tokens - self.base, self.per_word)
        assert k > 0 and (rem == 0 or rem in self.pads), (n_tokens, self)
        return words(k) + (self.pads[rem] if rem else "")


def words(k: int) -> str:
    return " ".join(["word"] * k)


CHAT_IMAGES = [("png", 28, 28, 4), ("png", 28, 84, 2), ("png", 84, 28, 3), ("png", 56, 56, 5), ("png", 112, 112, 6),
               ("jpeg", 200, 300, 7)]
CHAT_TEXTS = ["What does the image show?", "Describe the picture in one sentence.", "Which colours do you see?",
              "Is there a cat?"]


def random_image_url(rng: random.Random) -> str:
    fmt, h, w, seed = rng.choice(CHAT_IMAGES)
    return S.data_url(png(h, w, seed)) if fmt == "png" else S.data_url(jpeg(h, w, seed), "image/jpeg")


def random_chat(rng: random.Random, **fields) -> dict:
    body = image_chat(random_image_url(rng), rng.choice(CHAT_TEXTS), max_tokens=rng.randint(1, 16),
                      temperature=rng.choice([0.0, 0.5, 1.0]), seed=rng.randint(0, 2**31 - 1))
    body.update(fields)
    return body


def catalogue(ctx: Context) -> list[Variant]:
    A, X, AX = frozenset({"answer"}), frozenset({"4xx"}), frozenset({"answer", "4xx"})
    SSE, SX = frozenset({"sse"}), frozenset({"sse", "4xx"})
    good = lambda: S.png_data_url(28, 84, 1)  # noqa: E731
    bad_url = lambda url: lambda r: jbody(image_chat(url))  # noqa: E731
    bad_img = lambda data, mime="image/png": bad_url(S.data_url(data, mime))  # noqa: E731
    n = ctx.n_ctx_slot
    v = [
        # valid image chats
        Variant("chat", "image", lambda r: jbody(random_chat(r)), A),
        Variant("chat", "text_only", lambda r: jbody(text_chat(r.choice(CHAT_TEXTS), max_tokens=r.randint(1, 16))), A),
        Variant("chat", "multi_turn", lambda r: jbody({"messages": [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": random_image_url(r)}},
                                         {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": "And the colours?"}], "max_tokens": 8}), A),
        Variant("chat", "two_choices", lambda r: jbody(random_chat(r, n=2, temperature=0.7)), A),
        Variant("chat", "logprobs", lambda r: jbody(random_chat(r, logprobs=True, top_logprobs=5)), A),
        Variant("chat", "three_images", lambda r: jbody({"messages": [{"role": "user", "content": [
            *({"type": "image_url", "image_url": {"url": random_image_url(r)}} for _ in range(3)),
            {"type": "text", "text": "Compare them."}]}], "max_tokens": 6}), AX),
        Variant("stream", "image", lambda r: jbody(random_chat(r, stream=True)), SSE, mode="stream"),
        Variant("stream", "usage", lambda r: jbody(random_chat(r, stream=True, stream_options={"include_usage": True})),
                SSE, mode="stream"),
        Variant("stream", "text_only", lambda r: jbody(text_chat("Tell me a story.", stream=True, max_tokens=12)),
                SSE, mode="stream"),
        # the greedy requests, plain and streamed
        Variant("greedy", "plain", lambda r: jbody(greedy_body()), A, greedy="image"),
        Variant("greedy", "stream", lambda r: jbody(greedy_body(stream=True)), SSE, mode="stream", greedy="image"),
        Variant("greedy", "text_plain", lambda r: jbody(greedy_text_body()), A, greedy="text"),
        Variant("greedy", "text_stream", lambda r: jbody(greedy_text_body(stream=True)), SSE, mode="stream",
                greedy="text"),
        # clients that go away
        Variant("cancel", "mid_stream", lambda r: jbody(random_chat(r, stream=True, max_tokens=48)),
                frozenset({"cancelled", "sse"}), mode="cancel"),
        Variant("cancel", "after_send", lambda r: jbody(random_chat(r, max_tokens=32)), frozenset({"disconnected"}),
                mode="disconnect"),
        Variant("cancel", "after_send_stream", lambda r: jbody(random_chat(r, stream=True, max_tokens=32)),
                frozenset({"disconnected"}), mode="disconnect"),
        # malformed JSON, JSON of the wrong shape
        Variant("bad_json", "truncated", lambda r: jbody(greedy_body())[:60], X),
        Variant("bad_json", "empty", lambda r: b"", X),
        Variant("bad_json", "binary", lambda r: r.randbytes(512), X),
        Variant("bad_json", "invalid_utf8", lambda r: b'{"messages":[{"role":"user","content":"\xff\xfe\xfd"}]}', X),
        Variant("bad_json", "trailing_garbage", lambda r: jbody(text_chat("hi")) + b"}]garbage", X),
        Variant("bad_json", "not_an_object", lambda r: b"[1, 2, 3]", X),
        Variant("bad_json", "deep_nesting", lambda r: b"[" * 100000 + b"]" * 100000, X),
        Variant("bad_json", "messages_not_array", lambda r: jbody({"messages": 5}), X),
        Variant("bad_json", "message_not_object", lambda r: jbody({"messages": ["hi"]}), X),
        Variant("bad_json", "role_missing", lambda r: jbody({"messages": [{"content": "hi"}]}), X),
        Variant("bad_json", "role_not_string", lambda r: jbody({"messages": [{"role": 5, "content": "hi"}]}), X),
        Variant("bad_json", "content_not_string", lambda r: jbody({"messages": [{"role": "user", "content": 5}]}), X),
        Variant("bad_json", "max_tokens_string", lambda r: jbody(text_chat("hi", max_tokens="many")), X),
        Variant("bad_json", "max_tokens_negative", lambda r: jbody(text_chat("hi", max_tokens=-5)), X),
        Variant("bad_json", "image_url_missing", lambda r: jbody({"messages": [{"role": "user", "content": [
            {"type": "image_url"}, {"type": "text", "text": "hi"}]}]}), X),
        Variant("bad_json", "image_url_not_object", lambda r: jbody({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": "x"}, {"type": "text", "text": "hi"}]}]}), X),
        Variant("bad_json", "url_not_string", lambda r: jbody({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": 5}}, {"type": "text", "text": "hi"}]}]}), X),
        Variant("bad_json", "text_not_string", lambda r: jbody({"messages": [{"role": "user", "content": [
            {"type": "text", "text": 5}]}]}), X),
        Variant("bad_json", "tools_not_array", lambda r: jbody(text_chat("hi", tools=5)), X),
        Variant("bad_json", "tool_without_function", lambda r: jbody(text_chat("hi", tools=[{"type": "function"}])), X),
        Variant("bad_json", "tool_call_arguments_not_json", lambda r: jbody({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "r"}], "max_tokens": 2}), AX),
        Variant("bad_json", "reasoning_format_not_string", lambda r: jbody(text_chat("hi", reasoning_format=5)), X),
        Variant("bad_json", "reasoning_format_unknown", lambda r: jbody(text_chat("hi", reasoning_format="nope")), X),
        Variant("bad_json", "audio_part", lambda r: jbody({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}), X),
        Variant("bad_json", "unknown_part_type", lambda r: jbody({"messages": [{"role": "user", "content": [
            {"type": "hologram", "hologram": {}}]}]}), X),
        # wrong content types (a JSON body under another type may be answered or refused, but never a 5xx)
        Variant("content_type", "text_plain", lambda r: jbody(random_chat(r)), AX, content_type="text/plain"),
        Variant("content_type", "none", lambda r: jbody(random_chat(r)), AX, content_type=None),
        Variant("content_type", "xml", lambda r: jbody(random_chat(r)), AX, content_type="application/xml"),
        Variant("content_type", "form_json", lambda r: jbody(random_chat(r)), AX,
                content_type="application/x-www-form-urlencoded"),
        Variant("content_type", "form_fields", lambda r: b"messages=hello&max_tokens=4", X,
                content_type="application/x-www-form-urlencoded"),
        Variant("content_type", "form_big", lambda r: jbody(image_chat(S.data_url(r.randbytes(1536 * 1024)))), X,
                content_type="application/x-www-form-urlencoded"),
        Variant("content_type", "multipart_json", lambda r: jbody(random_chat(r)), X,
                content_type="multipart/form-data; boundary=xyz"),
        # invalid base64
        Variant("bad_base64", "invalid_chars", bad_url("data:image/png;base64,!!!!not*base64$$$"), X),
        Variant("bad_base64", "truncated", lambda r: jbody(image_chat(good()[:-7])), X),
        Variant("bad_base64", "no_base64_marker", bad_url("data:image/png,iVBORw0KGgo="), X),
        Variant("bad_base64", "two_commas", bad_url("data:image/png;base64,iVBO,Rw0K"), X),
        Variant("bad_base64", "not_an_image_mime", bad_url("data:text/plain;base64,aGVsbG8="), X),
        Variant("bad_base64", "raw_not_base64", bad_url("this is no URL and no base64"), X),
        Variant("bad_base64", "empty_url", bad_url(""), X),
        # bytes that are no image
        Variant("not_image", "text", bad_img(b"this is not an image"), X),
        Variant("not_image", "random_bytes", lambda r: jbody(image_chat(S.data_url(r.randbytes(4096)))), X),
        Variant("not_image", "empty", bad_img(b""), X),
        Variant("not_image", "png_signature_only", bad_img(b"\x89PNG\r\n\x1a\n"), X),
        Variant("not_image", "truncated_png", lambda r: jbody(image_chat(S.data_url(png(28, 84, 1)[:200]))), X),
        Variant("not_image", "truncated_jpeg", lambda r: jbody(image_chat(S.data_url(jpeg(200, 300, 7)[:400],
                                                                                      "image/jpeg"))), AX),
        Variant("not_image", "gif_header", bad_img(b"GIF89a" + b"\x00" * 64, "image/gif"), X),
        Variant("not_image", "bomb_30000x30000", lambda r: jbody(image_chat(S.data_url(png_bomb(30000, 30000)))), X),
        # oversized images and bodies
        Variant("oversized", "4000x3000", lambda r: jbody(image_chat(S.data_url(gradient_png(3000, 4000)))), AX),
        Variant("oversized", "1x8000", lambda r: jbody(image_chat(S.data_url(gradient_png(1, 8000)))), AX),
        Variant("oversized", "8000x1", lambda r: jbody(image_chat(S.data_url(gradient_png(8000, 1)))), AX),
        Variant("oversized", "1x1", lambda r: jbody(image_chat(S.data_url(png(1, 1, 0)))), AX),
        Variant("oversized", "body_over_100MiB",
                lambda r: b'{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":'
                          b'"data:image/png;base64,' + b"A" * (100 * 2**20 + 4096) + b'"}}]}]}', X),
        # prompts at and past the context of a slot
        Variant("long_prompt", "at_ctx", lambda r: jbody(text_chat(ctx.text_for(n))), X),
        Variant("long_prompt", "ctx_minus_1", lambda r: jbody(text_chat(ctx.text_for(n - 1))), A),
        Variant("long_prompt", "over_ctx", lambda r: jbody(text_chat(words(n))), X),
        Variant("long_prompt", "over_ctx_image", lambda r: jbody(image_chat(good(), words(n))), X),
        Variant("long_prompt", "over_ctx_stream", lambda r: jbody(text_chat(words(n), stream=True)), SX, mode="stream"),
        Variant("long_prompt", "far_over_ctx", lambda r: jbody(text_chat(words(20000))), X),
        Variant("long_prompt", "fills_ctx", lambda r: jbody(text_chat(ctx.text_for(n // 2),
                                                                      max_tokens=n)), A),
    ]
    names = [(x.kind, x.name) for x in v]
    assert len(set(names)) == len(names)
    return v


#: Share of each kind in a round (every kind appears at least once per round).
WEIGHTS = {"chat": 18, "stream": 12, "greedy": 10, "cancel": 10, "bad_json": 14, "content_type": 7,
           "bad_base64": 8, "not_image": 8, "oversized": 3, "long_prompt": 10}


def plan(variants: list[Variant], n_requests: int, round_size: int, seed: int,
         weights: dict[str, float] | None = None) -> list[list[Variant]]:
    """Rounds of requests: each holds every kind once (if it is big enough), the rest drawn by the weights (default
    WEIGHTS)."""
    weights = {**WEIGHTS, **(weights or {})}
    rng = random.Random(seed)
    by_kind: dict[str, list[Variant]] = defaultdict(list)
    for x in variants:
        by_kind[x.kind].append(x)
    kinds = sorted(by_kind)
    assert set(kinds) == set(WEIGHTS), (kinds, WEIGHTS)
    rounds = []
    for start in range(0, n_requests, round_size):
        size = min(round_size, n_requests - start)
        picks = [rng.choice(by_kind[k]) for k in kinds] if size >= len(kinds) else []
        while len(picks) < size:
            k = rng.choices(kinds, [weights[k] for k in kinds])[0]
            picks.append(rng.choice(by_kind[k]))
        rng.shuffle(picks)
        rounds.append(picks)
    return rounds


# --------------------------------------------------------------------------------------------------------------------
# sending one request and judging the response


@dataclass
class Record:
    round: int
    kind: str
    variant: str
    status: int | None
    outcome: str
    ok: bool
    latency_s: float
    detail: str = ""
    t_start: float = 0.0             # seconds since the start of the run
    greedy: str | None = None        # greedy requests: the key in GREEDY, the answer and its timings
    content: str | None = None
    timings: dict | None = None      # the server's timings of it (prompt_n, cache_n, ...)


def _error_message(body: bytes) -> str | None:
    try:
        err = json.loads(body)["error"]
        msg = err["message"]
        return msg if isinstance(msg, str) and msg else None
    except (ValueError, KeyError, TypeError):
        return None


def _judge_answer(body: bytes) -> tuple[str, str, dict | None]:
    try:
        res = json.loads(body)
        choices = res["choices"]
        assert choices and all(isinstance(c["message"]["content"], str) for c in choices)
        assert isinstance(res["usage"]["completion_tokens"], int)
        return "answer", "", {"content": choices[0]["message"]["content"], "timings": res.get("timings")}
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        return "bad-answer", f"{type(e).__name__}: {body[:200]!r}", None


def _judge_error(status: int, body: bytes) -> tuple[str, str]:
    msg = _error_message(body)
    if 400 <= status < 500:
        return ("4xx", msg) if msg else ("4xx-without-message", repr(body[:200]))
    return (f"{status // 100}xx" if status >= 500 else f"status-{status}"), (msg or repr(body[:200]))


def _read_sse(res: http.client.HTTPResponse, stop_after_first: bool) -> tuple[str, str, dict | None]:
    """Reads an event stream: (outcome, detail, {content, timings})."""
    pieces: list[str] = []
    n_events = 0
    timings = None
    while True:
        line = res.readline()
        if not line:
            return "bad-sse", f"stream ended without [DONE] after {n_events} events", None
        line = line.rstrip(b"\r\n")
        if not line or line.startswith(b":"):
            continue  # the end of an event; a comment (the server's keep-alive ping ":" when no token came for a while)
        field, sep, value = line.partition(b":")
        if not sep or field not in (b"data", b"event", b"id", b"retry"):
            return "bad-sse", f"not an SSE field: {line[:200]!r}", None
        if field != b"data":
            continue
        data = value[1:] if value.startswith(b" ") else value
        if data == b"[DONE]":
            if n_events == 0:
                return "bad-sse", "[DONE] without events", None
            return "sse", "", {"content": "".join(pieces), "timings": timings}
        try:
            ev = json.loads(data)
        except ValueError:
            return "bad-sse", f"event is not JSON: {data[:200]!r}", None
        if "error" in ev:
            return "sse-error", json.dumps(ev)[:300], None
        n_events += 1
        timings = ev.get("timings", timings)
        for c in ev.get("choices") or []:
            piece = (c.get("delta") or {}).get("content")
            if piece:
                pieces.append(piece)
        if stop_after_first:
            return "cancelled", f"left after {n_events} event(s)", None


def _hang_up(conn: http.client.HTTPConnection) -> None:
    try:
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # the server has closed already
        pass


def send(port: int, v: Variant, body: bytes, timeout: float) -> tuple[int | None, str, str, dict | None]:
    """(status, outcome, detail, {content, timings} of an answer) of one request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    status = None
    try:
        conn.putrequest("POST", PATH)
        if v.content_type is not None:
            conn.putheader("Content-Type", v.content_type)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()
        try:
            conn.send(body)
        except (BrokenPipeError, ConnectionResetError) as e:
            # the server may refuse a body before it is complete (413): its answer is still to be read
            sent_error: OSError | None = e
        else:
            sent_error = None
        if v.mode == "disconnect":
            _hang_up(conn)
            return None, "disconnected", "", None
        try:
            res = conn.getresponse()
        except (ConnectionError, http.client.HTTPException) as e:
            raise (sent_error or e)  # noqa: B904 (re-raises the first error as it was)
        status = res.status
        ctype = res.getheader("Content-Type", "")
        if status == 200 and v.mode in ("stream", "cancel"):
            if not ctype.startswith("text/event-stream"):
                return status, "bad-sse", f"Content-Type {ctype!r}: {res.read()[:200]!r}", None
            outcome, detail, content = _read_sse(res, stop_after_first=v.mode == "cancel")
            if outcome == "cancelled":
                _hang_up(conn)
            return status, outcome, detail, content
        data = res.read()
        if status == 200:
            return (status, *_judge_answer(data))
        return (status, *_judge_error(status, data), None)
    except socket.timeout:
        return status, "timeout", f"no answer within {timeout} s", None
    except (OSError, http.client.HTTPException) as e:
        return status, "connection-error", f"{type(e).__name__}: {e}", None
    finally:
        conn.close()


def run_one(port: int, v: Variant, rnd: int, seed: int, timeout: float, t_run: float) -> Record:
    body = v.build(random.Random(seed))
    t0 = time.perf_counter()
    status, outcome, detail, answer = send(port, v, body, timeout)
    dt = time.perf_counter() - t0
    ok = outcome in v.expect
    if not ok and outcome in OK_OUTCOMES:
        detail = f"outcome {outcome!r} where {sorted(v.expect)} is expected; {detail}"
    rec = Record(rnd, v.kind, v.name, status, outcome, ok, dt, detail[:500], round(t0 - t_run, 3))
    if v.greedy and answer:
        rec.greedy, rec.content, rec.timings = v.greedy, answer["content"], answer["timings"]
    return rec


# --------------------------------------------------------------------------------------------------------------------
# the server side: calibration, the greedy reference, idleness, memory


def post_json(port: int, body: dict, timeout: float = 300) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", PATH, body=jbody(body), headers={"Content-Type": JSON})
        res = conn.getresponse()
        return res.status, json.loads(res.read())
    finally:
        conn.close()


def prompt_tokens(port: int, text: str) -> int:
    status, res = post_json(port, text_chat(text, max_tokens=1))
    if status == 200:
        return res["usage"]["prompt_tokens"]
    return res["error"]["n_prompt_tokens"]


PAD_CANDIDATES = [" x", " xq", " xqz", "!", "!!", "!!!", " x x", " x x x"]


def calibrate(port: int) -> Context:
    """The slot context and how to write a prompt of a given number of tokens (checked at the boundary)."""
    status, props = S.http_get(port, "/props")
    assert status == 200, props
    n_ctx_slot = json.loads(props)["default_generation_settings"]["n_ctx"]
    a, b = prompt_tokens(port, words(4)), prompt_tokens(port, words(12))
    per_word, rem = divmod(b - a, 8)
    assert rem == 0 and per_word > 0, (a, b)
    ctx = Context(n_ctx_slot, a - 4 * per_word, per_word)
    for pad in PAD_CANDIDATES:
        if len(ctx.pads) == per_word - 1:
            break
        d = prompt_tokens(port, words(4) + pad) - a
        if 0 < d < per_word:
            ctx.pads.setdefault(d, pad)
    # the boundary prompts must have exactly these lengths
    for n in (n_ctx_slot - 1, n_ctx_slot):
        got = prompt_tokens(port, ctx.text_for(n))
        assert got == n, f"a prompt meant to have {n} tokens has {got} ({ctx})"
    return ctx


def greedy_reference(port: int, body: Callable[..., dict]) -> tuple[str, list[float]]:
    """A greedy request alone (no prompt cached), with the margin (best minus second-best log-probability) of every
    generated token (0 where the server does not list it: llama_server.Answer.margins)."""
    status, res = post_json(port, body(logprobs=True, top_logprobs=2, cache_prompt=False))
    assert status == 200, res
    return res["choices"][0]["message"]["content"], S.parse_answer(res).margins()


def slots_idle(port: int) -> bool:
    status, body = S.http_get(port, "/slots", timeout=10)
    return status == 200 and not any(s.get("is_processing") for s in json.loads(body))


def wait_idle(port: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if slots_idle(port):
                return True
        except (OSError, http.client.HTTPException, ValueError):
            pass
        time.sleep(0.25)
    return False


# --------------------------------------------------------------------------------------------------------------------
# the run


@dataclass
class Config:
    requests: int = 600
    clients: int = 8
    seed: int = 1
    round_size: int = 60
    n_parallel: int = 4
    n_ctx: int = 1024            # total: n_ctx / n_parallel tokens per slot
    # one thread: on a loaded 2-core machine two threads that spin-wait for each other make the latency tail
    # 30x longer (measured: p99 33 s instead of 1.2 s), and the HTTP threads need the other core
    threads: int = 1
    # a small prompt cache (MiB): slots are saved to and restored from it (mllama states with their cross-attention
    # rows), and its evictions run, while it stays bounded (the default, 8 GiB, grows the RSS by design)
    cache_ram: int = 8
    # MALLOC_MMAP_THRESHOLD_ of the server (0: glibc's default). A fixed threshold turns off glibc's dynamic one,
    # which, raised by each freed large block (a decoded image, a 100 MiB body), serves later blocks of up to 32 MiB
    # from the per-thread arenas that keep them: with it, the RSS of a server that leaks nothing doubles in a few
    # hundred requests (docs/reliability.md) and the RSS no longer measures leaks
    mmap_threshold: int = 65536
    timeout: float = 300.0       # per request
    idle_timeout: float = 120.0  # for the slots to become idle after a round
    rss_tolerance: float = 0.10
    weights: dict[str, float] = field(default_factory=dict)   # overrides of WEIGHTS
    exclude: set[tuple[str, str]] = field(default_factory=set)  # (kind, variant) not to send
    server: str | None = None    # llama-server binary (default: harness.binary)
    model: str | None = None     # text GGUF (default: the tiny mllama, f16)
    mmproj: str | None = None
    log: str | None = None       # server log (default: a temporary file)
    extra_args: list[str] = field(default_factory=list)


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]  # noqa: E731  (nearest rank)
    return {"n": len(s), "p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "max": s[-1]}


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version()}


def server_version(exe: Path) -> str:
    import subprocess

    try:
        p = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return " | ".join(ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith(("version", "built")))


def _model_files(cfg: Config) -> tuple[Path, Path, Path]:
    from tests.mllama import harness, tiny_model as T

    exe = Path(cfg.server) if cfg.server else harness.binary("llama-server")
    if cfg.model:
        assert cfg.mmproj, "--model needs --mmproj"
        return exe, Path(cfg.model), Path(cfg.mmproj)
    text, mmproj = harness.convert(T.get(), None, "f16")
    return exe, text, mmproj


def run(cfg: Config, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Start the server, run the rounds, stop the server; returns the report (``report["problems"]`` lists what went
    wrong, empty when all is well)."""
    import tempfile

    exe, text, mmproj = _model_files(cfg)
    tmp = None
    if cfg.log:
        log = Path(cfg.log)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="server-load-")
        log = Path(tmp.name) / "server.log"
    env = {"MALLOC_MMAP_THRESHOLD_": str(cfg.mmap_threshold)} if cfg.mmap_threshold else None
    srv = S.start(exe, text, mmproj, log, n_parallel=cfg.n_parallel, n_ctx=cfg.n_ctx, threads=cfg.threads,
                  extra=["--cache-ram", str(cfg.cache_ram), *cfg.extra_args], env=env)
    report: dict = {"config": {**asdict(cfg), "exclude": sorted("/".join(x) for x in cfg.exclude)},
                    "machine": machine(), "server_version": server_version(exe), "server_cmd": srv.cmd,
                    "server_env": env,
                    "load_before": os.getloadavg()}
    problems: list[str] = []
    try:
        ctx = calibrate(srv.port)
        report["context"] = asdict(ctx)
        report["greedy"] = {}
        for key, body in GREEDY.items():
            ref, margins = greedy_reference(srv.port, body)
            report["greedy"][key] = {"reference": ref, "min_margin": min(margins) if margins else None,
                                     "margins": margins}
            if not margins or min(margins) <= GREEDY_MARGIN_MIN:
                problems.append(f"the greedy request {key!r} has a near tie (margins {margins}, bound "
                                f"{GREEDY_MARGIN_MIN}): its answer could change with rounding - change its input")
        variants = [v for v in catalogue(ctx) if (v.kind, v.name) not in cfg.exclude]
        rounds = plan(variants, cfg.requests, cfg.round_size, cfg.seed, cfg.weights)
        seeds = random.Random(cfg.seed + 1)
        records: list[Record] = []
        rss: list[dict] = []
        t_start = time.perf_counter()
        busy = 0.0
        for i, picks in enumerate(rounds):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=cfg.clients) as pool:
                futs = [pool.submit(run_one, srv.port, v, i, seeds.getrandbits(32), cfg.timeout, t_start)
                        for v in picks]
                got = [f.result() for f in futs]
            busy += time.perf_counter() - t0
            records += got
            idle = wait_idle(srv.port, cfg.idle_timeout)
            if not srv.alive():
                problems.append(f"the server died in round {i} (exit status {srv.proc.returncode})")
                break
            if not idle:
                problems.append(f"slots still busy {cfg.idle_timeout} s after round {i}")
            rss.append({"round": i, "rss_kb": srv.status_kb("VmRSS"), "hwm_kb": srv.status_kb("VmHWM"),
                        "t_s": round(time.perf_counter() - t_start, 2)})
            n_fail = sum(not r.ok for r in got)
            progress(f"round {i + 1}/{len(rounds)}: {len(got)} requests, {n_fail} failures, "
                     f"{time.perf_counter() - t0:.1f} s, VmRSS {rss[-1]['rss_kb'] / 1024:.1f} MiB")
        wall = time.perf_counter() - t_start

        # the end state
        health: object = None
        if srv.alive():
            try:
                health = S.http_get(srv.port, "/health", timeout=30)[0]
            except (OSError, http.client.HTTPException) as e:
                health = f"{type(e).__name__}: {e}"
            try:
                idle_end = slots_idle(srv.port)
            except (OSError, http.client.HTTPException, ValueError):
                idle_end = False
            if not idle_end:
                problems.append("slots busy at the end")
        if health != 200:
            problems.append(f"/health at the end: {health}")
        alive = srv.alive()
        if not alive:
            problems.append(f"the server is not running at the end (exit status {srv.proc.returncode})")
    finally:
        exit_status = srv.stop(timeout=60)
        log_text = log.read_text(errors="replace") if log.is_file() else ""
        if tmp is not None:
            tmp.cleanup()
    if alive and exit_status != 0:
        problems.append(f"the server's exit status after SIGTERM is {exit_status}")
    markers = sorted({m for m in CRASH_MARKERS if m in log_text})
    if markers:
        problems.append(f"the server log contains {markers}")

    # the numbers
    fails = [r for r in records if not r.ok]
    for r in fails[:30]:
        problems.append(f"round {r.round} {r.kind}/{r.variant}: status {r.status}, {r.outcome}: {r.detail}")
    if len(fails) > 30:
        problems.append(f"... {len(fails) - 30} more failures")
    greedy = [r for r in records if r.greedy and r.ok]
    greedy_answers = {}
    for key, g in report["greedy"].items():
        answers = Counter(r.content for r in greedy if r.greedy == key)
        greedy_answers[key] = dict(answers)
        if set(answers) - {g["reference"]}:
            problems.append(f"the greedy request {key!r} got {len(answers)} different answers: {dict(answers)} "
                            f"(alone before the run: {g['reference']!r})")
    rss_first, rss_last = rss[0]["rss_kb"], rss[-1]["rss_kb"]
    growth = (rss_last - rss_first) / rss_first
    if growth > cfg.rss_tolerance:
        problems.append(f"VmRSS grew by {100 * growth:.1f} % from {rss_first} kB after the first round to "
                        f"{rss_last} kB at the end (tolerance {100 * cfg.rss_tolerance:.0f} %)")
    by_kind: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_kind[r.kind].append(r)
    report.update({
        "requests": len(records),
        "rounds": len(rss),
        "wall_s": wall,
        "busy_s": busy,
        "requests_per_s": len(records) / busy if busy else None,
        "failures": len(fails),
        "outcomes": {k: dict(Counter(r.outcome for r in rs)) for k, rs in sorted(by_kind.items())},
        "variants": {k: dict(Counter(r.variant for r in rs)) for k, rs in sorted(by_kind.items())},
        "status": {str(k): n for k, n in sorted(Counter(r.status for r in records).items(), key=lambda kv: str(kv[0]))},
        "latency_s": {"all": percentiles([r.latency_s for r in records]),
                      **{k: percentiles([r.latency_s for r in rs]) for k, rs in sorted(by_kind.items())}},
        "greedy_answers": greedy_answers,
        "rss": {"first_round_kb": rss_first, "end_kb": rss_last, "growth": growth,
                "max_kb": max(x["rss_kb"] for x in rss), "hwm_kb": rss[-1]["hwm_kb"], "per_round": rss},
        "health_end": health,
        "alive_end": alive,
        "exit_status": exit_status,
        "log_markers": markers,
        "load_after": os.getloadavg(),
        "failed_requests": [asdict(r) for r in fails],
        "greedy_requests": [asdict(r) for r in greedy],
        "problems": problems,
    })
    return report


def summary(report: dict) -> str:
    lines = [f"{report['requests']} requests in {report['rounds']} rounds, {report['config']['clients']} clients, "
             f"{report['busy_s']:.1f} s: {report['requests_per_s']:.2f} requests/s; failures: {report['failures']}",
             f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores; load average before "
             f"{report['load_before'][0]:.2f}, after {report['load_after'][0]:.2f}",
             f"server: {report['server_version']}",
             f"status codes: {report['status']}",
             f"{'kind':<13} {'n':>4} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'max s':>7}  outcomes"]
    for kind, lat in report["latency_s"].items():
        out = report["outcomes"].get(kind, {})
        lines.append(f"{kind:<13} {lat['n']:>4} {lat['p50']:>7.3f} {lat['p90']:>7.3f} {lat['p99']:>7.3f} "
                     f"{lat['max']:>7.3f}  {out if out else ''}")
    for key, g in report["greedy"].items():
        answers = report["greedy_answers"].get(key, {})
        lines.append(f"greedy {key!r}: {sum(answers.values())} answers, {len(answers)} distinct (alone: "
                     f"{g['reference']!r}, smallest margin {g['min_margin']:.3f})")
    r = report["rss"]
    lines.append(f"VmRSS: {r['first_round_kb'] / 1024:.1f} MiB after the first round, {r['end_kb'] / 1024:.1f} MiB "
                 f"at the end ({100 * r['growth']:+.1f} %), max {r['max_kb'] / 1024:.1f} MiB, "
                 f"peak (VmHWM) {r['hwm_kb'] / 1024:.1f} MiB")
    lines.append(f"end: alive {report['alive_end']}, /health {report['health_end']}, exit status after SIGTERM "
                 f"{report['exit_status']}, log markers {report['log_markers']}")
    lines.append("problems:" + "".join(f"\n  - {p}" for p in report["problems"]) if report["problems"]
                 else "no problems")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    ap.add_argument("--requests", type=int, default=d.requests, help="number of requests (default %(default)s)")
    ap.add_argument("--clients", type=int, default=d.clients, help="concurrent clients (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed, help="seed of the request mix (default %(default)s)")
    ap.add_argument("--round-size", type=int, default=d.round_size,
                    help="requests per round; RSS is sampled after each (default %(default)s)")
    ap.add_argument("--report", type=Path, help="write the full report (JSON) here")
    ap.add_argument("--parallel", dest="n_parallel", type=int, default=d.n_parallel, help="server slots")
    ap.add_argument("--ctx", dest="n_ctx", type=int, default=d.n_ctx,
                    help="server context, all slots together (default %(default)s)")
    ap.add_argument("--threads", type=int, default=d.threads, help="server threads (default %(default)s)")
    ap.add_argument("--cache-ram", type=int, default=d.cache_ram,
                    help="the server's prompt cache, MiB (default %(default)s)")
    ap.add_argument("--mmap-threshold", type=int, default=d.mmap_threshold,
                    help="MALLOC_MMAP_THRESHOLD_ of the server, 0: glibc's dynamic default (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=d.timeout, help="per request, seconds (default %(default)s)")
    ap.add_argument("--rss-tolerance", type=float, default=d.rss_tolerance)
    ap.add_argument("--exclude", action="append", default=[], metavar="KIND/VARIANT",
                    help="a request variant not to send (repeat)")
    ap.add_argument("--weight", action="append", default=[], metavar="KIND=W",
                    help=f"share of a kind in the mix (repeat; default {WEIGHTS})")
    ap.add_argument("--server", help="llama-server binary (default: $S3D8_BIN_DIR or build/host/bin)")
    ap.add_argument("--model", help="text GGUF (default: the tiny random mllama, converted to f16)")
    ap.add_argument("--mmproj", help="mmproj GGUF for --model")
    ap.add_argument("--log", help="keep the server log here")
    ap.add_argument("--server-arg", action="append", default=[], dest="extra_args",
                    help="one more llama-server argument (repeat: --server-arg=--metrics)")
    a = ap.parse_args(argv)
    cfg = Config(requests=a.requests, clients=a.clients, seed=a.seed, round_size=a.round_size,
                 n_parallel=a.n_parallel, n_ctx=a.n_ctx, threads=a.threads, cache_ram=a.cache_ram,
                 mmap_threshold=a.mmap_threshold, timeout=a.timeout, rss_tolerance=a.rss_tolerance,
                 server=a.server, model=a.model, mmproj=a.mmproj, log=a.log,
                 extra_args=a.extra_args,
                 weights={k: float(w) for k, w in (x.split("=", 1) for x in a.weight)},
                 exclude={tuple(x.split("/", 1)) for x in a.exclude})
    report = run(cfg, progress=lambda s: print(s, flush=True))
    if a.report:
        a.report.write_text(json.dumps(report, indent=1) + "\n")
    print(summary(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())

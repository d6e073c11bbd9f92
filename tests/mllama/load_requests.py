"""The requests of the llama-server load run (``tests/mllama/server_load.py``): the bodies (chats, images, the two
greedy requests) and the catalogue of request variants with their allowed outcomes, and the seeded plan of rounds."""

from __future__ import annotations

import io
import json
import random
import struct
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import numpy as np

from tests.mllama import llama_server as S


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

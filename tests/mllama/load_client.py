"""Sending one request of the load run (``tests/mllama/server_load.py``) and judging its response, and the server side:
calibration of the context, the greedy references, idleness."""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from dataclasses import dataclass
from typing import Callable


from tests.mllama import llama_server as S
from tests.mllama.load_requests import Context, JSON, OK_OUTCOMES, PATH, Variant, jbody, text_chat, words


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

"""Starting llama-server with the tiny mllama model, and the request helpers its tests share.

Used by ``tests/python/test_mllama_server.py`` (the functional tests) and ``tests/mllama/server_load.py`` (the
load-and-abuse driver). Standard library plus numpy and Pillow (for the images).
"""

from __future__ import annotations

import base64
import http.client
import io
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tests.mllama.margins import assert_greedy_match

N_PREDICT = 8

# The options every test server runs with. One token per ubatch: the answers of a (tie-prone) random model must not
# depend on which requests happen to share a batch, since bigger batches take other matmul kernels (other rounding).
COMMON_ARGS = ("--no-warmup", "--jinja", "-ub", "1")


class ServerError(RuntimeError):
    """llama-server exited or did not become ready; the message ends with the tail of its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_bytes(h: int, w: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_data_url(h: int, w: int, seed: int) -> str:
    return data_url(png_bytes(h, w, seed))


def chat_body(image_url: str, text: str = "What does the image show?", stream: bool = False) -> dict:
    return {
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url}},
            {"type": "text", "text": text},
        ]}],
        "max_tokens": N_PREDICT,
        "temperature": 0.0,
        "seed": 42,
        "stream": stream,
    }


# --- greedy answers with their log-probabilities ------------------------------------------------------------------
#: How far the log-probabilities of the same greedy request may move between two servings of it by the same server:
#: other KV-cache cells, other cross-attention store rows, a cached prompt prefix or another request in the batch
#: change the order of the attention sums. Measured on the tiny random model (f16 weights and cache): up to ~2e-3;
#: attending another image moves them by ~0.5. A greedy token may flip only where its margin is under twice this.
LOGPROB_TOL = 1e-2
TOP_LOGPROBS = 10


@dataclass
class Answer:
    """A greedy answer as the server lists it: per listed token its id, its text piece and the log-probabilities of the
    best candidates ({id: logprob}, the chosen token among them), with the number of listed entries that are one token
    each (``aligned``, see :func:`_entries`), why it ended ("length" or "stop") and the server's timings."""
    ids: list[int]
    pieces: list[str]
    candidates: list[dict[int, float]]
    finish_reason: str
    timings: dict = field(default_factory=dict)
    aligned: int | None = None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def margins(self) -> list[float]:
        """Chosen minus best other candidate's log-probability per listed token; 0 (never decisive) from the first
        entry that is not one token on: a token the server held back had a margin it does not list."""
        out = []
        for i, (tok, cand) in enumerate(zip(self.ids, self.candidates)):
            others = [lp for t, lp in cand.items() if t != tok]
            assert others, f"token {tok}: ask for top_logprobs >= 2 to know its margin"
            out.append(cand[tok] - max(others) if self.aligned is None or i < self.aligned else 0.0)
        return out


def with_logprobs(body: dict, top: int = TOP_LOGPROBS) -> dict:
    return {**body, "logprobs": True, "top_logprobs": top}


def _entries(entries: Sequence[dict]) -> tuple[list[int], list[str], list[dict[int, float]], int]:
    """The listed tokens and how many of them, from the first on, are one token each. The server holds back a token
    that leaves the text in incomplete UTF-8 and lists it with none of its log-probabilities: the next entry's text
    then carries its bytes too, and differs from the chosen candidate's own piece; from there on the entries are not
    the decisions one for one."""
    ids = [int(e["id"]) for e in entries]
    pieces = [str(e["token"]) for e in entries]
    cands = [{int(t["id"]): float(t["logprob"]) for t in e["top_logprobs"]} for e in entries]
    aligned = 0
    for e in entries:
        own = [t for t in e["top_logprobs"] if int(t["id"]) == int(e["id"])]
        if not own or own[0].get("bytes") != e.get("bytes"):
            break
        aligned += 1
    return ids, pieces, cands, aligned


def parse_answer(res: dict) -> Answer:
    """An /v1/chat/completions response (non-streamed) asked :func:`with_logprobs`."""
    choice = res["choices"][0]
    # the server lists no log-probabilities for an answer that is all incomplete UTF-8 (held back as it streams)
    assert "logprobs" in choice and choice["logprobs"], \
        f"no logprobs in the answer {choice['message']['content']!r}: the test input must change"
    ids, pieces, cands, aligned = _entries(choice["logprobs"]["content"])
    if aligned == len(ids) and res.get("usage", {}).get("completion_tokens", len(ids)) != len(ids):
        aligned = len(ids) - 1  # the last token was held back: its decision is unlisted
    return Answer(ids, pieces, cands, choice["finish_reason"], res.get("timings", {}), aligned)


def parse_stream(chunks: Sequence[dict]) -> Answer:
    """The data chunks of a streamed /v1/chat/completions answer asked :func:`with_logprobs`."""
    entries: list[dict] = []
    finish, timings = "", dict[str, Any]()
    for c in chunks:
        for choice in c.get("choices", []):
            entries += (choice.get("logprobs") or {}).get("content") or []
            finish = choice.get("finish_reason") or finish
        timings = c.get("timings", timings)
    assert entries, "no logprobs in the streamed answer: the test input must change"
    ids, pieces, cands, aligned = _entries(entries)
    return Answer(ids, pieces, cands, finish, timings, aligned)


def logprob_deviation(got: Answer, ref: Answer) -> float:
    """A lower bound of max |logprob difference| over the vocabulary, up to where the greedy tokens part (after that
    the contexts differ): exact for the candidates both list; a candidate only one lists is at most the other's last
    listed logprob there."""
    def one_sided(x: dict[int, float], y: dict[int, float]) -> float:
        floor = min(y.values())
        return max((abs(lp - y[t]) if t in y else max(0.0, lp - floor) for t, lp in x.items()), default=0.0)
    dev = 0.0
    for tok_g, cand_g, tok_r, cand_r in zip(got.ids, got.candidates, ref.ids, ref.candidates):
        dev = max(dev, one_sided(cand_g, cand_r), one_sided(cand_r, cand_g))
        if tok_g != tok_r:
            break
    return dev


def _decisions(a: Answer) -> tuple[list, list[float]]:
    """The answer's greedy decisions: its tokens, then - for an answer that chose to end - the end (whose margin the
    server does not list: never decisive). An answer cut at max_tokens made no decision there."""
    if a.finish_reason == "length":
        return list(a.ids), a.margins()
    return [*a.ids, "<end>"], [*a.margins(), 0.0]


def assert_same_answer(got: Answer, ref: Answer, *, what: str, tol: float = LOGPROB_TOL,
                       min_decisive: int = N_PREDICT // 2) -> int:
    """``got`` serves the same greedy request as ``ref``: log-probabilities within ``tol`` up to where the tokens part,
    and the same tokens over ``ref``'s decisions whose margin exceeds 2 * tol (margins.assert_greedy_match)."""
    dev = logprob_deviation(got, ref)
    assert dev <= tol, f"{what}: log-probabilities differ by {dev:.3g} > {tol:.3g}"
    got_dec, _ = _decisions(got)
    ref_dec, ref_margins = _decisions(ref)
    return assert_greedy_match(got_dec, ref_dec, ref_margins, 2 * tol, what=what, min_decisive=min_decisive)


def assert_text_is_answer(text: str, ref: Answer, *, what: str, tol: float = LOGPROB_TOL,
                          min_decisive: int = N_PREDICT // 2) -> int:
    """A greedy answer known only as text (a web page's) is ``ref``'s over ``ref``'s decisive tokens: the whole text
    when every token is decisive (and the answer was cut at max_tokens, or its end is not needed: see _decisions)."""
    pieces = [*ref.pieces, ""] if ref.finish_reason != "length" else list(ref.pieces)
    _, ref_margins = _decisions(ref)
    return assert_greedy_match(text, pieces, ref_margins, 2 * tol, what=what, min_decisive=min_decisive)


def http_get(port: int, path: str, timeout: float = 5) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        res = conn.getresponse()
        return res.status, res.read()
    finally:
        conn.close()


@dataclass
class Server:
    """A running llama-server on 127.0.0.1:port, its output going to ``log``."""

    proc: subprocess.Popen
    port: int
    log: Path
    cmd: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def status_kb(self, key: str = "VmRSS") -> int:
        """A memory figure of /proc/<pid>/status in kB (VmRSS: resident set, VmHWM: its peak)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
        raise KeyError(key)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM (the server's clean shutdown), SIGKILL after ``timeout``; returns the exit status (negative: the
        signal that ended it)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start(exe: Path, text: Path, mmproj: Path | None, log: Path, *, n_parallel: int, n_ctx: int, threads: int = 2,
          extra: Sequence[str] = (), env: Mapping[str, str] | None = None, ready_timeout: float = 120) -> Server:
    """Start llama-server on a free loopback port and wait until /health answers 200; ServerError otherwise (the
    process is then stopped). ``mmproj`` None: a server without the vision projector (text only). ``env``: variables
    added to the server's environment."""
    port = free_port()
    projector = ("--mmproj", str(mmproj)) if mmproj is not None else ()
    cmd = [str(exe), "-m", str(text), *projector, "--host", "127.0.0.1", "--port", str(port),
           "-np", str(n_parallel), "-c", str(n_ctx), "-t", str(threads), *COMMON_ARGS, *extra]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=None if env is None else {**os.environ, **env})
    srv = Server(proc, port, log, cmd)
    deadline = time.time() + ready_timeout
    while True:
        if proc.poll() is not None:
            raise ServerError(f"llama-server exited with {proc.returncode}:\n{srv.log_tail()}")
        try:
            if http_get(port, "/health", timeout=2)[0] == 200:
                return srv
        except (OSError, http.client.HTTPException):
            pass
        if time.time() > deadline:
            srv.stop()
            raise ServerError(f"llama-server did not become ready:\n{srv.log_tail()}")
        time.sleep(0.5)

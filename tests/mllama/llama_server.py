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
from typing import Mapping, Sequence

import numpy as np

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

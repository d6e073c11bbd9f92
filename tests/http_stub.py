"""The answer of the fake HTTP servers in the tests (an OpenAI-compatible endpoint in a thread): a JSON body."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from typing import Any


def send_json(handler: BaseHTTPRequestHandler, obj: Any, status: int = 200) -> None:
    """Answer the handler's request with ``obj`` as JSON (Content-Type and Content-Length set) and ``status``."""
    body = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)

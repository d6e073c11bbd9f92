"""llama-server's own web page in a real browser: an image chat with the tiny mllama, checked against the HTTP API.

Headless Chromium (Debian's ``chromium``) is driven by playwright-core (``tests/browser/chat.cjs``; set-up installs
both, ``ci/setup.sh`` and ``ci/ui.sh``) against the page that ``llama-server`` embeds (upstream's ``tools/ui``, built
by ``ci/ui.sh``). The page is given ``temperature`` 0 and ``max_tokens`` through its stored settings (localStorage
``LlamaUi.config``, as its Settings dialog stores them), so that its requests are greedy:

* on a server with the projector (``--parallel 2``): a photo (scikit-image's astronaut) and a question, the answer
  seen while it streams; then a second photo (chelsea) in the same conversation, which the server takes as
  ``docs/mllama.md`` says (the whole conversation recomputed, both images attended). Each answer the page shows
  equals the OpenAI-style API's (``/v1/chat/completions``) for the request the page sent and for the same
  conversation written by hand; the page sent the photo's bytes unchanged and the sampling settings above;
* on a server without the projector: the page refuses the photo with a message (and sends no image), still
  chats, and the API answers an image request with 400;
* an image the browser cannot decode: a message on the page, no spinner left (the server refuses it with 400).

No page state is left waiting: every step ends with neither a spinner nor a stop button (``chat.cjs``). The chat's
screenshot is written under the test's temporary folder; with ``S3D8_UI_SCREENSHOTS=DIR`` also into DIR (``docs/img/``
keeps the ones ``docs/server.md`` shows). ``S3D8_UI_PATH=DIR`` has the servers serve the UI build in DIR
(``llama-server --path``) instead of the page they embed: to try a UI change without rebuilding llama-server.
Without a chromium browser the browser tests skip, saying so (``S3D8_CHROMIUM`` names another executable).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import importlib.util
from pathlib import Path

import pytest
import requests

from tests.mllama import harness, llama_server, tiny_model as T

pytestmark = pytest.mark.browser

REPO = harness.REPO_ROOT
CHAT_JS = REPO / "tests" / "browser" / "chat.cjs"
MAX_TOKENS = 16
QUESTIONS = ("What does the image show?", "And this one?")
TIMEOUT_MS = 120_000  # one step (a 2-core CI machine under pytest -n 2)
IDLE_TIMEOUT_MS = 15_000  # from the answer (or the error) to a page without spinner and stop button


def chromium() -> str:
    exe = os.environ.get("S3D8_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        pytest.skip("no chromium browser (Debian: apt-get install chromium; ci/setup.sh installs it)")
    return exe


def playwright_core() -> Path:
    cache = Path(os.environ.get("S3D8_CACHE", REPO / ".cache"))
    path = cache / "browser-test" / "node_modules" / "playwright-core"
    if not (path / "package.json").is_file():
        pytest.fail(f"{path} is missing: run `bash ci/ui.sh` (ci/setup.sh does)", pytrace=False)
    if not shutil.which("node"):
        pytest.fail("node is missing (ci/setup.sh's system packages)", pytrace=False)
    return path


def data_url(png: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()


def image_part(png: Path) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(png)}}


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> dict[str, Path]:
    import skimage.data
    from PIL import Image

    d = tmp_path_factory.mktemp("photos")
    out = {}
    for name in ("astronaut", "chelsea"):
        out[name] = d / f"{name}.png"
        Image.fromarray(getattr(skimage.data, name)()).save(out[name])
    out["broken"] = d / "broken.png"  # a PNG name and signature, then bytes no decoder takes
    out["broken"].write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    return out


@pytest.fixture(scope="module")
def model() -> tuple[Path, Path]:
    return harness.convert(T.get(), None, "f16")


def start_server(tmp_path_factory, model, with_projector: bool):
    text, mmproj = model
    exe = harness.binary("llama-server")
    log = tmp_path_factory.mktemp("log") / "server.log"
    extra = ["--alias", "tiny-mllama"]
    if os.environ.get("S3D8_UI_PATH"):
        extra += ["--path", os.environ["S3D8_UI_PATH"]]
    try:
        # one thread: the other pytest worker runs beside it on 2 cores
        return llama_server.start(exe, text, mmproj if with_projector else None, log, n_parallel=2, n_ctx=2048,
                                  threads=1, extra=extra)
    except llama_server.ServerError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory, model):
    srv = start_server(tmp_path_factory, model, with_projector=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def text_server(tmp_path_factory, model):
    srv = start_server(tmp_path_factory, model, with_projector=False)
    yield srv
    srv.stop()


def browse(server: llama_server.Server, steps: list[dict], out_dir: Path, viewport: dict | None = None) -> dict:
    """Run tests/browser/chat.cjs through ``steps`` on the server's page; its record (see there)."""
    spec = {"playwright_core": str(playwright_core()), "chromium": chromium(), "url": server.url + "/",
            "settings": {"temperature": 0, "max_tokens": MAX_TOKENS}, "timeout_ms": TIMEOUT_MS,
            "idle_timeout_ms": IDLE_TIMEOUT_MS, "out": str(out_dir / "record.json"), "steps": steps}
    if viewport:
        spec["viewport"] = viewport
    (out_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    n_steps = len(steps) + 1
    proc = subprocess.run(["node", str(CHAT_JS), str(out_dir / "spec.json")], capture_output=True, text=True,
                          timeout=n_steps * TIMEOUT_MS / 1000 + 60)
    record_file = out_dir / "record.json"
    assert record_file.is_file(), f"chat.cjs wrote no record (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    record = json.loads(record_file.read_text())
    assert record["page"]["status"] == 200 and record["page"].get("message_box"), \
        f"the page did not load with its message box: {record['page']}\n{record['error']}"
    assert not record["page_errors"], record["page_errors"]
    return record


def failure(record: dict, server: llama_server.Server) -> str:
    steps = json.dumps(record["steps"], indent=1)[-3000:]
    return f"{record['error']}\nsteps: {steps}\nserver log:\n{server.log_tail(2000)}"


def keep_screenshot(png: Path, name: str) -> None:
    dest = os.environ.get("S3D8_UI_SCREENSHOTS")
    if dest and png.is_file():
        shutil.copyfile(png, Path(dest) / name)


def api_answer(server: llama_server.Server, body: dict) -> str:
    return api_greedy(server, body).text


def api_greedy(server: llama_server.Server, body: dict) -> llama_server.Answer:
    """The API's answer to ``body`` (made non-streamed), with the log-probabilities that say which of its tokens are
    decided outside rounding (llama_server.assert_text_is_answer)."""
    body = {**body, "stream": False}
    body.pop("return_progress", None)
    body.pop("sse_ping_interval", None)
    r = requests.post(f"{server.url}/v1/chat/completions", json=llama_server.with_logprobs(body),
                      timeout=TIMEOUT_MS / 1000)
    assert r.status_code == 200, r.text
    return llama_server.parse_answer(r.json())


def sent_images(body: dict) -> list[bytes]:
    """The images of the request's last user message, decoded."""
    content = body["messages"][-1]["content"]
    parts = content if isinstance(content, list) else []
    return [base64.b64decode(p["image_url"]["url"].split(",", 1)[1]) for p in parts if p.get("type") == "image_url"]


def norm(s: str) -> str:
    return " ".join(s.split())


def shown_prefixes(texts: list[str], answer: str) -> set[int]:
    """For each text the answer's box showed, the length of the longest prefix of the answer it began with."""
    a = norm(answer)
    out = set()
    for t in texts:
        t = norm(t)
        n = 0
        while n < len(a) and t.startswith(a[: n + 1]):
            n += 1
        out.add(n)
    return out


def test_page_is_served(text_server):
    """The page itself, without a browser: llama-server answers / with the UI's index.html and its build.json names
    the pinned upstream release (ci/ui.sh)."""
    r = requests.get(text_server.url + "/", headers={"Accept-Encoding": "gzip"}, timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/html"), (r.status_code, r.text[:200])
    assert "<html" in r.text.lower() and "_app/immutable" in r.text, r.text[:500]
    spec = importlib.util.spec_from_file_location("s3d8_ci_upstream", REPO / "ci" / "upstream.py")
    assert spec is not None and spec.loader is not None
    upstream = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = upstream  # its dataclasses look their module up there
    spec.loader.exec_module(upstream)
    PIN = upstream.PIN

    r = requests.get(text_server.url + "/build.json", headers={"Accept-Encoding": "gzip"}, timeout=10)
    assert r.status_code == 200 and r.json() == {"version": PIN}, r.text[:200]


def test_image_chat_in_the_browser(vision_server, photos, tmp_path):
    steps = [{"attach": str(photos["astronaut"]), "text": QUESTIONS[0], "screenshot": str(tmp_path / "turn1.png")},
             {"attach": str(photos["chelsea"]), "text": QUESTIONS[1], "screenshot": str(tmp_path / "chat.png"),
              "scroll_top": True}]
    record = browse(vision_server, steps, tmp_path, viewport={"width": 1280, "height": 1200})
    keep_screenshot(tmp_path / "chat.png", "server-ui-chat.png")
    assert record["error"] is None, failure(record, vision_server)

    # what the page stored: two turns, each with its photo, each answered
    msgs = record["messages"]
    assert [(m["role"], m["images"]) for m in msgs] == [("user", 1), ("assistant", 0)] * 2, msgs
    assert [m["content"] for m in msgs[0::2]] == list(QUESTIONS)
    answers = [m["content"] for m in msgs[1::2]]
    assert all(answers), answers

    bodies = record["requests"]
    assert len(bodies) == 2, f"{len(bodies)} chat requests"
    for i, (step, body, png) in enumerate(zip(record["steps"], bodies, (photos["astronaut"], photos["chelsea"]))):
        assert step["attach"].get("preview"), f"turn {i + 1}: the photo was not shown in the message box: {step}"
        # streamed: the server sent the answer in several parts and the page shows their sum. (Whether the box was
        # *seen* half-filled depends on the machine's speed - 16 tokens of the tiny model take 0.1 s - so it is not
        # asserted; the parts are.)
        assert step["status"] == 200 and step["content_type"].startswith("text/event-stream"), step
        assert step["content_chunks"] >= 2, f"turn {i + 1}: the answer came in {step['content_chunks']} part(s)"
        assert norm(step["streamed"]) == norm(answers[i]), f"turn {i + 1}: {step['streamed']!r} != {answers[i]!r}"
        seen = shown_prefixes(step["answer_texts"], answers[i])
        assert len(norm(answers[i])) in seen, f"turn {i + 1}: the box never showed the answer: {step['answer_texts']}"
        assert not step["dialog"] and not step["busy"], step
        # the page sent the photo as it is, with the greedy settings
        assert sent_images(body) == [png.read_bytes()], f"turn {i + 1}: the page did not send the photo unchanged"
        assert body["temperature"] == 0 and body["max_tokens"] == MAX_TOKENS and body["stream"] is True, \
            {k: v for k, v in body.items() if k != "messages"}
        # the API's answer to the request the page sent
        llama_server.assert_text_is_answer(answers[i], api_greedy(vision_server, body),
                                           what=f"turn {i + 1}: the page's answer vs the API's")

    # the same conversation written by hand as an OpenAI-style request
    turn1 = {"role": "user", "content": [image_part(photos["astronaut"]), {"type": "text", "text": QUESTIONS[0]}]}
    turn2 = {"role": "user", "content": [image_part(photos["chelsea"]), {"type": "text", "text": QUESTIONS[1]}]}
    plain = {"temperature": 0, "max_tokens": MAX_TOKENS}
    llama_server.assert_text_is_answer(answers[0], api_greedy(vision_server, {"messages": [turn1], **plain}),
                                       what="turn 1 by hand")
    llama_server.assert_text_is_answer(
        answers[1], api_greedy(vision_server, {"messages": [turn1, {"role": "assistant", "content": answers[0]}, turn2],
                                               **plain}), what="turn 2 by hand")
    # the photo reached the model: without it the answer differs
    assert api_answer(vision_server, {"messages": [{"role": "user", "content": QUESTIONS[0]}], **plain}) != answers[0]

    # the second image, as docs/mllama.md says: the conversation is recomputed (nothing of the first turn's cached
    # prompt is reused: its text attended the first image only), both images attended
    second = record["steps"][1]["timings"]
    assert second["cache_n"] == 0 and second["prompt_n"] > record["steps"][0]["timings"]["prompt_n"], \
        record["steps"][1]["timings"]
    assert requests.get(f"{vision_server.url}/health", timeout=5).status_code == 200
    assert vision_server.alive()


def test_server_without_projector_refuses_images(text_server, photos, tmp_path):
    steps = [{"attach": str(photos["chelsea"]), "screenshot": str(tmp_path / "refused.png")},
             {"text": "Hello", "screenshot": str(tmp_path / "text.png")}]
    record = browse(text_server, steps, tmp_path)
    keep_screenshot(tmp_path / "refused.png", "server-ui-no-projector.png")
    assert record["error"] is None, failure(record, text_server)

    refused, chat = record["steps"]
    # a message on the page, and the photo is not attached
    assert "Images require a vision-capable model" in refused["attach"].get("dialog", ""), refused
    assert not refused["busy"]
    # the page still chats (text only), and sent no image
    assert chat["status"] == 200 and not chat["dialog"] and not chat["busy"], chat
    assert len(record["requests"]) == 1 and sent_images(record["requests"][0]) == []
    assert [m["role"] for m in record["messages"]] == ["user", "assistant"] and record["messages"][1]["content"]

    # the API: an image request to a server without projector is a client error with a message
    body = {"messages": [{"role": "user", "content": [image_part(photos["chelsea"]), {"type": "text", "text": "Hi"}]}],
            "max_tokens": 4, "temperature": 0}
    r = requests.post(f"{text_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "image input is not supported" in r.json()["error"]["message"]


def test_undecodable_image_is_reported_without_a_hung_spinner(vision_server, photos, tmp_path):
    steps = [{"attach": str(photos["broken"]), "text": QUESTIONS[0], "screenshot": str(tmp_path / "broken.png")}]
    record = browse(vision_server, steps, tmp_path)
    assert record["error"] is None, failure(record, vision_server)
    (broken,) = record["steps"]
    # the page cannot decode the image to send it (it sends nothing, or the server refuses it): it says so, and is
    # idle again
    assert broken["dialog"] and not broken["busy"], broken
    assert broken.get("status", 400) == 400, broken
    # the API refuses the same bytes with 400
    body = {"messages": [{"role": "user", "content": [image_part(photos["broken"]),
                                                      {"type": "text", "text": QUESTIONS[0]}]}],
            "max_tokens": 4, "temperature": 0}
    r = requests.post(f"{vision_server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text

"""Synthetic QAT data: the recipe's prompt sampler (qat.prompts), the JSONL schema (qat.data) and teacher
generation with its backends and resume (qat.generate).

Probability checks use 20000 draws and a tolerance of 5 binomial standard deviations,
5 * sqrt(p (1 - p) / n) with n the number of draws the probability is conditioned on (the draws are
seeded, so the test is deterministic; 5 sigma keeps it robust to any change of the seed).
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from qat import prompts as P
from tests.http_stub import send_json
from qat.data import FinishReason, Sample, SampleWriter, append_sample, read_samples, recover
from qat.generate import (EndpointTeacher, GenConfig, GenerateError, PromptRenderer, TransformersTeacher,
                          list_images, main, make_job, run)

REPO = Path(__file__).resolve().parents[2]
N_DRAWS = 20000


# ------------------------------------------------------------------------------------------------
# prompt sampler


def test_pool_is_the_recipes_495_prompts() -> None:
    assert (len(P.BASE_PROMPTS), len(P.ACTIONS), len(P.TARGETS), len(P.AUDIENCES), len(P.STYLES)) == (15, 5, 6, 4, 4)
    pool = P.PROMPT_POOL
    assert len(pool) == 495 and len(set(pool)) == 495
    assert pool[:15] == P.BASE_PROMPTS
    assert list(pool[15:]) == [f"{a} {t} {au} {s}" for a, t, au, s in
                               itertools.product(P.ACTIONS, P.TARGETS, P.AUDIENCES, P.STYLES)]
    assert len(P.BASE_INSTRUCTIONS) == 16 and len(P.FORMAT_INSTRUCTIONS) == 11 and len(P.ADHERENCE_PROBES) == 9
    assert {k: len(v) for k, v in P.LENGTH_INSTRUCTIONS.items()} == {"short": 4, "medium": 3, "long": 3}
    assert P.LENGTH_BUCKET_P == {"short": 0.40, "medium": 0.38, "long": 0.22}
    assert len(P.INSTRUCTION_WRAPPERS) == 4 and len(P.PLAIN_WRAPPERS) == 3
    assert (P.P_CHAT, P.P_INSTRUCTION, P.P_WRAP, P.P_LENGTH, P.P_FORMAT, P.P_ADHERENCE) == (0.75, 0.75, 0.7, 0.75,
                                                                                          0.45, 0.40)
    assert P.PLAIN_TEMPLATE == "<|image|>{prompt}"
    assert P.CHAT_TEMPLATE == ("<|start_header_id|>user<|end_header_id|>\n\n<|image|>{prompt}<|eot_id|>"
                               "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # every instruction line is distinct across the categories (the probability test relies on it)
    lines = (list(P.BASE_INSTRUCTIONS) + [x for v in P.LENGTH_INSTRUCTIONS.values() for x in v]
             + list(P.FORMAT_INSTRUCTIONS) + list(P.ADHERENCE_PROBES))
    assert len(lines) == len(set(lines)) == 16 + 10 + 11 + 9


@pytest.fixture(scope="module")
def draws() -> list[P.SampledPrompt]:
    return [P.sample_prompt(P.DEFAULT_SEED, i) for i in range(N_DRAWS)]


def _check_rate(hits: int, n: int, p: float, what: str) -> None:
    tol = 5 * math.sqrt(p * (1 - p) / n)
    assert abs(hits / n - p) <= tol, f"{what}: {hits}/{n} = {hits / n:.4f}, expected {p} +- {tol:.4f}"


def test_sampler_probabilities_match_the_recipe(draws: list[P.SampledPrompt]) -> None:
    n = len(draws)
    _check_rate(sum(d.template == "chat" for d in draws), n, P.P_CHAT, "chat template")
    inst = [d for d in draws if d.instruction is not None]
    _check_rate(len(inst), n, P.P_INSTRUCTION, "instruction block")
    _check_rate(sum(d.wrapped for d in inst), len(inst), P.P_WRAP, "wrapper given an instruction block")
    blocks = [(d.instruction or "").split("\n") for d in inst]
    length_sets = {b: set(v) for b, v in P.LENGTH_INSTRUCTIONS.items()}
    has_len = [d for d, lines in zip(inst, blocks) if any(l in s for s in length_sets.values() for l in lines)]
    _check_rate(len(has_len), len(inst), P.P_LENGTH, "length instruction")
    for bucket, p in P.LENGTH_BUCKET_P.items():
        _check_rate(sum(d.length_bucket == bucket for d in has_len), len(has_len), p, f"length bucket {bucket}")
    _check_rate(sum(any(l in P.FORMAT_INSTRUCTIONS for l in b) for b in blocks), len(inst), P.P_FORMAT, "format")
    _check_rate(sum(any(l in P.ADHERENCE_PROBES for l in b) for b in blocks), len(inst), P.P_ADHERENCE, "adherence")
    assert all(b[0] in P.BASE_INSTRUCTIONS for b in blocks)
    # uniform choices: each instruction wrapper / plain wrapper / base prompt
    wrapped = [d for d in inst if d.wrapped]
    for w in P.INSTRUCTION_WRAPPERS:
        _check_rate(sum(d.wrapper == w for d in wrapped), len(wrapped), 1 / 4, f"wrapper {w!r}")
    plain = [d for d in draws if d.instruction is None]
    for w in P.PLAIN_WRAPPERS:
        _check_rate(sum(d.wrapper == w for d in plain), len(plain), 1 / 3, f"plain wrapper {w!r}")
    _check_rate(sum(d.base_prompt in P.BASE_PROMPTS for d in draws), n, 15 / 495, "base prompt")
    assert len({d.base_prompt for d in draws}) == 495


def test_sampled_prompt_structure(draws: list[P.SampledPrompt]) -> None:
    for d in draws[:2000]:
        assert d.base_prompt in P.PROMPT_POOL
        if d.instruction is None:
            assert d.prompt == d.wrapper.format(prompt=d.base_prompt) and d.wrapper in P.PLAIN_WRAPPERS
        else:
            expected = d.wrapper if d.wrapped else P.UNWRAPPED_INSTRUCTION
            assert d.prompt == expected.format(instruction=d.instruction, prompt=d.base_prompt)
            lines = d.instruction.split("\n")
            assert len(lines) == len(set(lines)) <= 4
        assert d.prompt.endswith("\n")


def test_sampler_is_reproducible_and_per_index(draws: list[P.SampledPrompt]) -> None:
    # a pure function of (seed, i): any order, any process, same answer
    for i in (N_DRAWS - 1, 17, 0, 12345):
        assert P.sample_prompt(P.DEFAULT_SEED, i) == draws[i]
    assert [P.generation_seed(7, i) for i in range(50)] == [P.generation_seed(7, i) for i in range(50)]
    assert len({P.generation_seed(7, i) for i in range(1000)}) == 1000
    other = [P.sample_prompt(P.DEFAULT_SEED + 1, i) for i in range(200)]
    assert sum(a != b for a, b in zip(other, draws[:200])) > 150
    code = "from qat.prompts import sample_prompt as s; print(repr(s(693785, 4321)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == repr(draws[4321])


# ------------------------------------------------------------------------------------------------
# JSONL schema


def _sample(i: int, **kw) -> Sample:
    base = dict(id=i, seed=1, image=None, template="chat", prompt=f"p{i}\n", prompt_text=f"<t>p{i}\n<a>",
                response=f"r{i} é", finish_reason="stop", teacher="t")
    return Sample(**{**base, **kw})


def test_sample_schema_roundtrip(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    samples = [_sample(0), _sample(2, image="img/a.png", template="plain", finish_reason="length"),
               _sample(1, image="/abs/b.png")]
    for s in samples:
        append_sample(f, s)
    lines = f.read_text(encoding="utf-8").splitlines()
    assert list(json.loads(lines[0])) == ["id", "seed", "image", "template", "prompt", "prompt_text", "response",
                                          "finish_reason", "teacher"]
    got = read_samples(f)
    assert [s.id for s in got] == [0, 1, 2]
    assert got[2].image == str(tmp_path / "img/a.png")  # relative paths: against the JSONL's folder
    assert got[1].image == "/abs/b.png" and got[0] == samples[0]
    assert read_samples(f, resolve_images=False)[2] == samples[1]
    for bad in ({"template": "other"}, {"finish_reason": "eos"}, {"id": -1}, {"id": 1.0}, {"image": 3}):
        with pytest.raises(ValueError):
            _sample(0, **bad)
    d = json.loads(samples[0].to_json())
    with pytest.raises(ValueError, match="unexpected"):
        Sample.from_dict({**d, "extra": 1})
    with pytest.raises(ValueError, match="missing"):
        Sample.from_dict({k: v for k, v in d.items() if k != "teacher"})


def test_truncated_tail_and_corruption(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    with SampleWriter(f) as w:
        w.append(_sample(0))
        w.append(_sample(1))
    intact = f.read_bytes()
    with open(f, "ab") as fh:
        fh.write(_sample(2).to_json().encode()[:25])  # a killed writer
    assert [s.id for s in read_samples(f)] == [0, 1]
    assert [s.id for s in recover(f)] == [0, 1] and f.read_bytes() == intact
    f.write_bytes(intact + b"{not json}\n")  # a complete but broken last line is dropped too
    assert [s.id for s in recover(f)] == [0, 1] and f.read_bytes() == intact
    f.write_bytes(b"{broken\n" + intact)
    with pytest.raises(ValueError, match=":1: bad sample line"):
        read_samples(f)
    f.write_bytes(intact + intact)
    with pytest.raises(ValueError, match="occurs twice"):
        read_samples(f)
    assert recover(tmp_path / "new" / "x.jsonl") == [] and (tmp_path / "new" / "x.jsonl").exists()


# ------------------------------------------------------------------------------------------------
# generation loop and resume (deterministic fake teacher)


class FakeTeacher:
    """Deterministic: the response is a function of the job; raises after ``fail_after`` calls."""

    def __init__(self, fail_after: int | None = None, name: str = "fake") -> None:
        self.name = name
        self.renderer = PromptRenderer(text_only=False)
        self.calls: list[int] = []
        self.fail_after = fail_after

    def generate(self, job, cfg: GenConfig) -> tuple[str, FinishReason]:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise RuntimeError("teacher died")
        self.calls.append(job.id)
        return f"answer {job.gen_seed % 1000} {len(job.prompt_text)} {job.image.name if job.image else ''}", \
            ("stop" if job.gen_seed % 2 else "length")


def test_run_resumes_after_an_interruption(tmp_path: Path) -> None:
    images = list_images(None)
    ref, part = tmp_path / "ref.jsonl", tmp_path / "part.jsonl"
    assert run(FakeTeacher(), ref, range(20), images=images, progress=False) == 20
    with pytest.raises(RuntimeError, match="teacher died"):
        run(FakeTeacher(fail_after=7), part, range(20), images=images, progress=False)
    assert [s.id for s in read_samples(part)] == list(range(7))
    with open(part, "ab") as fh:  # plus a half-written line
        fh.write(b'{"id": 7, "seed": 69')
    t = FakeTeacher()
    assert run(t, part, range(20), images=images, progress=False) == 13
    assert t.calls == list(range(7, 20))
    assert part.read_bytes() == ref.read_bytes()
    assert run(FakeTeacher(), part, range(20), images=images, progress=False) == 0  # nothing left to do
    assert part.read_bytes() == ref.read_bytes()
    samples = read_samples(ref)
    assert [s.image for s in samples[:len(images) + 1]] == [str(p) for p in images] + [str(images[0])]
    assert all(s.image is not None and os.path.isabs(s.image) for s in samples)
    for s in samples:
        sp = P.sample_prompt(P.DEFAULT_SEED, s.id)
        assert (s.prompt, s.template, s.seed) == (sp.prompt, sp.template, P.DEFAULT_SEED)
        assert s.prompt_text == "<|begin_of_text|>" + (P.CHAT_TEMPLATE if s.template == "chat"
                                                       else P.PLAIN_TEMPLATE).format(prompt=s.prompt)
    # a shard with other indices appends; another seed or teacher refuses the file
    assert run(FakeTeacher(), part, range(20, 25), images=images, progress=False) == 5
    with pytest.raises(GenerateError, match="another run"):
        run(FakeTeacher(), part, range(30), seed=1, images=images, progress=False)
    with pytest.raises(GenerateError, match="another run"):
        run(FakeTeacher(name="other"), part, range(30), images=images, progress=False)


def test_default_images_are_real_colour_photos() -> None:
    from PIL import Image

    images = list_images(None)
    names = [p.name for p in images]
    assert len(images) >= 8 and {"astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg"} <= set(names)
    for p in images:
        with Image.open(p) as im:
            assert im.mode in ("RGB", "RGBA") and min(im.size) >= 256, p


# ------------------------------------------------------------------------------------------------
# endpoint backend (fake OpenAI-compatible server in a thread)


class FakeOpenAI(BaseHTTPRequestHandler):
    requests: list[tuple[str, dict]] = []
    delay = 0.0

    def log_message(self, *args) -> None:  # quiet
        pass

    def _send(self, obj: dict, status: int = 200) -> None:
        send_json(self, obj, status)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._send({"error": "not found"}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        time.sleep(type(self).delay)
        finish = "length" if body["seed"] % 3 == 0 else "stop"
        if self.path == "/v1/chat/completions":
            text = f"chat answer {body['seed']}"
            self._send({"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}]})
        elif self.path == "/v1/completions":
            self._send({"object": "text_completion",
                        "choices": [{"index": 0, "text": f"plain answer {body['seed']}", "finish_reason": finish}]})
        else:
            self._send({"error": "not found"}, 404)


@pytest.fixture()
def fake_server():
    FakeOpenAI.requests = []
    FakeOpenAI.delay = 0.0
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_endpoint_backend_request_shape(tmp_path: Path, fake_server: str) -> None:
    images = list_images(None)[:2]  # astronaut.png, chelsea.png
    teacher = EndpointTeacher(fake_server, text_only=False, renderer=PromptRenderer(text_only=False))
    assert teacher.model == "fake-model" and teacher.name == f"endpoint:{fake_server}#fake-model"
    out = tmp_path / "e.jsonl"
    n = 12
    assert run(teacher, out, range(n), images=images, workers=3, progress=False) == n
    samples = read_samples(out)
    assert [s.id for s in samples] == list(range(n))
    reqs = sorted(FakeOpenAI.requests, key=lambda r: r[1]["seed"])
    by_seed = {body["seed"]: (path, body) for path, body in reqs}
    assert len(by_seed) == n and {s.template for s in samples} == {"chat", "plain"}
    for s in samples:
        gseed = P.generation_seed(P.DEFAULT_SEED, s.id)
        path, body = by_seed[gseed]
        assert (body["temperature"], body["top_p"], body["max_tokens"], body["model"]) == (0.6, 0.9, 512, "fake-model")
        assert s.image is not None
        image_bytes = Path(s.image).read_bytes()
        assert Path(s.image) == images[s.id % 2]
        if s.template == "chat":
            assert path == "/v1/chat/completions"
            (msg,) = body["messages"]
            assert msg["role"] == "user"
            img_part, text_part = msg["content"]
            url = img_part["image_url"]["url"]
            assert img_part["type"] == "image_url" and url.startswith("data:image/png;base64,")
            assert base64.b64decode(url.split(",", 1)[1]) == image_bytes
            assert text_part == {"type": "text", "text": s.prompt}
            assert s.response == f"chat answer {gseed}"
        else:
            assert path == "/v1/completions"
            assert body["prompt"]["prompt_string"] == "<__media__>" + s.prompt  # BOS left to the server
            assert base64.b64decode(body["prompt"]["multimodal_data"][0]) == image_bytes
            assert s.response == f"plain answer {gseed}"
        assert s.finish_reason == ("length" if gseed % 3 == 0 else "stop")
    # overridden sampling settings, text-only requests
    FakeOpenAI.requests = []
    teacher = EndpointTeacher(fake_server, text_only=True, renderer=PromptRenderer(text_only=True), model="m")
    run(teacher, tmp_path / "t.jsonl", range(6), cfg=GenConfig(0.9, 0.5, 33), template="chat", progress=False)
    for path, body in FakeOpenAI.requests:
        assert path == "/v1/chat/completions" and (body["temperature"], body["top_p"], body["max_tokens"]) == (0.9, 0.5, 33)
        assert isinstance(body["messages"][0]["content"], str) and body["model"] == "m"
    for s in read_samples(tmp_path / "t.jsonl"):
        assert s.image is None and s.prompt_text == "<|begin_of_text|>" + P.CHAT_TEMPLATE_TEXT.format(prompt=s.prompt)


def _cli(args: list[str], **kw) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "qat.generate", *args, "--no-progress"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_cli_resumes_after_sigkill(tmp_path: Path, fake_server: str) -> None:
    FakeOpenAI.delay = 0.03
    args = ["--endpoint", fake_server, "--text-only", "-n", "60"]
    ref = tmp_path / "ref.jsonl"
    p = _cli(args + ["--out", str(ref)])
    assert p.wait(60) == 0, p.communicate()[1]
    out = tmp_path / "killed.jsonl"
    p = _cli(args + ["--out", str(out)])
    deadline = time.time() + 60
    while time.time() < deadline and (not out.exists() or out.read_bytes().count(b"\n") < 5):
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    n_done = len(read_samples(out))
    assert 5 <= n_done < 60
    with open(out, "ab") as fh:
        fh.write(b'{"id": 12, "seed": 693785, "ima')  # as if killed mid-line
    p = _cli(args + ["--out", str(out)])
    assert p.wait(60) == 0, p.communicate()[1]
    assert out.read_bytes() == ref.read_bytes()
    assert len(read_samples(out)) == 60


def test_cli_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "x.jsonl")
    assert main(["--model", str(tmp_path / "missing"), "-n", "1", "--out", out]) == 2
    assert "model directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no images here")
    assert main(["--endpoint", "http://127.0.0.1:1/v1", "--images", str(tmp_path / "empty"), "-n", "1",
                 "--out", out]) == 2
    assert "no images" in capsys.readouterr().err
    assert main(["--endpoint", "http://127.0.0.1:1/v1", "--text-only", "-n", "1", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot reach endpoint") and err.count("\n") == 1
    h = subprocess.run([sys.executable, "-m", "qat.generate", "--help"], cwd=REPO, capture_output=True, text=True)
    assert h.returncode == 0 and "--endpoint" in h.stdout and "--text-only" in h.stdout and "0.6" in h.stdout


# ------------------------------------------------------------------------------------------------
# transformers backend


@pytest.fixture(scope="module")
def _torch_one_thread():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_transformers_mllama_backend(tmp_path: Path, _torch_one_thread) -> None:
    from tests.mllama import tiny_model

    model_dir = tiny_model.get()
    images = [p for p in list_images(None) if p.name in ("astronaut.png", "chelsea.png", "rocket.jpg")]
    teacher = TransformersTeacher(model_dir, text_only=False, dtype="float32", device="cpu")
    cfg = GenConfig(max_new_tokens=6)
    ids = [0, 4, 5]  # chat, plain, plain with the default seed
    ref = tmp_path / "ref.jsonl"
    run(teacher, ref, ids, images=images, cfg=cfg, progress=False)
    samples = read_samples(ref)
    assert [s.template for s in samples] == ["chat", "plain", "plain"]
    tok = teacher.tokenizer
    for s in samples:
        assert s.image == str(images[s.id % 3]) and s.teacher == str(model_dir.resolve())
        if s.template == "chat":  # the processor's chat template (begins with BOS)
            assert s.prompt_text == "<|begin_of_text|>" + P.CHAT_TEMPLATE.format(prompt=s.prompt)
        else:  # the toy tokenizer adds no BOS by itself, so none is written
            assert s.prompt_text == P.PLAIN_TEMPLATE.format(prompt=s.prompt)
        prompt_ids = tok(s.prompt_text, add_special_tokens=False).input_ids
        assert prompt_ids.count(tiny_model.IMAGE_TOKEN_ID) == 1
        assert s.finish_reason in ("stop", "length")
        job = make_job(teacher, P.DEFAULT_SEED, s.id, images, "recipe")
        inputs = teacher._inputs(job)
        assert inputs["pixel_values"].shape[-2:] == (tiny_model.IMAGE_SIZE, tiny_model.IMAGE_SIZE)
    # deterministic: the first sample, then resume, gives the same file
    part = tmp_path / "part.jsonl"
    run(teacher, part, ids[:1], images=images, cfg=cfg, progress=False)
    run(teacher, part, ids, images=images, cfg=cfg, progress=False)
    assert part.read_bytes() == ref.read_bytes()
    # the image reaches the model: another image changes the next-token distribution
    import torch

    job = make_job(teacher, P.DEFAULT_SEED, 0, images, "recipe")
    with torch.inference_mode():
        a = teacher.model(**teacher._inputs(job)).logits[0, -1]
        b = teacher.model(**teacher._inputs(make_job(teacher, P.DEFAULT_SEED, 0, images[1:], "recipe"))).logits[0, -1]
    assert not torch.allclose(a, b)


def test_text_only_smollm2(tmp_path: Path, _torch_one_thread) -> None:
    from fixtures.assets import smollm2_hf_dir

    out = tmp_path / "s.jsonl"
    model_dir = smollm2_hf_dir()
    rc = main(["--model", str(model_dir), "--text-only", "--start", "3", "-n", "2", "--max-new-tokens", "16",
               "--dtype", "float32", "--out", str(out), "--no-progress"])
    assert rc == 0
    s3, s4 = read_samples(out)
    assert (s3.id, s3.template, s4.id, s4.template) == (3, "chat", 4, "plain")
    assert s3.image is None and s4.image is None
    assert s3.prompt_text.startswith("<|im_start|>system\n") and s3.prompt_text.endswith(
        "<|im_start|>user\n" + s3.prompt + "<|im_end|>\n<|im_start|>assistant\n")
    assert s4.prompt_text == s4.prompt  # SmolLM2's tokenizer adds no BOS
    for s in (s3, s4):
        assert s.response and "<|im_end|>" not in s.response
        assert s.finish_reason in ("stop", "length") and s.teacher == str(model_dir.resolve())

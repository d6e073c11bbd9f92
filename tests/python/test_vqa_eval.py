"""qat.eval: the four dataset readers on fixtures written in each published layout, the metrics against
hand-computed scores, the seeded subset, the OpenAI-compatible backend against an in-process fake server, and
the whole pipeline on the tiny random mllama (transformers) and through llama-server.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from qat.eval import scoring
from qat.eval.__main__ import main as cli
from qat.eval.backends import OpenAIBackend, chat_completions_url
from qat.eval.examples import DatasetError, Example
from qat.eval.readers import read_dataset
from qat.eval.runner import evaluate
from qat.eval.subset import subset_indices
from qat.eval.tasks import TASKS
from tests.http_stub import send_json

EOT = "<|eot_id|>"


# ---------------------------------------------------------------------------------------------------------------
# fixtures in the published layouts (real photos from scikit-image's bundled data)

def skimage_file(name: str) -> Path:
    spec = importlib.util.find_spec("skimage")
    assert spec is not None and spec.submodule_search_locations, "scikit-image is a dev dependency (ci/setup.sh)"
    return Path(spec.submodule_search_locations[0]) / "data" / name


def put(src: str, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(skimage_file(src), dst)
    return dst


def write_json(path: Path, obj) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))
    return path


VQA_QUESTIONS = [  # (question_id, image_id, question, ten answers)
    (42000, 42, "How many rockets?", ["one"] * 2 + ["1"] * 5 + ["2"] * 3),
    (42001, 42, "What color is the sky?", ["blue"] * 2 + ["dark blue"] * 4 + ["black"] * 4),
    (7000, 7, "Is this a cat?", ["yes"] * 10),
]


def make_vqav2(root: Path) -> Path:
    write_json(root / "v2_OpenEnded_mscoco_val2014_questions.json", {
        "info": {}, "task_type": "Open-Ended", "data_type": "mscoco", "data_subtype": "val2014", "license": {},
        "questions": [{"image_id": img, "question": q, "question_id": qid} for qid, img, q, _ in VQA_QUESTIONS]})
    write_json(root / "v2_mscoco_val2014_annotations.json", {
        "info": {}, "license": {}, "data_subtype": "val2014", "data_type": "mscoco",
        "annotations": [{"question_type": "what", "multiple_choice_answer": ans[0], "image_id": img,
                         "answer_type": "other", "question_id": qid,
                         "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": k + 1}
                                     for k, a in enumerate(ans)]}
                        for qid, img, _, ans in reversed(VQA_QUESTIONS)]})
    put("rocket.jpg", root / "val2014" / "COCO_val2014_000000000042.jpg")
    put("hubble_deep_field.jpg", root / "val2014" / "COCO_val2014_000000000007.jpg")
    return root


def make_chartqa(root: Path) -> Path:
    test = root / "ChartQA Dataset" / "test"
    write_json(test / "test_human.json", [
        {"imgname": "coins.png", "query": "What is the highest value?", "label": "100"},
        {"imgname": "coins.png", "query": "Which country is first?", "label": "Canada"},
    ])
    write_json(test / "test_augmented.json", [
        {"imgname": "camera.png", "query": "What share is red?", "label": ["45%"]},
    ])
    put("coins.png", test / "png" / "coins.png")
    put("camera.png", test / "png" / "camera.png")
    return root


def make_docvqa(root: Path) -> Path:
    write_json(root / "val" / "val_v1.0.json", {
        "dataset_name": "SP-DocVQA", "dataset_split": "val", "dataset_version": "1.0",
        "data": [
            {"questionId": 49153, "question": "What is the title?", "question_types": ["layout"],
             "image": "documents/pybv0228_81.png", "docId": 14465, "ucsf_document_id": "pybv0228",
             "ucsf_document_page_no": "81", "answers": ["abcd", "Total"], "data_split": "val"},
            {"questionId": 24580, "question": "What is the date?", "question_types": ["form"],
             "image": "documents/text.png", "docId": 1, "ucsf_document_id": "x", "ucsf_document_page_no": "1",
             "answers": ["1000", "1,000 dollars"], "data_split": "val"},
        ]})
    put("page.png", root / "val" / "documents" / "pybv0228_81.png")
    put("text.png", root / "val" / "documents" / "text.png")
    return root


def ai2d_question(qid: str, options: list[str], correct: int, abc: bool = False) -> dict:
    return {"abcLabel": abc, "answerTexts": options, "correctAnswer": correct, "questionId": qid}


def make_ai2d(root: Path, test_ids: list[str] | None = None) -> Path:
    base = root / "ai2d"
    write_json(base / "questions" / "10.png.json", {"imageName": "10.png", "questions": {
        "Which stage comes last?": ai2d_question("10.png-1", ["egg", "larva", "pupa", "adult"], 3),
        "Which stage comes first?": ai2d_question("10.png-0", ["egg", "larva", "pupa", "adult"], 0),
    }})
    write_json(base / "questions" / "2.png.json", {"imageName": "2.png", "questions": {
        "What is A in the diagram?": ai2d_question("2.png-0", ["ears", "nose", "mouth", "face"], 1, abc=True),
    }})
    put("astronaut.png", base / "images" / "2.png")
    put("chelsea.png", base / "images" / "10.png")
    if test_ids is not None:
        (base / "ai2d_test_ids.csv").write_text("".join(f"{i}\n" for i in test_ids))
    return root


MAKERS = {"vqav2": make_vqav2, "chartqa": make_chartqa, "docvqa": make_docvqa, "ai2d": make_ai2d}


class Canned:
    """A backend answering from a {question: answer} table (the question is found in the prompt)."""

    def __init__(self, table: dict[str, str]):
        self.table = table
        self.calls: list[tuple[Path, str, int]] = []

    def answer(self, image_path: Path, prompt: str, max_new_tokens: int) -> str:
        self.calls.append((image_path, prompt, max_new_tokens))
        assert image_path.is_file()
        return next(a for q, a in self.table.items() if q in prompt)


# ---------------------------------------------------------------------------------------------------------------
# metrics, hand-computed

@pytest.mark.parametrize("text, expected", [
    ("The  Two dogs, 1,000.5 cats!  An apple.", "2 dogs 1000.5 cats apple"),
    ("Yes.\n", "yes"),
    ("seventeen", "17"),
    ("someone ate none", "someone ate 0"),       # whole words only; "none" is in the authors' table
    ("it's (red)/blue-green", "it's red blue green"),
    ("theater", "theater"),                        # articles only as whole words
    ("3.5 m.", "3.5 m"),
    ("50%", "50%"),
    ("Yes" + EOT, "yes |eot id|"),
])
def test_vqa_normalisation(text, expected):
    assert scoring.normalise(text) == expected


@pytest.mark.parametrize("output, answers, expected", [
    ("Two", ["2", "2", "two", "3", "3", "3", "3", "4", "4", "4"], 1.0),            # 3 matches
    ("red", ["red", "red"] + ["blue"] * 8, 2 / 3),
    ("red", ["red"] + ["blue"] * 9, 1 / 3),
    ("the red car.", ["red", "red car", "car"] + ["blue"] * 7, 2 / 3),               # prefix match
    ("Yes" + EOT, ["yes"] * 10, 1.0),
    ("1,000", ["1000"] * 2 + ["1 000"] * 8, 2 / 3),
    ("", ["", "", "", "no"], 0.0),                                                 # empty answers never count
    ("no", ["yes"] * 10, 0.0),
])
def test_vqa_accuracy(output, answers, expected):
    assert scoring.vqa_accuracy(output, answers) == pytest.approx(expected)


@pytest.mark.parametrize("output, label, expected", [
    ("Step 1: read. FINAL ANSWER: 104.99", "100", 1.0),
    ("FINAL ANSWER: 95.01", "100", 1.0),
    ("FINAL ANSWER: 105", "100", 0.0),                  # bounds are strict: 1.05 * 100 == 105.0
    ("FINAL ANSWER: 95", "100", 0.0),
    ("**FINAL ANSWER:** 45%", "45", 1.0),               # numeric label: the number is read off "45%"
    ("FINAL ANSWER: 45%", "45%", 1.0),                  # "45%" is not a float: exact normalised text
    ("FINAL ANSWER: 45", "45%", 0.0),
    ("FINAL ANSWER: 0", "0", 0.0),                      # a zero label can never match
    ("FINAL ANSWER: -5", "-5", 0.0),                    # nor a negative one
    ("FINAL ANSWER: twelve", "12", 1.0),                # number words
    ("FINAL ANSWER: 2019 saw 20", "20", 0.0),           # the first number counts
    ("The value is 100.", "100", 0.0),                  # no "answer:" -> empty answer
    ("final answer: Yes." + EOT, "Yes", 1.0),
    ("FINAL ANSWER: the Canada", "Canada", 1.0),
    ("FINAL ANSWER: Canada and Mexico", "Canada", 0.0),
])
def test_chartqa_accuracy(output, label, expected):
    assert scoring.chartqa_accuracy(output, label) == expected


@pytest.mark.parametrize("output, answers, expected", [
    ("Hello", ["hello"], 1.0),
    ("abcx", ["abcd"], 0.75),                          # distance 1/4
    ("abcxy", ["abcde"], 0.6),                         # 2/5
    ("abxy", ["abcd"], 0.0),                           # 2/4 = 0.5 reaches the threshold
    ("1,000", ["1000", "1,000 dollars"], 0.8),         # 1/5 vs 8/13 (>= 0.5 -> 0): the best answer counts
    ("Yes" + EOT, ["yes"], 1.0),
    (" Total " + EOT, ["total"], 1 - 1 / 6),           # strip before removing <|eot_id|> leaves "total "
    ("", [""], 1.0),
    ("", ["abc"], 0.0),
])
def test_anls(output, answers, expected):
    assert scoring.anls(output, answers) == pytest.approx(expected)


def test_levenshtein():
    assert scoring.levenshtein("kitten", "sitting") == 3
    assert scoring.levenshtein("", "abc") == 3
    assert scoring.levenshtein("flaw", "lawn") == 2


@pytest.mark.parametrize("output, label, expected", [
    ("Stage 2 follows. FINAL ANSWER: 2) larva", 1, 1.0),
    ("FINAL ANSWER: 2) larva", "1", 1.0),              # lmms-lab labels are strings
    ("FINAL ANSWER: 2", 1, 0.0),                       # a bare number has no ")"
    ("FINAL ANSWER: B) larva", 1, 0.0),                # a letter is not an option number
    ("The correct option is: **2)**", 1, 1.0),
    ("Answer: 3) pupa, not 2)", 1, 0.0),               # the first option number counts
    ("I pick 2) larva", 1, 0.0),                       # no answer/option marker
    ("FINAL ANSWER: 4) adult" + EOT, 3, 1.0),
])
def test_ai2d_accuracy(output, label, expected):
    assert scoring.ai2d_accuracy(output, label) == expected


# ---------------------------------------------------------------------------------------------------------------
# prompts and subsets

def test_task_settings_follow_the_recipe():
    assert {k: (t.max_new_tokens, t.seed, t.metric) for k, t in TASKS.items()} == {
        "vqav2": (25, 625464, "accuracy"), "chartqa": (512, 77524, "accuracy"),
        "docvqa": (512, 37374, "anls"), "ai2d": (400, 85393, "accuracy")}
    ex = Example("1", Path("x.png"), "Which stage comes first?", ("0",), ("egg", "larva"))
    prompt = TASKS["ai2d"].prompt(ex)
    assert "question: Which stage comes first?\n " in prompt
    assert prompt.endswith('"FINAL ANSWER". Options:\n1) egg\n2) larva\nLet\'s think step by step.')
    assert TASKS["vqav2"].prompt(ex).endswith("Question: Which stage comes first?")
    assert TASKS["chartqa"].prompt(ex).endswith("Which stage comes first?<cot_start>Let's think step by step.")


def test_subset_is_a_pure_function_of_seed_and_size():
    assert subset_indices(10, 4, 0) == [4, 6, 2, 7]        # numpy default_rng(0).permutation(10)[:4]
    assert subset_indices(5, 1024, 625464) == [2, 3, 0, 1, 4]
    big = subset_indices(100_000, 1024, 77524)
    assert big == subset_indices(100_000, 1024, 77524)
    assert len(set(big)) == 1024 and max(big) < 100_000
    assert subset_indices(100_000, 10, 77524) == big[:10]
    assert big != subset_indices(100_000, 1024, 77525)
    assert subset_indices(0, 1024, 1) == []


# ---------------------------------------------------------------------------------------------------------------
# readers

def test_vqav2_reader(tmp_path):
    exs = read_dataset("vqav2", make_vqav2(tmp_path))
    assert [e.id for e in exs] == ["42000", "42001", "7000"]           # the questions file's order
    assert exs[0].image == tmp_path / "val2014" / "COCO_val2014_000000000042.jpg"
    assert exs[2].image.name == "COCO_val2014_000000000007.jpg"
    assert exs[1].answers == tuple(VQA_QUESTIONS[1][3]) and len(exs[1].answers) == 10
    assert exs[1].question == "What color is the sky?"


def test_chartqa_reader_and_layouts(tmp_path):
    make_chartqa(tmp_path)
    exs = read_dataset("chartqa", tmp_path)
    assert [e.id for e in exs] == ["test_human/0", "test_human/1", "test_augmented/0"]
    assert [e.answers for e in exs] == [("100",), ("Canada",), ("45%",)]
    assert exs[2].image == tmp_path / "ChartQA Dataset" / "test" / "png" / "camera.png"
    for root in (tmp_path / "ChartQA Dataset", tmp_path / "ChartQA Dataset" / "test"):
        assert read_dataset("chartqa", root) == exs


def test_docvqa_reader(tmp_path):
    exs = read_dataset("docvqa", make_docvqa(tmp_path))
    assert [e.id for e in exs] == ["49153", "24580"]
    assert exs[0].image == tmp_path / "val" / "documents" / "pybv0228_81.png"
    assert exs[1].answers == ("1000", "1,000 dollars")
    assert read_dataset("docvqa", tmp_path / "val") == exs


def test_ai2d_reader_order_and_test_ids(tmp_path):
    make_ai2d(tmp_path)
    exs = read_dataset("ai2d", tmp_path)
    assert [e.id for e in exs] == ["2.png-0", "10.png-0", "10.png-1"]  # images by number, then question number
    assert exs[1].question == "Which stage comes first?" and exs[1].answers == ("0",)
    assert exs[2].options == ("egg", "larva", "pupa", "adult") and exs[2].answers == ("3",)
    assert exs[0].image == tmp_path / "ai2d" / "images" / "2.png"
    assert read_dataset("ai2d", tmp_path / "ai2d") == exs
    (tmp_path / "ai2d" / "ai2d_test_ids.csv").write_text("10\n")
    assert [e.id for e in read_dataset("ai2d", tmp_path)] == ["10.png-0", "10.png-1"]


def test_missing_and_malformed_files_are_named(tmp_path):
    make_vqav2(tmp_path / "v")
    (tmp_path / "v" / "v2_mscoco_val2014_annotations.json").unlink()
    with pytest.raises(DatasetError, match="v2_mscoco_val2014_annotations.json: file not found"):
        read_dataset("vqav2", tmp_path / "v")

    make_chartqa(tmp_path / "c")
    (tmp_path / "c" / "ChartQA Dataset" / "test" / "test_augmented.json").write_text("[{")
    with pytest.raises(DatasetError, match="test_augmented.json: not valid JSON"):
        read_dataset("chartqa", tmp_path / "c")
    with pytest.raises(DatasetError, match="no ChartQA test split"):
        read_dataset("chartqa", tmp_path / "v")

    make_docvqa(tmp_path / "d")
    path = tmp_path / "d" / "val" / "val_v1.0.json"
    doc = json.loads(path.read_text())
    del doc["data"][1]["answers"]
    write_json(path, doc)
    with pytest.raises(DatasetError, match=r"val_v1.0.json: data\[1\] has no 'answers'"):
        read_dataset("docvqa", tmp_path / "d")

    make_ai2d(tmp_path / "a")
    write_json(tmp_path / "a" / "ai2d" / "questions" / "2.png.json", {"imageName": "2.png", "questions": {
        "Q?": ai2d_question("2.png-0", ["x", "y"], 2)}})
    with pytest.raises(DatasetError, match="2.png.json: question 'Q\\?': correctAnswer 2"):
        read_dataset("ai2d", tmp_path / "a")
    write_json(tmp_path / "a" / "ai2d" / "questions" / "2.png.json", {"imageName": "2.png"})
    with pytest.raises(DatasetError, match="2.png.json: the top-level object has no 'questions' field"):
        read_dataset("ai2d", tmp_path / "a")

    with pytest.raises(DatasetError, match="not a folder"):
        read_dataset("docvqa", tmp_path / "nowhere")


def test_missing_image_is_named_before_any_answer(tmp_path):
    make_vqav2(tmp_path)
    (tmp_path / "val2014" / "COCO_val2014_000000000007.jpg").unlink()
    backend = Canned({"": "yes"})
    with pytest.raises(DatasetError, match="COCO_val2014_000000000007.jpg: image of example 7000 not found"):
        evaluate(TASKS["vqav2"], read_dataset("vqav2", tmp_path), backend, progress=False)
    assert backend.calls == []


# ---------------------------------------------------------------------------------------------------------------
# whole tasks with canned answers: reader + prompt + scorer + mean

CANNED = {
    "vqav2": ({"How many rockets?": "One" + EOT,          # "1": 7 matches -> 1
               "What color is the sky?": "Dark blue.",    # "dark blue" 4 -> 1 ("blue" is no prefix)
               "Is this a cat?": "No"}, 2 / 3),           # 0
    "chartqa": ({"highest value": "It is 103. FINAL ANSWER: 103",   # 1
                 "first?": "FINAL ANSWER: USA",                       # 0
                 "share is red": "FINAL ANSWER: 45%"}, 2 / 3),        # 1
    "docvqa": ({"title": "abcx", "date": "1,000"}, (0.75 + 0.8) / 2),
    "ai2d": ({"What is A": "FINAL ANSWER: 2) nose",                   # 1
              "comes first": "FINAL ANSWER: 1",                       # 0 (no parenthesis)
              "comes last": "answer is: 4) adult"}, 2 / 3),           # 1
}


@pytest.mark.parametrize("task", sorted(CANNED))
def test_task_scores_on_fixtures(tmp_path, task):
    table, expected = CANNED[task]
    exs = read_dataset(task, MAKERS[task](tmp_path))
    backend = Canned(table)
    res = evaluate(TASKS[task], exs, backend, n=1024, progress=False)
    assert res["score"] == pytest.approx(expected)
    assert res["n"] == len(exs) and res["seed"] == TASKS[task].seed and res["metric"] == TASKS[task].metric
    assert [r["index"] for r in res["examples"]] == subset_indices(len(exs), 1024, TASKS[task].seed)
    assert {c[2] for c in backend.calls} == {TASKS[task].max_new_tokens}
    assert sorted(r["id"] for r in res["examples"]) == sorted(e.id for e in exs)


# ---------------------------------------------------------------------------------------------------------------
# OpenAI-compatible backend against an in-process fake server

class FakeOpenAI:
    def __init__(self, reply: str = "FINAL ANSWER: 45%", status: int = 200):
        self.requests: list[tuple[str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                if status == 200:
                    payload = {"object": "chat.completion", "choices": [
                        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply}}]}
                else:
                    payload = {"error": {"message": "boom"}}
                send_json(self, payload, status)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_chat_completions_url():
    assert chat_completions_url("http://h:1") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    assert chat_completions_url("http://h:1/v1/chat/completions") == "http://h:1/v1/chat/completions"


def test_endpoint_backend_request_shape_and_cli(tmp_path):
    make_chartqa(tmp_path / "data")
    out = tmp_path / "res" / "chartqa.json"
    with FakeOpenAI() as srv:
        assert cli(["--task", "chartqa", "--data", str(tmp_path / "data"), "--endpoint", srv.url, "--n", "2",
                    "--seed", "3", "--out", str(out), "--no-progress"]) == 0
    exs = read_dataset("chartqa", tmp_path / "data")
    chosen = subset_indices(3, 2, 3)
    assert len(srv.requests) == 2
    for (path, body), i in zip(srv.requests, chosen):
        assert path == "/v1/chat/completions"
        assert body["max_tokens"] == 512 and body["temperature"] == 0.0 and body["stream"] is False
        (msg,) = body["messages"]
        assert msg["role"] == "user"
        image, text = msg["content"]
        assert image["type"] == "image_url" and text["type"] == "text"
        assert text["text"] == TASKS["chartqa"].prompt(exs[i])
        url = image["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        assert base64.b64decode(url.split(",", 1)[1]) == exs[i].image.read_bytes()
    res = json.loads(out.read_text())
    assert [r["index"] for r in res["examples"]] == chosen
    # "45%" matches only the augmented example's text label
    assert res["score"] == pytest.approx(sum(exs[i].answers == ("45%",) for i in chosen) / 2)
    assert all(r["prediction"] == "FINAL ANSWER: 45%" for r in res["examples"])
    assert [p.name for p in out.parent.iterdir()] == ["chartqa.json"]          # no temporary file left


def test_endpoint_backend_errors_name_the_server(tmp_path):
    img = put("coins.png", tmp_path / "coins.png")
    with FakeOpenAI(status=500) as srv:
        with pytest.raises(RuntimeError, match="HTTP 500.*boom"):
            OpenAIBackend(srv.url).answer(img, "q", 5)


def test_cli_reports_dataset_errors(tmp_path, capsys):
    assert cli(["--task", "docvqa", "--data", str(tmp_path), "--endpoint", "http://127.0.0.1:9",
                "--out", str(tmp_path / "r.json")]) == 2
    assert "val_v1.0.json" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


# ---------------------------------------------------------------------------------------------------------------
# end to end on the tiny random mllama: transformers, and llama-server (the server test's module fixture)

from test_mllama_server import server  # noqa: E402,F401  (the running llama-server fixture)


@pytest.fixture(scope="module")
def tiny_checkpoint() -> Path:
    from tests.mllama import tiny_model

    return tiny_model.get()


def test_transformers_backend_end_to_end(tmp_path, tiny_checkpoint):
    make_vqav2(tmp_path / "data")
    out = tmp_path / "vqav2.json"
    assert cli(["--task", "vqav2", "--data", str(tmp_path / "data"), "--model", str(tiny_checkpoint),
                "--n", "2", "--out", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    assert res["n"] == 2 and res["backend"] == f"transformers:{tiny_checkpoint}"
    assert [r["index"] for r in res["examples"]] == subset_indices(3, 2, 625464)
    for r in res["examples"]:
        assert isinstance(r["prediction"], str) and r["prediction"]
        assert r["score"] == scoring.vqa_accuracy(r["prediction"], r["answers"])
    assert res["score"] == pytest.approx(sum(r["score"] for r in res["examples"]) / 2)


def test_model_without_generate_decodes_the_same(tmp_path, tiny_checkpoint):
    """A plain module (as a fake-quantised student may be) is decoded greedily by full forward passes."""
    import torch

    from qat.eval.backends import TransformersBackend

    hf = TransformersBackend.from_pretrained(tiny_checkpoint)

    class Plain(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            return self.inner(**kw)

    plain = TransformersBackend(Plain(hf.model), hf.processor)
    img = put("coffee.png", tmp_path / "coffee.png")
    assert plain.answer(img, "What is this?", 4) == hf.answer(img, "What is this?", 4)


def test_transformers_backend_taps_the_vision_encoder_as_meta(tmp_path, tiny_checkpoint):
    """The intermediate-layer taps are each layer's *input* (Meta, llama.cpp; docs/mllama.md 3.4), not its output
    as transformers 5 records them: in the encoder's output, tap i is what vision layer i received."""
    from qat.eval.backends import TransformersBackend

    hf = TransformersBackend.from_pretrained(tiny_checkpoint)
    encoder = hf.model.model.vision_model.transformer
    seen: dict[str, Any] = {}

    def layer_input(_m, args, kwargs) -> None:
        seen["input"] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def encoder_output(_m, _args, out) -> None:
        seen["taps"] = out.hidden_states

    encoder.layers[1].register_forward_pre_hook(layer_input, with_kwargs=True)
    encoder.register_forward_hook(encoder_output)
    hf.answer(put("coffee.png", tmp_path / "coffee.png"), "What is this?", 1)
    assert seen["taps"][1].equal(seen["input"])


def test_llama_server_end_to_end(tmp_path, server):
    """One VQAv2 question through llama-server (tiny model, f16, --mmproj); the answer is whatever it is."""
    out = tmp_path / "vqav2.json"
    assert cli(["--task", "vqav2", "--data", str(make_vqav2(tmp_path / "data")), "--endpoint", server,
                "--n", "1", "--out", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    (row,) = res["examples"]
    assert res["n"] == 1 and res["backend"] == f"openai:{server}/v1/chat/completions"
    assert isinstance(row["prediction"], str) and row["prediction"]
    assert res["score"] == row["score"] == scoring.vqa_accuracy(row["prediction"], row["answers"])

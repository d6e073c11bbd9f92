"""Readers for the four datasets in their published local file layouts.

Every reader takes the folder the user downloaded (``--data``) and returns the examples in a fixed, documented
order; the seeded subset (:mod:`qat.eval.subset`) indexes into that order. The authors loaded the Hugging Face
copies (``lmms-lab/VQAv2`` validation, ``HuggingFaceM4/ChartQA`` test, ``lmms-lab/DocVQA`` validation,
``lmms-lab/ai2d`` test) and shuffled them; the orders below are those of the original files, which is how the
Hugging Face copies were built as far as their row counts show, but they are not checked against them.

VQAv2 (https://visualqa.org/download.html), ``--data`` holds::

    v2_OpenEnded_mscoco_val2014_questions.json   {"questions": [{"image_id", "question", "question_id"}, ...]}
    v2_mscoco_val2014_annotations.json           {"annotations": [{"question_id", "answers": [{"answer"}, ...]}]}
    val2014/COCO_val2014_%012d.jpg
  Order: the questions file. Every question needs an annotation (matched by ``question_id``).

ChartQA (the GitHub release, folder ``ChartQA Dataset``), ``--data`` is that folder, its parent, or its ``test``::

    test/test_human.json, test/test_augmented.json    [{"imgname": "x.png", "query": ..., "label": ...}, ...]
    test/png/x.png
  Order: ``test_human.json`` then ``test_augmented.json`` (1250 + 1250 = the 2500 rows of the HF test split).
  A list-valued label (HF export style) contributes its first element, as the authors did.

DocVQA (the RRC release, task 1 "Single Document VQA"), ``--data`` holds ``val_v1.0.json`` (or ``val/val_v1.0.json``)::

    {"data": [{"questionId", "question", "image": "documents/x.png", "answers": [...]}, ...]}
  ``image`` is relative to the JSON's folder. Order: the ``data`` list. Only splits with answers can be scored,
  so the test JSON is rejected with a message.

AI2D (``ai2d-all.zip``), ``--data`` is the ``ai2d`` folder or its parent::

    questions/<n>.png.json   {"imageName": "<n>.png", "questions": {text: {"answerTexts": [...],
                                                                     "correctAnswer": i, "abcLabel": b,
                                                                     "questionId": "<n>.png-<k>"}}}
    images/<n>.png
    ai2d_test_ids.csv        optional: one image id (``<n>``) per line; when present only those images are read
  (the file may also sit next to the ``ai2d`` folder). Order: images by number, then questions by ``<k>``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

from qat.eval.examples import DatasetError, Example


def load_json(path: Path) -> Any:
    """Parse a JSON file; a missing or unparsable file raises :class:`DatasetError` naming it."""
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: not valid JSON ({e})") from e


def field(record: Any, key: str, path: Path, where: str) -> Any:
    """``record[key]``, or a :class:`DatasetError` naming the file and the record."""
    if not isinstance(record, dict) or key not in record:
        raise DatasetError(f"{path}: {where} has no {key!r} field")
    return record[key]


def _list_field(record: Any, key: str, path: Path, where: str) -> list:
    value = field(record, key, path, where)
    if not isinstance(value, list):
        raise DatasetError(f"{path}: {where}: {key!r} is not a list")
    return value


def read_vqav2(root: Path) -> list[Example]:
    qpath = root / "v2_OpenEnded_mscoco_val2014_questions.json"
    apath = root / "v2_mscoco_val2014_annotations.json"
    questions = _list_field(load_json(qpath), "questions", qpath, "the top-level object")
    answers: dict[Any, tuple[str, ...]] = {}
    for i, ann in enumerate(_list_field(load_json(apath), "annotations", apath, "the top-level object")):
        where = f"annotation {i}"
        answers[field(ann, "question_id", apath, where)] = tuple(
            str(field(a, "answer", apath, where)) for a in _list_field(ann, "answers", apath, where))
    out = []
    for i, q in enumerate(questions):
        where = f"question {i}"
        qid = field(q, "question_id", qpath, where)
        if qid not in answers:
            raise DatasetError(f"{apath}: no annotation for question_id {qid} (from {qpath})")
        image = root / "val2014" / f"COCO_val2014_{int(field(q, 'image_id', qpath, where)):012d}.jpg"
        out.append(Example(str(qid), image, str(field(q, "question", qpath, where)), answers[qid]))
    return out


def _chartqa_test_dir(root: Path) -> Path:
    for cand in (root / "ChartQA Dataset" / "test", root / "test", root):
        if (cand / "test_human.json").is_file():
            return cand
    raise DatasetError(f"{root}: no ChartQA test split found (looked for 'ChartQA Dataset/test/test_human.json', "
                       f"'test/test_human.json' and 'test_human.json')")


def read_chartqa(root: Path) -> list[Example]:
    test = _chartqa_test_dir(root)
    out = []
    for part in ("test_human", "test_augmented"):
        path = test / f"{part}.json"
        records = load_json(path)
        if not isinstance(records, list):
            raise DatasetError(f"{path}: expected a JSON list of {{imgname, query, label}} records")
        for i, r in enumerate(records):
            where = f"record {i}"
            label = field(r, "label", path, where)
            if isinstance(label, list):
                if not label:
                    raise DatasetError(f"{path}: {where}: empty label list")
                label = label[0]
            out.append(Example(f"{part}/{i}", test / "png" / str(field(r, "imgname", path, where)),
                               str(field(r, "query", path, where)), (str(label),)))
    return out


def read_docvqa(root: Path) -> list[Example]:
    cands = [root / "val_v1.0.json", root / "val" / "val_v1.0.json"]
    path = next((p for p in cands if p.is_file()), None)
    if path is None:
        raise DatasetError(f"{root}: no DocVQA validation file (looked for {', '.join(str(p) for p in cands)})")
    records = _list_field(load_json(path), "data", path, "the top-level object")
    out = []
    for i, r in enumerate(records):
        where = f"data[{i}]"
        if "answers" not in r:
            raise DatasetError(f"{path}: {where} has no 'answers' (a test split cannot be scored)")
        answers = _list_field(r, "answers", path, where)
        if not answers:
            raise DatasetError(f"{path}: {where}: empty 'answers'")
        out.append(Example(str(field(r, "questionId", path, where)), path.parent / str(field(r, "image", path, where)),
                           str(field(r, "question", path, where)), tuple(str(a) for a in answers)))
    return out


def _number(name: str) -> int:
    m = re.match(r"\d+", name)
    return int(m.group()) if m else -1


def read_ai2d(root: Path) -> list[Example]:
    base = root / "ai2d" if (root / "ai2d" / "questions").is_dir() else root
    qdir = base / "questions"
    if not qdir.is_dir():
        raise DatasetError(f"{root}: no AI2D 'questions' folder (looked in {root / 'ai2d'} and {root})")
    keep: set[str] | None = None
    for ids in (base / "ai2d_test_ids.csv", base.parent / "ai2d_test_ids.csv"):
        if ids.is_file():
            keep = {line.strip() for line in ids.read_text().splitlines() if line.strip()}
            break
    files = sorted(qdir.glob("*.json"), key=lambda p: (_number(p.name), p.name))
    if not files:
        raise DatasetError(f"{qdir}: no question files")
    out = []
    for path in files:
        doc = load_json(path)
        image_name = str(field(doc, "imageName", path, "the top-level object"))
        if keep is not None and image_name.split(".")[0] not in keep:
            continue
        questions = field(doc, "questions", path, "the top-level object")
        if not isinstance(questions, dict):
            raise DatasetError(f"{path}: 'questions' is not an object")
        rows = []
        for text, q in questions.items():
            where = f"question {text!r}"
            options = tuple(str(o) for o in _list_field(q, "answerTexts", path, where))
            correct = field(q, "correctAnswer", path, where)
            if not isinstance(correct, int) or not 0 <= correct < len(options):
                raise DatasetError(f"{path}: {where}: correctAnswer {correct!r} is not an index into answerTexts")
            qid = str(field(q, "questionId", path, where))
            rows.append((_number(qid.rsplit("-", 1)[-1]), Example(qid, base / "images" / image_name, text,
                                                                  (str(correct),), options)))
        out += [ex for _, ex in sorted(rows, key=lambda r: r[0])]
    return out


READERS: dict[str, Callable[[Path], list[Example]]] = {
    "vqav2": read_vqav2, "chartqa": read_chartqa, "docvqa": read_docvqa, "ai2d": read_ai2d}


def read_dataset(task: str, root: Path | str) -> list[Example]:
    """All examples of ``task`` under ``root``, in the reader's documented order."""
    root = Path(root)
    if task not in READERS:
        raise ValueError(f"unknown task {task!r}; one of {', '.join(READERS)}")
    if not root.is_dir():
        raise DatasetError(f"{root}: not a folder")
    return READERS[task](root)

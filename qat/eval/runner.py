"""Run one task on one backend and write the result JSON.

The result is ``{"task", "metric", "score", "n", "seed", "dataset_size", "max_new_tokens", "backend",
"examples": [{"index", "id", "image", "question", "answers", "options", "prediction", "score"}]}`` where
``score`` is the plain mean over the examples and ``index`` is the row in the reader's order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gguf_s3d8.fsio import atomic_file
from qat.eval.backends import Backend
from qat.eval.examples import DatasetError, Example
from qat.eval.subset import subset_indices
from qat.eval.tasks import Task


def evaluate(task: Task, examples: list[Example], backend: Backend, n: int = 1024, seed: int | None = None,
             progress: bool = True, backend_name: str = "") -> dict[str, Any]:
    """Answer and score the seeded subset of ``examples`` (``seed`` defaults to the task's)."""
    from tqdm import tqdm

    seed = task.seed if seed is None else seed
    chosen = subset_indices(len(examples), n, seed)
    for i in chosen:
        if not examples[i].image.is_file():
            raise DatasetError(f"{examples[i].image}: image of example {examples[i].id} not found")
    rows = []
    total = 0.0
    bar = tqdm(chosen, desc=task.name, disable=not progress)
    for i in bar:
        ex = examples[i]
        prediction = backend.answer(ex.image, task.prompt(ex), task.max_new_tokens)
        score = task.score(prediction, ex)
        total += score
        rows.append({"index": i, "id": ex.id, "image": str(ex.image), "question": ex.question,
                     "answers": list(ex.answers), "options": list(ex.options), "prediction": prediction,
                     "score": score})
        bar.set_postfix({task.metric: f"{total / len(rows):.3f}"})
    return {"task": task.name, "metric": task.metric, "score": total / len(rows) if rows else 0.0,
            "n": len(rows), "seed": seed, "dataset_size": len(examples), "max_new_tokens": task.max_new_tokens,
            "backend": backend_name, "examples": rows}


def write_results(results: dict[str, Any], path: Path | str) -> None:
    """Write ``results`` as JSON atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, ensure_ascii=False)
        f.write("\n")

"""Command line: ``python -m qat.eval --task TASK --data DIR (--model HF_DIR | --student CHECKPOINT | --endpoint URL) [...]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qat.eval.backends import Backend
from qat.eval.examples import DatasetError
from qat.eval.readers import read_dataset
from qat.eval.runner import evaluate, write_results
from qat.eval.tasks import TASKS


def build_parser() -> argparse.ArgumentParser:
    seeds = ", ".join(f"{t.name} {t.seed}" for t in TASKS.values())
    p = argparse.ArgumentParser(
        prog="python -m qat.eval",
        description="Evaluate a Llama 3.2 Vision model on VQAv2, ChartQA, DocVQA or AI2D as the paper's authors did: "
                    "a fixed seeded subset, the task's prompt, greedy decoding, the task's metric. "
                    "Dataset layouts: docs/evaluation.md.")
    p.add_argument("--task", required=True, choices=sorted(TASKS), help="the benchmark")
    p.add_argument("--data", required=True, type=Path, help="the dataset folder in its published layout")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a transformers MllamaForConditionalGeneration checkpoint folder")
    src.add_argument("--student", type=Path, metavar="CHECKPOINT",
                     help="a qat.train checkpoint.pt of Llama 3.2 Vision: its fake-quantised student (what the "
                          "exported GGUF computes), processor from the checkpoint's teacher")
    src.add_argument("--endpoint", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8080 (llama-server "
                                        "started with --mmproj)")
    p.add_argument("--n", type=int, default=1024, help="subset size (default 1024; all rows if the dataset is smaller)")
    p.add_argument("--seed", type=int, default=None, help=f"subset seed (default: the authors' per task: {seeds})")
    p.add_argument("--out", type=Path, default=Path("results.json"), help="result JSON (written atomically)")
    p.add_argument("--teacher", type=Path, default=None,
                   help="--student: the teacher checkpoint folder if it moved since training")
    p.add_argument("--dtype", default="auto", help="--model weights dtype: auto, float32, bfloat16, float16")
    p.add_argument("--device", default="cpu", help="--model / --student device (cpu, cuda, ...)")
    p.add_argument("--server-model", default=None, help="'model' field sent to --endpoint (llama-server ignores it)")
    p.add_argument("--api-key", default=None, help="bearer token for --endpoint")
    p.add_argument("--timeout", type=float, default=600.0, help="--endpoint request timeout in seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    task = TASKS[args.task]
    try:
        examples = read_dataset(args.task, args.data)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    backend: Backend
    if args.model is not None:
        from qat.eval.backends import TransformersBackend

        backend = TransformersBackend.from_pretrained(args.model, dtype=args.dtype, device=args.device)
        name = f"transformers:{args.model}"
    elif args.student is not None:
        from qat.eval.backends import TransformersBackend
        from qat.errors import TrainError

        try:
            backend = TransformersBackend.from_qat_checkpoint(args.student, args.teacher, device=args.device)
        except TrainError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        name = f"qat-student:{args.student}"
    else:
        from qat.eval.backends import OpenAIBackend

        openai = OpenAIBackend(args.endpoint, model=args.server_model, api_key=args.api_key, timeout=args.timeout)
        backend = openai
        name = f"openai:{openai.url}"
    try:
        results = evaluate(task, examples, backend, n=args.n, seed=args.seed, progress=not args.no_progress,
                           backend_name=name)
    except DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_results(results, args.out)
    print(f"{task.name} {task.metric} = {results['score']:.4f} over {results['n']} examples -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

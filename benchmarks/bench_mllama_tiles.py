#!/usr/bin/env python3
"""The tile cap of Llama 3.2 Vision (``--image-max-tiles N``, N = 1..4): encode time and answer per cap on
scikit-image's photos; written into the "mllama-tiles" section of docs/benchmarks.md.

* **Encode time**: ``llama-mtmd-cli --image-max-tiles N`` on the model of ``bench_mllama.py`` (a random Llama 3.2
  Vision with the real vision encoder, 560 px tiles of 1601 positions, 32 + 8 layers of 1280 / 5120, S3D8
  projector; here with two text layers of the 11B shapes, one of them cross-attention, Q8_0: a model of one
  cross-attention layer alone does not load), its own timing ("image slice encoded in N ms"), one run per photo
  and cap, the load average before and after each run recorded. The encoder works on N tile
  slots whatever the photo (the missing tiles are computed too), so the time depends on the cap, not the photo.
* **Answer**: there is no real Llama 3.2 Vision checkpoint here, so the answer is the tiny random model's of the
  parity tests (``fixtures/tiny_model.py``, 28 px tiles, f32): per cap, the greedy tokens of llama.cpp
  (``llama-mllama-dump``) and whether they are transformers' at that cap, the relative error of llama.cpp's
  logits against transformers' at that cap (``fixtures/reference.py``) and against llama.cpp's own logits at
  cap 4 (how far a cap moves the answer; for a random model, not a quality measure).

The canvases (tile grids) are MllamaImageProcessor's with ``max_image_tiles=N`` at each tile size. Not a test;
run by hand after ``bash ci/build.sh host``:

    .venv/bin/python benchmarks/bench_mllama_tiles.py --prepare-only   # the checkpoint and GGUFs (~1.3 GB)
    .venv/bin/python benchmarks/bench_mllama_tiles.py                  # the timings (cached files are reused)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench_common import (  # type: ignore[import-not-found]
    ROOT, cpu_name, data_file, keep_raw_results, run, shown, tool,
)
from bench_mllama import TOKENIZER, checkpoint  # type: ignore[import-not-found]
from report_sections import write_section  # type: ignore[import-not-found]

RAW_NAME = "benchmarks-mllama-tiles.json"
CAPS = (1, 2, 3, 4)
PHOTOS = ("astronaut", "chelsea", "hubble_deep_field")
ENCODE = re.compile(r"image slice encoded in (\d+) ms")
N_STEPS = 8  # greedy decode steps of the answers


def photo(work: Path, name: str) -> Path:
    path = work / f"{name}.png"
    if not path.exists():
        import skimage.data
        from PIL import Image

        Image.fromarray(getattr(skimage.data, name)()).convert("RGB").save(path)
    return path


def grid(path: Path, tile: int, cap: int) -> list[int]:
    """(tiles high, tiles wide) of MllamaImageProcessor's canvas with max_image_tiles=cap."""
    from PIL import Image
    from transformers.models.mllama.image_processing_pil_mllama import get_all_supported_aspect_ratios

    from fixtures.tiny_model import image_processor

    out = image_processor(image_size=tile, max_image_tiles=cap)(images=[[Image.open(path).convert("RGB")]],
                                                               return_tensors="np")
    return list(get_all_supported_aspect_ratios(cap)[int(out["aspect_ratio_ids"][0, 0]) - 1])


def prepare(work: Path) -> tuple[Path, Path]:
    """The 1-text-layer checkpoint, its Q8_0 text model and S3D8 mmproj (cached)."""
    text, mmproj = work / "text-q8_0.gguf", work / "mmproj-s3d8.gguf"
    if not (text.exists() and mmproj.exists()):
        hf = checkpoint(work, 2)
        run([sys.executable, str(ROOT / "convert" / "to_gguf.py"), str(hf), "--type", "q8_0", "--mmproj", str(mmproj),
             "--mmproj-type", "s3d8", "-o", str(text), "--no-progress", *TOKENIZER])
    return text, mmproj


def encode(text: Path, mmproj: Path, img: Path, cap: int, threads: int, exe: str | None = None) -> dict[str, float]:
    """llama-mtmd-cli's own encode time of one image at a tile cap, with the load average around it; ``exe``: that
    of another build (default: this checkout's)."""
    load = os.getloadavg()[0]
    proc = run([exe or tool("llama-mtmd-cli"), "-m", str(text), "--mmproj", str(mmproj), "--image", str(img),
                "--image-max-tiles", str(cap), "-p", "Describe this picture.", "-n", "1", "-t", str(threads),
                "--temp", "0", "-c", "2048", "-lv", "4"], capture_output=True, text=True, errors="replace")
    m = ENCODE.findall(proc.stderr + proc.stdout)
    if not m:
        raise RuntimeError(f"no encode time in llama-mtmd-cli's log:\n{proc.stderr[-3000:]}")
    return {"encode_ms": float(m[-1]), "load_before": load, "load_after": os.getloadavg()[0]}


def answers(photos: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    """Per photo and cap, the tiny model's greedy tokens (llama.cpp, transformers) and logits errors."""
    from PIL import Image

    from fixtures import harness, reference as R, tiny_model as T

    prompt = [T.BOS_ID, T.START_HEADER_ID, 101, T.END_HEADER_ID, 202, T.IMAGE_TOKEN_ID, 40, 41, 42, 43,
              T.EOT_ID, T.START_HEADER_ID, 102, T.END_HEADER_ID, 202]
    model_dir = T.get()
    hf = R.load_model(model_dir)
    out: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "gguf").mkdir()
        text, mmproj = harness.convert(model_dir, Path(tmp) / "gguf", "f32")
        for name, path in photos.items():
            img = Image.open(path).convert("RGB")
            dumps = {cap: harness.run_dump(text, prompt, Path(tmp) / f"{name}-{cap}", mmproj=mmproj, images=[path],
                                           n_steps=N_STEPS, image_max_tiles=cap) for cap in CAPS}
            n_vocab = dumps[4].step_logits.shape[1] - 1  # the output rows; <|image|>'s logit is -inf
            rows = []
            for cap in CAPS:
                ref = R.run(hf, prompt, [img], n_steps=N_STEPS, max_tiles=cap)
                d = dumps[cap]
                rows.append({"cap": cap, "grid": grid(path, T.IMAGE_SIZE, cap), "tokens": d.tokens,
                             "hf_tokens": ref.tokens,
                             "rel_err_hf": R.rel_err(d.prompt_logits[:, :n_vocab], ref.prompt_logits),
                             "rel_err_cap4": R.rel_err(d.prompt_logits[:, :n_vocab],
                                                       dumps[4].prompt_logits[:, :n_vocab]),
                             "cross_rows": int(d.cross[0].shape[0]), "cross_valid": d.cross_valid[0]})
            out[name] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--photos", default=",".join(PHOTOS), help="scikit-image photos (default: %(default)s)")
    ap.add_argument("--timing-photos", help="the photos to time (default: --photos; the encode time depends on the "
                                            "cap, not the photo)")
    ap.add_argument("--caps", default=",".join(map(str, CAPS)), help="caps to time (default: %(default)s)")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-mllama-tiles")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the last raw results")
    ap.add_argument("--prepare-only", action="store_true", help="make the checkpoint and GGUFs, measure nothing")
    ap.add_argument("--answers-only", action="store_true",
                    help="redo the answers on the tiny model, keep the timings of the last raw results")
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    raw = args.work / "bench_mllama_tiles.json"
    if args.answers_only:
        from PIL import Image

        result = json.loads(raw.read_text())
        photos = {name: photo(args.work, name) for name in args.photos.split(",")}
        result["answers"] = answers(photos)
        result["sizes"].update({name: list(Image.open(p).size) for name, p in photos.items()})
        raw.write_text(json.dumps(result, indent=1))
    elif not args.report_only:
        text, mmproj = prepare(args.work)
        if args.prepare_only:
            print("\n".join(f"{shown(p)}: {p.stat().st_size / 2**20:.0f} MiB" for p in (text, mmproj)))
            return 0
        from PIL import Image

        photos = {name: photo(args.work, name) for name in args.photos.split(",")}
        caps = [int(c) for c in args.caps.split(",")]
        result = {"date": str(datetime.date.today()), "cpu": cpu_name(), "cpus": os.cpu_count(),
                  "threads": args.threads, "timing": [], "answers": {}, "sizes": {}}
        for name in (args.timing_photos or args.photos).split(","):
            path = photo(args.work, name)
            result["sizes"][name] = list(Image.open(path).size)
            for cap in caps:
                result["timing"].append({"photo": name, "cap": cap, "grid": grid(path, 560, cap),
                                         **encode(text, mmproj, path, cap, args.threads)})
                print(json.dumps(result["timing"][-1]), file=sys.stderr, flush=True)
                raw.write_text(json.dumps(result, indent=1))  # the timings so far (--answers-only keeps them)
        result["answers"] = answers(photos)
        result["sizes"].update({name: list(Image.open(p).size) for name, p in photos.items()})
        raw.write_text(json.dumps(result, indent=1))
    kept = keep_raw_results(raw, data_file(args.doc, RAW_NAME), args.report_only)
    write_report(json.loads(kept.read_text()), args)
    return 0


def _grid(g: list[int]) -> str:
    return f"{g[0]}x{g[1]}"


def write_report(result: dict[str, Any], args: argparse.Namespace) -> None:
    t = result["timing"]
    full = {r["photo"]: r["encode_ms"] for r in t if r["cap"] == 4}
    lines = [f"Generated by `python benchmarks/bench_mllama_tiles.py` on {result['date']} ({result['cpu']}, "
             f"{result['cpus']} logical CPUs, {result['threads']} threads, one run per row; the machine was shared: "
             "the load average before and after each run is listed). `llama-mtmd-cli --image-max-tiles N` on the "
             "random Llama 3.2 Vision of `bench_mllama.py` (the real vision encoder, S3D8 projector; two Q8_0 text "
             "layers of the 11B shapes). Encode: its own \"image slice encoded in\" time. Grid: the canvas "
             "(tiles high x wide) of MllamaImageProcessor with `max_image_tiles=N`, 560 px tiles. "
             f"Raw results: `{shown(data_file(args.doc, RAW_NAME))}`.", "",
             "| photo (W x H) | cap | grid | encode s | vs cap 4 | load before / after |",
             "|---|---:|---:|---:|---:|---|"]
    for r in t:
        w, h = result["sizes"][r["photo"]]
        ratio = f"{r['encode_ms'] / full[r['photo']]:.2f}" if r["photo"] in full else "-"
        lines.append(f"| {r['photo']} ({w} x {h}) | {r['cap']} | {_grid(r['grid'])} | {r['encode_ms'] / 1000:.1f} | "
                     f"{ratio} | {r['load_before']:.1f} / {r['load_after']:.1f} |")
    lines += ["", "The answers, on the tiny random model of the parity tests (28 px tiles, f32; no real Llama 3.2 "
              "Vision checkpoint is available here, so this shows that each cap is transformers' answer and how far a "
              "cap moves it, not a quality): greedy tokens of the instruct prompt of the parity tests (8 steps), "
              "max relative error of llama.cpp's prompt logits against transformers' at the same cap and against "
              "llama.cpp's at cap 4, cross-attention state rows (valid / all).", "",
              "| photo | cap | grid | cross rows | greedy tokens (llama.cpp) | = transformers' | rel err vs "
              "transformers | rel err vs cap 4 |", "|---|---:|---:|---:|---|---|---:|---:|"]
    for name, rows in result["answers"].items():
        for r in rows:
            same = "yes" if r["tokens"] == r["hf_tokens"] else "no"
            lines.append(f"| {name} | {r['cap']} | {_grid(r['grid'])} | {r['cross_valid']} / {r['cross_rows']} | "
                         f"{' '.join(map(str, r['tokens']))} | {same} | {r['rel_err_hf']:.1e} | "
                         f"{r['rel_err_cap4']:.2g} |")
    text = "## mllama: the tile cap (`--image-max-tiles`)\n\n" + "\n".join(lines) + "\n"
    write_section(args.doc, "mllama-tiles", text, title="S3D8 benchmarks")
    print(f"wrote the mllama-tiles section of {args.doc}")


if __name__ == "__main__":
    raise SystemExit(main())

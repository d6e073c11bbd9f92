"""KLD of GGUF models against one f16 base on the same text, and each model's paired difference to the first.

Two models' mean KLDs each carry a standard error of about 2 % here (24 x 512 tokens), yet they are measured on the
same tokens, so most of that error is shared; comparing chunk by chunk (``qat.llama_perplexity.chunk_klds``) shows
differences of a fraction of that size. Used for "QAT better than its start" in docs/qat.md::

    python research/paired_kld.py --text .cache/main-job/eval.txt --base .cache/main-job/f16.kld \\
        start.gguf trained.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from qat import llama_perplexity as lp

REPO = Path(__file__).resolve().parents[1]


def run(model: Path, text: Path, base: Path, chunks: int, threads: int) -> tuple[lp.PerplexityResult, list[float]]:
    exe = Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin")) / "llama-perplexity"
    if not exe.exists():
        sys.exit(f"paired_kld: {exe} not found: build first with `bash ci/build.sh`")
    out = subprocess.run([str(exe), "-m", str(model), "-f", str(text), "-c", "512", "--chunks", str(chunks),
                          "-t", str(threads), "--kl-divergence-base", str(base), "--kl-divergence"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"paired_kld: llama-perplexity failed on {model}:\n{out.stderr[-2000:]}")
    text_out = out.stdout + out.stderr
    return lp.parse(text_out, kld=True), lp.chunk_klds(text_out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", type=Path, nargs="+", help="GGUF files; the first is the reference A")
    ap.add_argument("--text", type=Path, required=True, help="the evaluation text (the base's)")
    ap.add_argument("--base", type=Path, required=True, help="llama-perplexity --kl-divergence-base file of the f16 model")
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args()
    results = [(m, *run(m, a.text, a.base, a.chunks, a.threads)) for m in a.models]
    ref = results[0][2]
    rows = []
    for model, r, per_chunk in results:
        diff = None if per_chunk is ref else lp.paired_kld_difference(ref, per_chunk)
        print(f"{model.name}: KLD {r.kld:.4f} ± {r.kld_err:.4f}, PPL {r.ppl:.2f} ± {r.ppl_err:.2f}, same top "
              f"{r.same_top:.1f} %" + ("" if diff is None else f"; minus {a.models[0].name}: {diff}"))
        rows.append({"model": str(model), "kld": r.kld, "kld_err": r.kld_err, "ppl": r.ppl, "ppl_err": r.ppl_err,
                     "same_top": r.same_top, "chunk_kld": per_chunk,
                     "paired_vs_first": None if diff is None else vars(diff)})
    if a.json is not None:
        a.json.write_text(json.dumps({"text": str(a.text), "chunks": a.chunks, "models": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

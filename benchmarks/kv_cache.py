#!/usr/bin/env python3
"""KV-cache types on real context (issue 13 part 6; docs/kv-cache.md, "Measurements").

Two measurements, each against llama.cpp's own cache types in the same run:

``quality``  KL divergence against the same model with an F16 cache (``llama-perplexity --kl-divergence``,
             flash attention on) at ``--ctx`` tokens (default 2048) of held-out gensim Wikipedia text, for every
             type as K only, as V only and as K+V, the mixed pairs, and with the Hadamard rotation off
             (``LLAMA_ATTN_ROT_DISABLE=1``); bytes per token from the cache size libllama prints. A type whose
             block does not divide the model's head size is recorded with the tool's error, not measured.
``speed``    prefill and decode tokens/s at ``--depth`` tokens of context (``llama-bench -d``, default 4096)
             per cache pair, and the ratio to the Q8_0 and F16 caches of the same run.

Writes a JSON file with every figure (``--json``), prints a markdown table, and with ``--plot`` draws KLD
against bits per value (K only, V only, K+V; one colour per type). Typical runs (2-core CPU: about 15 min
for quality on SmolLM2-135M, 5 min on the tiny mllama, 5 min for speed):

    python benchmarks/kv_cache.py quality --model .cache/main-job/smollm2-135m-f16.gguf \\
        --json docs/data/kv_cache_smollm2.json --plot docs/img/kv_cache_smollm2.png
    python benchmarks/kv_cache.py quality --model tiny-mllama --json docs/data/kv_cache_tiny_mllama.json
    python benchmarks/kv_cache.py speed --model .cache/main-job/smollm2-135m-f16.gguf --json docs/data/kv_cache_speed.json

``--model tiny-mllama`` converts the random tiny Llama 3.2 Vision of the parity tests (heads of 128, which
``q4_hqq_128`` needs) to an f16 text GGUF first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_common import ROOT as REPO  # type: ignore[import-not-found]  # puts the repository root on sys.path
from gguf_s3d8.fsio import atomic_path, atomic_write
from qat import llama_perplexity

#: the cache types measured, with their bits per value (block bytes * 8 / block values)
BITS = {"f16": 16.0, "q8_0": 8.5, "q5_1": 6.0, "q4_1": 5.0, "q4_hqq": 5.0, "q4_0": 4.5, "iq4_nl": 4.5,
        "q4_hqq_128": 4.25, "tq3_0": 3.5}
QUANTISED = [t for t in BITS if t != "f16"]
#: mixed K/V pairs: the write-up's best (K q4_hqq + V tq3_0), its head-128 variant, and 8-bit K with a small V
MIXED = [("q4_hqq", "tq3_0"), ("q4_hqq_128", "tq3_0"), ("q8_0", "q4_hqq"), ("q8_0", "tq3_0"), ("q4_hqq", "q4_0")]
#: pairs also measured with the rotation off
NO_ROTATION = [("q4_0", "q4_0"), ("q4_hqq", "q4_hqq"), ("tq3_0", "tq3_0"), ("tq3_0", "f16"), ("f16", "tq3_0")]
#: cache pairs of the speed run
SPEED_PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_hqq", "q4_hqq"), ("tq3_0", "tq3_0"),
               ("q4_hqq", "tq3_0"), ("q4_hqq_128", "q4_hqq_128")]


@dataclass
class QualityRow:
    k: str
    v: str
    rotation: bool
    kld: float = float("nan")
    kld_err: float = float("nan")
    same_top: float = float("nan")
    ppl: float = float("nan")
    bytes_per_token: float = float("nan")
    error: str = ""  #: the tool's message where the pair cannot serve the model

    @property
    def label(self) -> str:
        return f"{self.k} / {self.v}" + ("" if self.rotation else ", rotation off")


def tool(name: str) -> str:
    exe = Path(os.environ.get("S3D8_BIN_DIR", REPO / "build" / "host" / "bin")) / name
    if not exe.is_file():
        sys.exit(f"kv_cache: {exe} not found: build llama.cpp first (`bash ci/build.sh host`) or set S3D8_BIN_DIR")
    return str(exe)


def resolve_model(model: str, work: Path) -> Path:
    if model != "tiny-mllama":
        path = Path(model)
        if not path.is_file():
            sys.exit(f"kv_cache: no model file {path}")
        return path
    from fixtures import harness, tiny_model

    return harness.convert(tiny_model.get(), work, "f16")[0]


def eval_text(work: Path) -> Path:
    from fixtures import assets

    path = work / "eval.txt"
    path.write_text(assets.wiki_text("eval"), encoding="utf-8")
    return path


def error_line(log: str) -> str:
    """The tool's reason, without the log prefix (``0.00.241.665 E ``)."""
    lines = [re.sub(r"^[\d.]+ [A-Z] ", "", ln.strip()) for ln in log.splitlines()]
    reasons = [ln for ln in lines if "does not divide" in ln or "error" in ln.lower()]
    return (reasons[0] if reasons else lines[-1] if lines else "no output")[:200]


def perplexity(model: Path, text: Path, base: Path, args: argparse.Namespace, k: str, v: str,
               rotation: bool, save_base: bool = False) -> tuple[int, str]:
    cmd = [tool("llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(args.ctx), "-b", str(args.ctx),
           "--chunks", str(args.chunks), "-t", str(args.threads), "-fa", "on", "-ctk", k, "-ctv", v, "-lv", "4",
           "--kl-divergence-base", str(base)]
    if not save_base:
        cmd.append("--kl-divergence")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    if not rotation:
        env["LLAMA_ATTN_ROT_DISABLE"] = "1"
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout + p.stderr


def quality_pairs() -> list[tuple[str, str, bool]]:
    pairs = [(t, "f16", True) for t in QUANTISED] + [("f16", t, True) for t in QUANTISED]
    pairs += [(t, t, True) for t in QUANTISED] + [(k, v, True) for k, v in MIXED]
    return pairs + [(k, v, False) for k, v in NO_ROTATION]


def quality(args: argparse.Namespace, work: Path) -> dict:
    model = resolve_model(args.model, work)
    text = eval_text(work)
    base = work / "f16-cache.kld"
    rc, log = perplexity(model, text, base, args, "f16", "f16", True, save_base=True)
    if rc != 0:
        sys.exit(f"kv_cache: the F16-cache base run failed:\n{log[-3000:]}")
    ref = llama_perplexity.parse(log, kld=False)
    rows = [QualityRow("f16", "f16", True, kld=0.0, kld_err=0.0, same_top=100.0, ppl=ref.ppl,
                       bytes_per_token=ref.kv_bytes_per_token)]
    pairs = quality_pairs()
    t0 = time.time()
    for i, (k, v, rot) in enumerate(pairs, 1):
        row = QualityRow(k, v, rot)
        rc, log = perplexity(model, text, base, args, k, v, rot)
        if rc == 0:
            r = llama_perplexity.parse(log, kld=True)
            row.kld, row.kld_err, row.same_top, row.ppl = r.kld, r.kld_err, r.same_top, r.ppl
            row.bytes_per_token = r.kv_bytes_per_token
        else:
            row.error = error_line(log)
        rows.append(row)
        shown = f"KLD {row.kld:.3g}" if not row.error else f"not run: {row.error}"
        print(f"[{i}/{len(pairs)}, {time.time() - t0:.0f} s] {row.label}: {shown}", file=sys.stderr)
    return {"model": str(args.model), "ctx": args.ctx, "chunks": args.chunks, "tokens": args.ctx * args.chunks,
            "f16_ppl": ref.ppl, "rows": [asdict(r) for r in rows]}


def quality_table(result: dict) -> str:
    out = [f"{result['model']}: {result['chunks']} x {result['ctx']} tokens, F16-cache PPL {result['f16_ppl']:.3f}",
           "", "| K / V | bits K, V | bytes/token | mean KLD | same top % | PPL |", "|---|---|---:|---:|---:|---:|"]
    for r in map(lambda d: QualityRow(**d), result["rows"]):
        bits = f"{BITS[r.k]:g}, {BITS[r.v]:g}"
        if r.error:
            out.append(f"| {r.label} | {bits} | | n/a: {r.error} | | |")
        else:
            out.append(f"| {r.label} | {bits} | {r.bytes_per_token:.0f} | {r.kld:.3g} ± {r.kld_err:.2g} | "
                       f"{r.same_top:.1f} | {r.ppl:.3f} |")
    return "\n".join(out)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [QualityRow(**d) for d in result["rows"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2), sharey=True)
    colours = {t: plt.get_cmap("tab10")(i) for i, t in enumerate(QUANTISED)}
    for ax, (title, pick) in zip(axes, (("K only (V f16)", lambda r: r.v == "f16" and r.k != "f16"),
                                        ("V only (K f16)", lambda r: r.k == "f16" and r.v != "f16"),
                                        ("K and V", lambda r: r.k == r.v != "f16"))):
        for r in rows:
            if r.error or not pick(r) or r.kld != r.kld:
                continue
            t = r.k if r.k != "f16" else r.v
            ax.scatter([BITS[t]], [r.kld], color=colours[t], marker="o" if r.rotation else "x", s=45, zorder=3)
            ax.annotate(t + ("" if r.rotation else " (no rot.)"), (BITS[t], r.kld), fontsize=7,
                        textcoords="offset points", xytext=(4, 3))
        ax.set_title(title)
        ax.set_xlabel("bits per value")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("mean KLD vs F16 cache (nats)")
    fig.suptitle(f"KV-cache types: {Path(result['model']).name}, {result['chunks']} x {result['ctx']} tokens")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")


def bench_pair(model: Path, k: str, v: str, args: argparse.Namespace) -> tuple[float, float, str]:
    """One llama-bench run of a cache pair: (pp t/s, tg t/s, error line or "")."""
    cmd = [tool("llama-bench"), "-m", str(model), "-p", str(args.prompt), "-n", str(args.gen), "-d", str(args.depth),
           "-t", str(args.threads), "-r", str(args.reps), "-fa", "1", "-ctk", k, "-ctv", v, "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        return float("nan"), float("nan"), error_line(p.stdout + p.stderr)
    pp = tg = float("nan")
    for test in json.loads(p.stdout):
        if test["n_prompt"]:
            pp = test["avg_ts"]
        else:
            tg = test["avg_ts"]
    return pp, tg, ""


def speed(args: argparse.Namespace, work: Path) -> dict:
    """Every pair once per round, ``--rounds`` rounds (so that a slow phase of a shared machine hits every pair
    alike, not the pairs that happen to run then); each pair's figure is the median over the rounds."""
    model = resolve_model(args.model, work)
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {pair: [] for pair in SPEED_PAIRS}
    errors: dict[tuple[str, str], str] = {}
    for r in range(args.rounds):
        for k, v in SPEED_PAIRS:
            if (k, v) in errors:
                continue
            pp, tg, err = bench_pair(model, k, v, args)
            if err:
                errors[(k, v)] = err
            else:
                runs[(k, v)].append((pp, tg))
            print(f"[round {r + 1}/{args.rounds}] {k} / {v}: pp {pp:.1f} t/s, tg {tg:.1f} t/s {err}", file=sys.stderr)
    rows = []
    for k, v in SPEED_PAIRS:
        pps, tgs = [pp for pp, _ in runs[(k, v)]], [tg for _, tg in runs[(k, v)]]
        rows.append({"k": k, "v": v, "error": errors.get((k, v), ""),
                     "pp_ts": statistics.median(pps) if pps else float("nan"),
                     "tg_ts": statistics.median(tgs) if tgs else float("nan"),
                     "pp_rounds": pps, "tg_rounds": tgs})
    return {"model": str(args.model), "depth": args.depth, "prompt": args.prompt, "gen": args.gen,
            "threads": args.threads, "reps": args.reps, "rounds": args.rounds, "machine": machine(), "rows": rows}


def machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def speed_table(result: dict) -> str:
    ref = {(r["k"], r["v"]): r for r in result["rows"]}
    q8, f16 = ref.get(("q8_0", "q8_0")), ref.get(("f16", "f16"))
    rounds = result.get("rounds", 1)
    out = [f"{result['model']} on {result['machine']}, {result['threads']} threads, at {result['depth']} tokens of "
           f"context (pp{result['prompt']}, tg{result['gen']}, flash attention on; median of {rounds} interleaved "
           f"round(s), tg range over the rounds)", "",
           "| K / V | pp t/s | tg t/s | tg range | pp ÷ Q8_0 | tg ÷ Q8_0 | tg ÷ F16 |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if r["error"]:
            out.append(f"| {r['k']} / {r['v']} | n/a: {r['error']} | | | | | |")
            continue
        tgs = r.get("tg_rounds") or [r["tg_ts"]]
        cells = f"| {r['k']} / {r['v']} | {r['pp_ts']:.1f} | {r['tg_ts']:.1f} | {min(tgs):.1f}-{max(tgs):.1f} |"
        if q8 and f16:
            cells += (f" {r['pp_ts'] / q8['pp_ts']:.2f} | {r['tg_ts'] / q8['tg_ts']:.2f} |"
                      f" {r['tg_ts'] / f16['tg_ts']:.2f} |")
        else:
            cells += " | | |"
        out.append(cells)
    return "\n".join(out)


def table(result: dict, what: str) -> str:
    return quality_table(result) if what == "quality" else speed_table(result)


def write_json(result: dict, path: Path) -> None:
    atomic_write(path, json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality", help="KLD vs an F16 cache for every type as K, V, K+V, mixed, rotation off")
    q.add_argument("--ctx", type=int, default=2048, help="context of each chunk (default 2048)")
    q.add_argument("--chunks", type=int, default=4, help="chunks of --ctx tokens (default 4)")
    s = sub.add_parser("speed", help="prefill/decode tokens/s at --depth tokens of context per cache pair")
    s.add_argument("--depth", type=int, default=4096, help="tokens already in the cache (default 4096)")
    s.add_argument("--prompt", type=int, default=512, help="prefill tokens measured (default 512)")
    s.add_argument("--gen", type=int, default=64, help="decoded tokens measured (default 64)")
    s.add_argument("--reps", type=int, default=2, help="llama-bench repetitions per run (default 2)")
    s.add_argument("--rounds", type=int, default=3,
                   help="rounds over all pairs; each figure is the median of its rounds (default 3)")
    for p in (q, s):
        p.add_argument("--model", required=True, help="a GGUF model, or 'tiny-mllama' (the parity tests' model)")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--json", type=Path, help="write every figure here")
    q.add_argument("--plot", type=Path, help="write the KLD plot (PNG) here")
    t = sub.add_parser("table", help="print the markdown table of a saved --json run")
    t.add_argument("from_json", type=Path)
    args = ap.parse_args(argv)
    if args.what == "table":  # re-print a saved run's table (e.g. for docs/kv-cache.md)
        result = json.loads(args.from_json.read_text())
        print(table(result, "speed" if "depth" in result else "quality"))
        return 0
    with tempfile.TemporaryDirectory(prefix="kv-cache-") as tmp:
        result = quality(args, Path(tmp)) if args.what == "quality" else speed(args, Path(tmp))
    print(table(result, args.what))
    if args.json:
        write_json(result, args.json)
    if args.what == "quality" and args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

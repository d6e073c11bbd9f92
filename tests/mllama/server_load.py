"""Load and bad input for llama-server with an mllama model (issue 14, part 3).

Starts llama-server (``--parallel 4``, a small context per slot so that "longer than the context" is reachable) on a
free loopback port and sends it a seeded mix of requests from concurrent clients, round after round:

* valid image chats, plain and streamed (``chat``, ``stream``), and two fixed greedy requests (``greedy``: temperature
  0, fixed ``max_tokens``, one with a fixed image and one text-only; plain and streamed) whose answers must be the same
  every time;
* clients that go away: mid-stream after the first event, or right after sending (``cancel``);
* bad input: malformed JSON and JSON of the wrong shape (``bad_json``), wrong content types (``content_type``),
  invalid base64 (``bad_base64``), bytes that are no image (``not_image``), oversized images and bodies
  (``oversized``), prompts at and past the context (``long_prompt``).

Every response is classified: ``answer`` (200, chat completion JSON), ``sse`` (200, a stream of JSON events ending
with ``[DONE]``), ``4xx`` (a client error with a JSON error message), ``cancelled``/``disconnected`` (the client
left); anything else - a 5xx, a 4xx without a message, a broken stream, a reset connection, a timeout - and any
outcome a request's variant does not allow is a failure. Between rounds the driver waits until every slot is idle
and samples the server's VmRSS; at the end the server must be alive and healthy, shut down cleanly, and its RSS be
within ``--rss-tolerance`` of the RSS after the first round.

    python -m tests.mllama.server_load --requests 600 --clients 8 --seed 1 --report load.json

The server runs with one thread, a small prompt cache and a fixed glibc mmap threshold (``Config`` says why).
Standard library for the HTTP side (http.client, a concurrent.futures thread pool); numpy and Pillow for the images.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import platform
import random
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.mllama import llama_server as S  # noqa: E402
# the requests and the client side live in load_requests.py and load_client.py; the names
# tests/python/test_server_load.py uses are re-exported here
from tests.mllama.load_requests import (  # noqa: F401, E402
    CRASH_MARKERS, Context, GREEDY, GREEDY_IMAGE, GREEDY_MARGIN_MIN, JSON, PATH, WEIGHTS, catalogue,
    greedy_body, greedy_text_body, jbody, plan, text_chat, words,
)
from tests.mllama.load_client import (  # noqa: F401, E402
    Record, _read_sse, calibrate, greedy_reference, post_json, run_one, slots_idle, wait_idle,
)


# --------------------------------------------------------------------------------------------------------------------
# the run


@dataclass
class Config:
    requests: int = 600
    clients: int = 8
    seed: int = 1
    round_size: int = 60
    n_parallel: int = 4
    n_ctx: int = 1024            # total: n_ctx / n_parallel tokens per slot
    # one thread: on a loaded 2-core machine two threads that spin-wait for each other make the latency tail
    # 30x longer (measured: p99 33 s instead of 1.2 s), and the HTTP threads need the other core
    threads: int = 1
    # a small prompt cache (MiB): slots are saved to and restored from it (mllama states with their cross-attention
    # rows), and its evictions run, while it stays bounded (the default, 8 GiB, grows the RSS by design)
    cache_ram: int = 8
    # MALLOC_MMAP_THRESHOLD_ of the server (0: glibc's default). A fixed threshold turns off glibc's dynamic one,
    # which, raised by each freed large block (a decoded image, a 100 MiB body), serves later blocks of up to 32 MiB
    # from the per-thread arenas that keep them: with it, the RSS of a server that leaks nothing doubles in a few
    # hundred requests (docs/reliability.md) and the RSS no longer measures leaks
    mmap_threshold: int = 65536
    timeout: float = 300.0       # per request
    idle_timeout: float = 120.0  # for the slots to become idle after a round
    rss_tolerance: float = 0.10
    weights: dict[str, float] = field(default_factory=dict)   # overrides of WEIGHTS
    exclude: set[tuple[str, str]] = field(default_factory=set)  # (kind, variant) not to send
    server: str | None = None    # llama-server binary (default: harness.binary)
    model: str | None = None     # text GGUF (default: the tiny mllama, f16)
    mmproj: str | None = None
    log: str | None = None       # server log (default: a temporary file)
    extra_args: list[str] = field(default_factory=list)


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]  # noqa: E731  (nearest rank)
    return {"n": len(s), "p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "max": s[-1]}


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu or platform.processor(), "cores": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version()}


def server_version(exe: Path) -> str:
    import subprocess

    try:
        p = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return " | ".join(ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith(("version", "built")))


def _model_files(cfg: Config) -> tuple[Path, Path, Path]:
    from tests.mllama import harness, tiny_model as T

    exe = Path(cfg.server) if cfg.server else harness.binary("llama-server")
    if cfg.model:
        assert cfg.mmproj, "--model needs --mmproj"
        return exe, Path(cfg.model), Path(cfg.mmproj)
    text, mmproj = harness.convert(T.get(), None, "f16")
    return exe, text, mmproj


def run(cfg: Config, progress: Callable[[str], None] = lambda s: None) -> dict:
    """Start the server, run the rounds, stop the server; returns the report (``report["problems"]`` lists what went
    wrong, empty when all is well)."""
    import tempfile

    exe, text, mmproj = _model_files(cfg)
    tmp = None
    if cfg.log:
        log = Path(cfg.log)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="server-load-")
        log = Path(tmp.name) / "server.log"
    env = {"MALLOC_MMAP_THRESHOLD_": str(cfg.mmap_threshold)} if cfg.mmap_threshold else None
    srv = S.start(exe, text, mmproj, log, n_parallel=cfg.n_parallel, n_ctx=cfg.n_ctx, threads=cfg.threads,
                  extra=["--cache-ram", str(cfg.cache_ram), *cfg.extra_args], env=env)
    report: dict = {"config": {**asdict(cfg), "exclude": sorted("/".join(x) for x in cfg.exclude)},
                    "machine": machine(), "server_version": server_version(exe), "server_cmd": srv.cmd,
                    "server_env": env,
                    "load_before": os.getloadavg()}
    problems: list[str] = []
    try:
        ctx = calibrate(srv.port)
        report["context"] = asdict(ctx)
        report["greedy"] = {}
        for key, body in GREEDY.items():
            ref, margins = greedy_reference(srv.port, body)
            report["greedy"][key] = {"reference": ref, "min_margin": min(margins) if margins else None,
                                     "margins": margins}
            if not margins or min(margins) <= GREEDY_MARGIN_MIN:
                problems.append(f"the greedy request {key!r} has a near tie (margins {margins}, bound "
                                f"{GREEDY_MARGIN_MIN}): its answer could change with rounding - change its input")
        variants = [v for v in catalogue(ctx) if (v.kind, v.name) not in cfg.exclude]
        rounds = plan(variants, cfg.requests, cfg.round_size, cfg.seed, cfg.weights)
        seeds = random.Random(cfg.seed + 1)
        records: list[Record] = []
        rss: list[dict] = []
        t_start = time.perf_counter()
        busy = 0.0
        for i, picks in enumerate(rounds):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=cfg.clients) as pool:
                futs = [pool.submit(run_one, srv.port, v, i, seeds.getrandbits(32), cfg.timeout, t_start)
                        for v in picks]
                got = [f.result() for f in futs]
            busy += time.perf_counter() - t0
            records += got
            idle = wait_idle(srv.port, cfg.idle_timeout)
            if not srv.alive():
                problems.append(f"the server died in round {i} (exit status {srv.proc.returncode})")
                break
            if not idle:
                problems.append(f"slots still busy {cfg.idle_timeout} s after round {i}")
            rss.append({"round": i, "rss_kb": srv.status_kb("VmRSS"), "hwm_kb": srv.status_kb("VmHWM"),
                        "t_s": round(time.perf_counter() - t_start, 2)})
            n_fail = sum(not r.ok for r in got)
            progress(f"round {i + 1}/{len(rounds)}: {len(got)} requests, {n_fail} failures, "
                     f"{time.perf_counter() - t0:.1f} s, VmRSS {rss[-1]['rss_kb'] / 1024:.1f} MiB")
        wall = time.perf_counter() - t_start

        # the end state
        health: object = None
        if srv.alive():
            try:
                health = S.http_get(srv.port, "/health", timeout=30)[0]
            except (OSError, http.client.HTTPException) as e:
                health = f"{type(e).__name__}: {e}"
            try:
                idle_end = slots_idle(srv.port)
            except (OSError, http.client.HTTPException, ValueError):
                idle_end = False
            if not idle_end:
                problems.append("slots busy at the end")
        if health != 200:
            problems.append(f"/health at the end: {health}")
        alive = srv.alive()
        if not alive:
            problems.append(f"the server is not running at the end (exit status {srv.proc.returncode})")
    finally:
        exit_status = srv.stop(timeout=60)
        log_text = log.read_text(errors="replace") if log.is_file() else ""
        if tmp is not None:
            tmp.cleanup()
    if alive and exit_status != 0:
        problems.append(f"the server's exit status after SIGTERM is {exit_status}")
    markers = sorted({m for m in CRASH_MARKERS if m in log_text})
    if markers:
        problems.append(f"the server log contains {markers}")

    # the numbers
    fails = [r for r in records if not r.ok]
    for r in fails[:30]:
        problems.append(f"round {r.round} {r.kind}/{r.variant}: status {r.status}, {r.outcome}: {r.detail}")
    if len(fails) > 30:
        problems.append(f"... {len(fails) - 30} more failures")
    greedy = [r for r in records if r.greedy and r.ok]
    greedy_answers = {}
    for key, g in report["greedy"].items():
        answers = Counter(r.content for r in greedy if r.greedy == key)
        greedy_answers[key] = dict(answers)
        if set(answers) - {g["reference"]}:
            problems.append(f"the greedy request {key!r} got {len(answers)} different answers: {dict(answers)} "
                            f"(alone before the run: {g['reference']!r})")
    rss_first, rss_last = rss[0]["rss_kb"], rss[-1]["rss_kb"]
    growth = (rss_last - rss_first) / rss_first
    if growth > cfg.rss_tolerance:
        problems.append(f"VmRSS grew by {100 * growth:.1f} % from {rss_first} kB after the first round to "
                        f"{rss_last} kB at the end (tolerance {100 * cfg.rss_tolerance:.0f} %)")
    by_kind: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_kind[r.kind].append(r)
    report.update({
        "requests": len(records),
        "rounds": len(rss),
        "wall_s": wall,
        "busy_s": busy,
        "requests_per_s": len(records) / busy if busy else None,
        "failures": len(fails),
        "outcomes": {k: dict(Counter(r.outcome for r in rs)) for k, rs in sorted(by_kind.items())},
        "variants": {k: dict(Counter(r.variant for r in rs)) for k, rs in sorted(by_kind.items())},
        "status": {str(k): n for k, n in sorted(Counter(r.status for r in records).items(), key=lambda kv: str(kv[0]))},
        "latency_s": {"all": percentiles([r.latency_s for r in records]),
                      **{k: percentiles([r.latency_s for r in rs]) for k, rs in sorted(by_kind.items())}},
        "greedy_answers": greedy_answers,
        "rss": {"first_round_kb": rss_first, "end_kb": rss_last, "growth": growth,
                "max_kb": max(x["rss_kb"] for x in rss), "hwm_kb": rss[-1]["hwm_kb"], "per_round": rss},
        "health_end": health,
        "alive_end": alive,
        "exit_status": exit_status,
        "log_markers": markers,
        "load_after": os.getloadavg(),
        "failed_requests": [asdict(r) for r in fails],
        "greedy_requests": [asdict(r) for r in greedy],
        "problems": problems,
    })
    return report


def summary(report: dict) -> str:
    lines = [f"{report['requests']} requests in {report['rounds']} rounds, {report['config']['clients']} clients, "
             f"{report['busy_s']:.1f} s: {report['requests_per_s']:.2f} requests/s; failures: {report['failures']}",
             f"machine: {report['machine']['cpu']}, {report['machine']['cores']} cores; load average before "
             f"{report['load_before'][0]:.2f}, after {report['load_after'][0]:.2f}",
             f"server: {report['server_version']}",
             f"status codes: {report['status']}",
             f"{'kind':<13} {'n':>4} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} {'max s':>7}  outcomes"]
    for kind, lat in report["latency_s"].items():
        out = report["outcomes"].get(kind, {})
        lines.append(f"{kind:<13} {lat['n']:>4} {lat['p50']:>7.3f} {lat['p90']:>7.3f} {lat['p99']:>7.3f} "
                     f"{lat['max']:>7.3f}  {out if out else ''}")
    for key, g in report["greedy"].items():
        answers = report["greedy_answers"].get(key, {})
        lines.append(f"greedy {key!r}: {sum(answers.values())} answers, {len(answers)} distinct (alone: "
                     f"{g['reference']!r}, smallest margin {g['min_margin']:.3f})")
    r = report["rss"]
    lines.append(f"VmRSS: {r['first_round_kb'] / 1024:.1f} MiB after the first round, {r['end_kb'] / 1024:.1f} MiB "
                 f"at the end ({100 * r['growth']:+.1f} %), max {r['max_kb'] / 1024:.1f} MiB, "
                 f"peak (VmHWM) {r['hwm_kb'] / 1024:.1f} MiB")
    lines.append(f"end: alive {report['alive_end']}, /health {report['health_end']}, exit status after SIGTERM "
                 f"{report['exit_status']}, log markers {report['log_markers']}")
    lines.append("problems:" + "".join(f"\n  - {p}" for p in report["problems"]) if report["problems"]
                 else "no problems")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Config()
    ap.add_argument("--requests", type=int, default=d.requests, help="number of requests (default %(default)s)")
    ap.add_argument("--clients", type=int, default=d.clients, help="concurrent clients (default %(default)s)")
    ap.add_argument("--seed", type=int, default=d.seed, help="seed of the request mix (default %(default)s)")
    ap.add_argument("--round-size", type=int, default=d.round_size,
                    help="requests per round; RSS is sampled after each (default %(default)s)")
    ap.add_argument("--report", type=Path, help="write the full report (JSON) here")
    ap.add_argument("--parallel", dest="n_parallel", type=int, default=d.n_parallel, help="server slots")
    ap.add_argument("--ctx", dest="n_ctx", type=int, default=d.n_ctx,
                    help="server context, all slots together (default %(default)s)")
    ap.add_argument("--threads", type=int, default=d.threads, help="server threads (default %(default)s)")
    ap.add_argument("--cache-ram", type=int, default=d.cache_ram,
                    help="the server's prompt cache, MiB (default %(default)s)")
    ap.add_argument("--mmap-threshold", type=int, default=d.mmap_threshold,
                    help="MALLOC_MMAP_THRESHOLD_ of the server, 0: glibc's dynamic default (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=d.timeout, help="per request, seconds (default %(default)s)")
    ap.add_argument("--rss-tolerance", type=float, default=d.rss_tolerance)
    ap.add_argument("--exclude", action="append", default=[], metavar="KIND/VARIANT",
                    help="a request variant not to send (repeat)")
    ap.add_argument("--weight", action="append", default=[], metavar="KIND=W",
                    help=f"share of a kind in the mix (repeat; default {WEIGHTS})")
    ap.add_argument("--server", help="llama-server binary (default: $S3D8_BIN_DIR or build/host/bin)")
    ap.add_argument("--model", help="text GGUF (default: the tiny random mllama, converted to f16)")
    ap.add_argument("--mmproj", help="mmproj GGUF for --model")
    ap.add_argument("--log", help="keep the server log here")
    ap.add_argument("--server-arg", action="append", default=[], dest="extra_args",
                    help="one more llama-server argument (repeat: --server-arg=--metrics)")
    a = ap.parse_args(argv)
    cfg = Config(requests=a.requests, clients=a.clients, seed=a.seed, round_size=a.round_size,
                 n_parallel=a.n_parallel, n_ctx=a.n_ctx, threads=a.threads, cache_ram=a.cache_ram,
                 mmap_threshold=a.mmap_threshold, timeout=a.timeout, rss_tolerance=a.rss_tolerance,
                 server=a.server, model=a.model, mmproj=a.mmproj, log=a.log,
                 extra_args=a.extra_args,
                 weights={k: float(w) for k, w in (x.split("=", 1) for x in a.weight)},
                 exclude={tuple(x.split("/", 1)) for x in a.exclude})
    report = run(cfg, progress=lambda s: print(s, flush=True))
    if a.report:
        a.report.write_text(json.dumps(report, indent=1) + "\n")
    print(summary(report))
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""The tools' output parsers (``llama-quantize --dry-run`` and its fall-backs, ``llama-bench``, ``llama-perplexity``)
and the small helpers around running them (the quiet machine, each project's override syntax)."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------- tool output

_DRY_RUN_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+-\s+\[.*\(\s*(\w+)\)\s*$", re.M)


def parse_dry_run(output: str) -> dict[str, str]:
    """Tensor name -> type (upper case) from ``llama-quantize --dry-run``'s per-tensor lines (the type it would
    write, after any fallback)."""
    return {m.group(1): m.group(2).upper() for m in _DRY_RUN_LINE.finditer(output)}


_FALLBACK = re.compile(r"^warning: (\S+)\s+- (.*?) -> falling back to\s+(\w+)", re.M)


def parse_fallbacks(output: str) -> dict[str, str]:
    """Tensor name -> reason, for each tensor ``llama-quantize`` could not give the requested type (it then
    writes another one and says so in a warning)."""
    return {m.group(1): f"{m.group(2).strip()}, wrote {m.group(3)}" for m in _FALLBACK.finditer(output)}


def parse_bench(stdout: str) -> tuple[float, float]:
    """(pp t/s, tg t/s) from ``llama-bench -o json`` (both projects write the same fields)."""
    pp = tg = float("nan")
    for row in json.loads(stdout):
        if row.get("n_prompt") and not row.get("n_gen"):
            pp = float(row["avg_ts"])
        elif row.get("n_gen") and not row.get("n_prompt"):
            tg = float(row["avg_ts"])
    return pp, tg


_IK_FINAL = re.compile(r"Final estimate: PPL over \d+ chunks for n_ctx=\d+ = ([\d.]+) \+/- ([\d.]+)")


def parse_perplexity(output: str, kld: bool) -> Any:
    """``qat.llama_perplexity.parse``, which also reads ik_llama.cpp's base run: ik prints ``Final estimate: PPL
    over N chunks for n_ctx=C = x +/- e`` where mainline prints ``Final estimate: PPL = x +/- e`` (its comparison
    run prints the same lines as mainline's)."""
    from qat import llama_perplexity

    if not kld:
        ik = _IK_FINAL.search(output)
        if ik:
            return llama_perplexity.PerplexityResult(ppl=float(ik.group(1)), ppl_err=float(ik.group(2)))
    return llama_perplexity.parse(output, kld=kld)


def best_of(tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest pp and tg over llama-bench tries (interference only ever slows a run down), the lowest load
    average seen before one of them and how many tries found the machine quiet."""
    def best(k: str) -> float:
        vals = [t[k] for t in tries if not math.isnan(t[k])]
        return max(vals) if vals else float("nan")

    return {"pp512": best("pp512"), "tg128": best("tg128"), "load1": min(t["load1"] for t in tries),
            "quiet": sum(bool(t.get("quiet")) for t in tries)}


def runnable_others() -> int:
    """Processes running or runnable right now besides the caller (/proc/loadavg's fourth field counts it)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1
    except (OSError, ValueError, IndexError):
        return 0


def wait_quiet(max_seconds: float, samples: int = 5) -> bool:
    """Wait (at most ``max_seconds``) until no other process has been runnable for ``samples`` checks 0.2 s apart;
    whether that happened."""
    deadline, calm = time.monotonic() + max_seconds, 0
    while time.monotonic() < deadline:
        calm = calm + 1 if runnable_others() == 0 else 0
        if calm >= samples:
            return True
        time.sleep(0.2)
    return False


def tensor_type_args(project: str, overrides: dict[str, str]) -> list[str]:
    """``llama-quantize`` arguments that give each regex its type: mainline ``--tensor-type R=T`` (repeated), ik
    ``--custom-q R1=T1,R2=T2`` (ik matches the first rule that fits; the regexes here do not overlap)."""
    if project == "ik":
        return ["--custom-q", ",".join(f"{r}={t.lower()}" for r, t in overrides.items())]
    return [a for r, t in overrides.items() for a in ("--tensor-type", f"{r}={t.lower()}")]


def exact_regex(name: str) -> str:
    return "^" + re.escape(name) + "$"

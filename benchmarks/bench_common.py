"""What the benchmark scripts share: the repository's paths, the host build's tools, logged commands, the CPU's
name, paths as reports show them and the raw results kept next to a report. Importing it puts the repository root on ``sys.path``, so the scripts can
import ``convert`` and ``tests.mllama`` when run as ``python benchmarks/<script>.py``.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "work" / "llama.cpp"
BUILD = ROOT / "build" / "host"

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command (echoed to stderr), failing on a non-zero exit."""
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def tool(name: str) -> str:
    """A binary of the host build; exits with the command that builds it when it is missing."""
    exe = BUILD / "bin" / name
    if not exe.exists():
        sys.exit(f"missing {exe}: build the host preset first (bash ci/build.sh host)")
    return str(exe)


def shown(path: Path) -> Path:
    """A path as a report shows it: relative to the repository when inside it."""
    path = path.resolve()
    return path.relative_to(ROOT) if ROOT in path.parents else path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def keep_raw_results(raw: Path, kept: Path, report_only: bool) -> Path:
    """The raw results a report is written from, kept next to it (``kept``, in docs/): a measuring run copies its
    fresh ``raw`` file there; ``--report-only`` reuses the kept copy (on a fresh clone there is no ``raw``) and
    copies ``raw`` only when nothing is kept yet. Exits with the reason when neither exists."""
    if not report_only or not kept.exists():
        if not raw.exists():
            sys.exit(f"no raw results in {shown(raw)} or {shown(kept)}: run without --report-only first")
        shutil.copyfile(raw, kept)
    return kept

"""ik_llama.cpp's CPU tools built from the sdist of ``ik-llama-cpp-python==0.1.5`` (``ci/upstream.py`` knows it as
a NEIGHBOUR, sha256-checked), for benchmarks that put its types next to ours (``benchmarks/quality_anchors.py``).

The tree is extracted once into ``.cache/ik_llama.cpp/src`` (ignored; its code is never committed) and built
CPU-only, Release, ``GGML_NATIVE``, with ccache, only the named targets, into ``.cache/ik_llama.cpp/build``. A second
call rebuilds nothing. The sdist has no git metadata and lacks ``common/cmake/build-info-gen-cpp.cmake``, the
script its build runs to write ``common/build-info.cpp``: this module writes that file by hand (build number 0,
commit ``ik-llama-cpp-python-0.1.5``) and puts a no-op script in the missing one's place, so that ninja's
"output not in the log" rule finds a command that succeeds.

    python benchmarks/ik_build.py            # build (or check) the four tools, print their folder
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import bench_common  # type: ignore[import-not-found]  # noqa: F401  # puts the repository root and ci/ on sys.path
import upstream  # ci/upstream.py: the sha256-checked sdist download
from gguf_s3d8.fsio import atomic_write

NAME = "ik_llama.cpp"
TARGETS = ("llama-quantize", "llama-imatrix", "llama-perplexity", "llama-bench")
#: the configuration: CPU only (no CUDA/Vulkan/..., the defaults), Release, native SIMD like build/host, and the
#: IQK FlashAttention kernels for the default K/V types only (ALL_QUANTS compiles dozens of template instances)
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_IQK_FA_ALL_QUANTS=OFF",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DGGML_CCACHE=OFF")
BUILD_INFO = """\
// written by benchmarks/ik_build.py: the ik-llama-cpp-python 0.1.5 sdist has no git metadata
int LLAMA_BUILD_NUMBER = 0;
char const *LLAMA_COMMIT = "ik-llama-cpp-python-0.1.5";
char const *LLAMA_COMPILER = "{compiler}";
char const *LLAMA_BUILD_TARGET = "{target}";
"""
NOOP_GEN = "# written by benchmarks/ik_build.py: common/build-info.cpp is written by hand (the sdist has no git)\n"


def log(msg: str) -> None:
    print(f"\033[1m[ik-build]\033[0m {msg}", file=sys.stderr, flush=True)


def home() -> Path:
    return upstream.cache_root() / NAME


def src_dir() -> Path:
    return home() / "src"


def build_dir() -> Path:
    return home() / "build"


def bin_dir() -> Path:
    return build_dir() / "bin"


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.splitlines()[0].strip() if out.strip() else "unknown"


def extract() -> Path:
    """The vendored tree of the sdist, extracted once (atomically) into ``src_dir()``, with build-info written."""
    src = src_dir()
    if (src / "CMakeLists.txt").exists():
        return src
    sdist = upstream.NEIGHBOURS[NAME]
    tarball = upstream.download_sdist(sdist)
    log(f"extracting {sdist.vendor_dir} from {tarball.name}")
    tmp = home() / "src.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    prefix = sdist.vendor_dir.rstrip("/") + "/"
    with tarfile.open(tarball) as tf:
        members = []
        for m in tf.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            m.name = m.name[len(prefix):]
            members.append(m)
        tf.extractall(tmp, members=members, filter="data")
    cc = os.environ.get("CC", "cc")
    (tmp / "common" / "build-info.cpp").write_text(
        BUILD_INFO.format(compiler=_first_line([cc, "--version"]).replace('"', "'"),
                          target=_first_line([cc, "-dumpmachine"])))
    gen = tmp / "common" / "cmake" / "build-info-gen-cpp.cmake"
    if not gen.exists():
        gen.parent.mkdir(parents=True, exist_ok=True)
        gen.write_text(NOOP_GEN)
    os.replace(tmp, src)
    return src


def _ccache_env() -> dict[str, str]:
    env = dict(os.environ)
    # the project's ccache settings (ci/env.sh), so that a rebuilt folder hits the cache
    env.setdefault("CCACHE_DIR", str(upstream.cache_root() / "ccache"))
    env.setdefault("CCACHE_BASEDIR", str(home()))
    env.setdefault("CCACHE_MAXSIZE", "5G")
    env.setdefault("CCACHE_NOHASHDIR", "1")
    return env


def build(jobs: int = 2, targets: tuple[str, ...] = TARGETS) -> Path:
    """Build ``targets`` (configure once; ninja then rebuilds nothing when nothing changed); returns ``bin_dir()``."""
    src = extract()
    bdir = build_dir()
    env = _ccache_env()
    if not (bdir / "build.ninja").exists():
        launcher = shutil.which("ccache")
        opts = list(CMAKE_OPTIONS)
        if launcher:
            opts += [f"-DCMAKE_C_COMPILER_LAUNCHER={launcher}", f"-DCMAKE_CXX_COMPILER_LAUNCHER={launcher}"]
        log(f"configuring {src} -> {bdir}")
        subprocess.run(["cmake", "-S", str(src), "-B", str(bdir), "-G", "Ninja", *opts], check=True, env=env,
                       stdout=subprocess.DEVNULL)
    missing = [t for t in targets if not (bin_dir() / t).exists()]
    t0 = time.monotonic()
    log(f"building {', '.join(targets)} (-j{jobs})" + (f"; missing: {', '.join(missing)}" if missing else ""))
    subprocess.run(["cmake", "--build", str(bdir), "-j", str(jobs), "--target", *targets], check=True, env=env)
    seconds = time.monotonic() - t0
    log(f"build done in {seconds:.0f} s")
    if missing:  # a real build (not a check): keep its time for reports
        record = home() / "build-seconds.json"
        atomic_write(record, json.dumps({"seconds": round(seconds, 1), "jobs": jobs, "targets": list(targets),
                                         "date": time.strftime("%Y-%m-%d %H:%M")}, indent=1))
    return bin_dir()


def recorded_build() -> dict | None:
    """The last real build's wall time and settings (None when never recorded)."""
    record = home() / "build-seconds.json"
    return json.loads(record.read_text()) if record.exists() else None


def tool(name: str) -> str:
    exe = bin_dir() / name
    if not exe.exists():
        sys.exit(f"missing {exe}: build ik_llama.cpp first (python benchmarks/ik_build.py)")
    return str(exe)


if __name__ == "__main__":
    print(build(jobs=int(sys.argv[1]) if len(sys.argv) > 1 else 2))

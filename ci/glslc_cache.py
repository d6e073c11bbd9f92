#!/usr/bin/env python3
"""A compile cache for glslc, the way ccache is one for the C and C++ compilers.

ggml-vulkan's ``vulkan-shaders-gen`` runs glslc once per shader variant (well over a thousand runs, most of a cold
Vulkan build on two cores). The ``vulkan`` preset names this script as ``Vulkan_GLSLC_EXECUTABLE``; it takes glslc's
command line unchanged and

- asks glslc for the files the shader reads (``-M``: preprocessing only, no compile),
- keys the result by glslc itself (path, size, time), the options (less the output paths) and the contents of every
  file read, so an edit to any included ``.glsl`` file is a miss,
- on a hit copies the SPIR-V (and writes the ``-MD -MF`` dependency file that glslc would have written), on a miss
  runs glslc and stores what it wrote, through a temporary file and a rename.

A failing compile is never stored. The cache lives in ``$S3D8_GLSLC_CACHE`` (ci/env.sh puts it beside ccache's, where
it outlives one clone of the repository); without that variable the script runs glslc as it is.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _real_glslc() -> str:
    real = os.environ.get("S3D8_GLSLC_REAL") or shutil.which("glslc")
    if not real:
        sys.exit("glslc_cache: no glslc on PATH (set S3D8_GLSLC_REAL)")
    return real


def _split(argv: list[str]) -> tuple[list[str], str | None, str | None, bool]:
    """The options that decide the output, the output file, the dependency file and whether -MD was given."""
    kept: list[str] = []
    out = depfile = None
    md = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "-o" and i + 1 < len(argv):
            out = argv[i + 1]
            i += 2
            continue
        if a == "-MF" and i + 1 < len(argv):
            depfile = argv[i + 1]
            i += 2
            continue
        if a == "-MD":
            md = True
        else:
            kept.append(a)
        i += 1
    return kept, out, depfile, md


def _dependencies(glslc: str, options: list[str]) -> list[str] | None:
    """The files the compile reads, from glslc -M ("target: a b c", possibly with line continuations)."""
    r = subprocess.run([glslc, *options, "-M"], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    text = r.stdout.replace("\\\n", " ")
    _, _, deps = text.partition(":")
    return deps.split()


def _key(glslc: str, options: list[str], deps: list[str]) -> str:
    h = hashlib.sha256()
    st = os.stat(glslc)
    h.update(f"{os.path.realpath(glslc)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    for a in options:
        # the source is named by its contents below, not by where the clone sits
        h.update((os.path.basename(a) if os.path.isfile(a) else a).encode() + b"\0")
    for d in deps:
        h.update(os.path.basename(d).encode() + b"\0")
        h.update(hashlib.sha256(Path(d).read_bytes()).digest())
    return h.hexdigest()


def _store(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=".tmp-")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main(argv: list[str]) -> int:
    glslc = _real_glslc()
    cache = os.environ.get("S3D8_GLSLC_CACHE")
    options, out, depfile, md = _split(argv)
    if not cache or out is None or out == "-" or any(a in ("-M", "-MM", "-E", "--version") for a in options):
        return subprocess.run([glslc, *argv]).returncode
    deps = _dependencies(glslc, options)
    if deps is None:
        return subprocess.run([glslc, *argv]).returncode  # glslc reports the error itself
    entry = Path(cache) / "spv" / (_key(glslc, options, deps) + ".spv")
    if entry.is_file():
        _store(entry, Path(out))
        if md and depfile:
            Path(depfile).write_text(f"{out}: {' '.join(deps)}\n")
        return 0
    r = subprocess.run([glslc, *argv], capture_output=True)
    sys.stdout.buffer.write(r.stdout)
    sys.stderr.buffer.write(r.stderr)
    if r.returncode == 0 and not r.stderr and os.path.isfile(out):
        _store(Path(out), entry)
    return r.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

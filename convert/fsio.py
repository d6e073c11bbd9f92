"""Small helpers for writing output files safely (the converter's GGUFs, qat.train's checkpoints).

Both write into a temporary file next to the final name, fsync it, ``os.replace`` it into place and fsync the
directory; a failed write (disk full, file size limit) becomes one line naming the file and the OS's reason.
See ``docs/reliability.md`` ("Converter and trainer faults").
"""

from __future__ import annotations

import os
from pathlib import Path


def write_error_reason(exc: BaseException, fd: int | None = None) -> str | None:
    """The operating system's reason (e.g. "No space left on device") for a write that raised ``exc``, or None
    when ``exc`` is not an OS-level write failure.

    Some writers lose the ``errno``: numpy's ``tofile`` (gguf-py's tensor writes) raises ``OSError("N requested
    and M written")`` for a short write, and ``torch.save`` reports a failed write of its zip records as a
    ``RuntimeError`` (the ``OSError`` at most in the exception's context). Then the chain is searched for an
    ``OSError`` with an errno, and failing that the write is repeated (one byte appended through ``fd``, the
    temporary file that is discarded anyway) to learn the reason from the OS.
    """
    e: BaseException | None = exc
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e.strerror or os.strerror(e.errno)
        e = e.__cause__ or e.__context__
    if fd is not None:
        try:
            os.write(fd, b"\0")
        except OSError as probe:
            if probe.errno is not None:
                return probe.strerror or os.strerror(probe.errno)
    return str(exc) if isinstance(exc, OSError) else None


def fsync_dir(directory: Path) -> None:
    """fsync ``directory`` so that a rename into it survives a power loss (best effort: some file systems
    refuse to fsync a directory; the rename itself has happened either way)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def default_file_mode() -> int:
    """The permission bits ``open(path, "w")`` would give a new file (0o666 less the umask); ``mkstemp``
    creates 0o600."""
    mask = os.umask(0o22)
    os.umask(mask)
    return 0o666 & ~mask

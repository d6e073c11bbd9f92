"""Writing output files safely: the one atomic-write helper of the Python tree, and the pieces around it.

:func:`atomic_path` (for writers that open a file by name: gguf-py, ``np.memmap``, matplotlib) and
:func:`atomic_file` / :func:`atomic_write` (a file object / bytes or text) all give the same guarantee: the data
goes into a temporary file next to the final name (``.<name>.<random>.partial``, mode as a plain ``open``
would give), which is fsynced, ``os.replace``d into place and its folder fsynced; on any exception the temporary
file is removed and the final name is untouched (an older file there stays as it was). Readers therefore see
either the old file or the complete new one, also after a crash or power loss.

:func:`write_error_reason` turns a failed write (disk full, file size limit) into the OS's reason, for one-line
errors naming the file (the converter's GGUFs, qat.train's checkpoints; ``docs/reliability.md``, "Converter and
trainer faults"). :func:`sha256_file` is the one file digest of the tree (downloads, model assets, results).

Standard library only, and it must stay so: ``ci/upstream.py`` runs before the virtual environment (and numpy,
which ``gguf_s3d8`` imports) exists and loads this file by its path, not through the package.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_path", "atomic_file", "atomic_write", "write_error_reason", "fsync_dir", "default_file_mode",
           "sha256_file"]


@contextmanager
def atomic_path(path: str | os.PathLike[str], *, tmp: Path | None = None) -> Iterator[Path]:
    """Yield the path of a new empty temporary file next to ``path``; when the block ends normally it is fsynced
    and renamed to ``path`` (and the folder fsynced); when it raises, it is removed. The folder must exist.

    ``tmp`` names the temporary file instead of a random name (``qat.checkpoint``'s ``.<name>.<pid>.tmp``,
    which a later run can recognise as a killed process's leftover)."""
    final = Path(path)
    folder = final.parent
    if tmp is None:
        fd, name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=folder)
        tmp = Path(name)
    else:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        try:
            os.fchmod(fd, default_file_mode())  # what a plain open() would give, not mkstemp's 0600
        finally:
            os.close(fd)
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)  # the data the block wrote, through whatever file object it used
        finally:
            os.close(fd)
        os.replace(tmp, final)
        fsync_dir(folder)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_file(path: str | os.PathLike[str], mode: str = "wb", *, encoding: str | None = None) -> Iterator[IO[Any]]:
    """``open(path, mode)`` made atomic (:func:`atomic_path`): the file appears complete when the block ends
    normally, not at all (or the old one stays) when it raises. ``mode`` is ``"wb"`` or ``"w"``."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file: mode {mode!r} (expected 'wb' or 'w')")
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=encoding if "b" not in mode else None) as f:
            yield f


def atomic_write(path: str | os.PathLike[str], data: bytes | str, *, make_parents: bool = False) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically (:func:`atomic_path`); ``make_parents``
    creates the folder first."""
    if make_parents:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


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


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes as hex, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()

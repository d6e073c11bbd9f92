"""Where the converter's encoders run: in C (``libs3d8-native``, ggml's own quantisers: llama-quantize's code and
bytes), in parallel over tensors and within them, or in numpy (``gguf_s3d8``, the tested reference twin).

``--backend auto`` (the default) takes the C library when it is built and falls back to numpy with a one-line
notice saying why; ``c`` requires the library, ``numpy`` never loads it. Both give the same bytes
(tests/python/test_native.py).

While :func:`convert.common.write_plan` writes a file it opens an :class:`Encoders` for the conversion
(:func:`encoders_for`); the producers' ``tensor_types.encode`` finds it with :func:`active` and hands the C encodings to
its worker threads, getting a :class:`Pending` back, which the writer resolves in file order. Outside a writer
(``active()`` is None) encoding is synchronous, in numpy.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Final, Iterator, Sequence

import numpy as np

from .errors import ConvertError

#: ``--backend`` choices.
BACKENDS: Final[tuple[str, ...]] = ("auto", "c", "numpy")


def default_threads() -> int:
    """All cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


#: A C job: called with the number of OpenMP threads it may use, returns the encoded bytes.
Job = Callable[[int], np.ndarray]


class Pending:
    """Encodings running on the pool (one per 2-D slice); :meth:`result` waits and returns the tensor's bytes."""

    def __init__(self, futures: Sequence[Future], finish: Callable[[list[np.ndarray]], np.ndarray]) -> None:
        self._futures = list(futures)
        self._finish = finish

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> np.ndarray:
        return self._finish([f.result() for f in self._futures])

    def cancel(self) -> None:
        for f in self._futures:
            f.cancel()


class Encoders:
    """The encoders of one conversion: the C library (or None: numpy) and ``threads`` worker threads.

    Each C job gets ``threads`` minus the other jobs running or queued when it starts OpenMP threads (at least 1):
    many tensors in flight run one thread each, a lone one (the last, or a big one) runs on all of them."""

    def __init__(self, native: object | None, threads: int) -> None:
        self.native = native  # gguf_s3d8.native.NativeCodec
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None
        self._running = 0
        self._queued = 0
        self._lock = threading.Lock()

    def submit(self, jobs: Sequence[Job], finish: Callable[[list[np.ndarray]], np.ndarray]) -> Pending:
        """Queue ``jobs`` (the 2-D slices of one tensor); ``finish`` makes the tensor's bytes of their results."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="s3d8-encode")
        with self._lock:
            self._queued += len(jobs)
        return Pending([self._pool.submit(self._run, job) for job in jobs], finish)

    def _run(self, job: Job) -> np.ndarray:
        with self._lock:
            self._queued -= 1
            omp = max(1, self.threads - self._running - self._queued)
            self._running += 1
        try:
            return job(omp)
        finally:
            with self._lock:
                self._running -= 1

    def running(self) -> int:
        with self._lock:
            return self._running

    def close(self) -> None:
        """Wait for the running jobs, drop the queued ones."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


_active: ContextVar[Encoders | None] = ContextVar("s3d8_encoders", default=None)
_noticed: set[str] = set()


def active() -> Encoders | None:
    """The encoders of the file being written (None outside :func:`convert.common.write_plan`)."""
    return _active.get()


def load_backend(backend: str, *, notice: bool = True) -> object | None:
    """The C library for ``--backend`` (None: numpy). ``auto`` without a built library: None, and (once per
    reason, with ``notice``) a one-line notice why; ``c`` without one, or a library from another build: ConvertError."""
    if backend not in BACKENDS:
        raise ConvertError(f"unknown --backend {backend!r} (known: {', '.join(BACKENDS)})")
    if backend == "numpy":
        return None
    from gguf_s3d8.native import NativeLibraryError, load_native, library_path

    try:
        return load_native()
    except NativeLibraryError as e:
        missing = not library_path().is_file()
        if backend == "c" or not missing:
            # asked for C, or a library is there but from another build: never fall back silently to other code
            raise ConvertError(f"--backend {backend}: the C encoder library is unusable: {e}") from e
        why = str(e)
        if notice and why not in _noticed:
            _noticed.add(why)
            print(f"note: encoding in numpy, several times slower than in C (same bytes): {why}", file=sys.stderr)
        return None


@contextmanager
def encoders_for(backend: str, threads: int | None, *, needed: bool = True, notice: bool = True) -> Iterator[Encoders]:
    """Open the encoders of one output file (``needed``: the file has tensors the C library encodes; ``notice``: say so
    when they run in numpy instead); closes the pool on exit, waiting for running jobs and dropping queued ones (an
    error or interrupt mid-way)."""
    enc = Encoders(load_backend(backend, notice=notice) if needed else None,
                   threads if threads and threads > 0 else default_threads())
    token = _active.set(enc)
    try:
        yield enc
    except BaseException:
        if enc.running():
            # a C call cannot be stopped: say why an interrupted conversion takes a moment to end
            print(f"stopping: waiting for {enc.running()} running C encoding(s) to finish", file=sys.stderr, flush=True)
        raise
    finally:
        _active.reset(token)
        enc.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``--backend`` and ``--threads`` (the converter's and ``python -m convert.mllama``'s)."""
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="where S3D8 (iw1), Q8_0 and BF16 are encoded: c = libs3d8-native, the patched ggml's own "
                        "quantisers (llama-quantize's code; built by `bash ci/build.sh host`, found in "
                        "build/host/lib or $S3D8_NATIVE_LIB), numpy = the gguf_s3d8 reference codec (several times "
                        "slower), auto = c when built, else numpy with a notice (default: %(default)s); the same "
                        "bytes either way (--encoder reference always runs in numpy)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="C encoder threads, over tensors and within one (default: all cores, here "
                        f"{default_threads()}); the bytes do not depend on it")

"""Architecture-independent half of the converter: plan, write atomically, report.

Every conversion is an :class:`OutputPlan` - a GGUF writer holding every key and tensor info, and the tensors'
final types, sizes and producers - made before any weight is read: by upstream's model classes for HF checkpoints
(``convert/upstream_source.py``), or by :func:`plan_from_jobs` for our own sources (``convert/gguf_source.py``, an
existing GGUF; ``convert/mllama.py``'s vision file), which describe their tensors as :class:`TensorJob` s and get
their types from ``tensor_types.choose_type``. :func:`write_plan` then

1. streams the tensors in file order (produce: load -> check finite -> encode; append); the C encodings
   (``convert.encoders``) run on worker threads meanwhile, at most ``threads + 1`` tensors ahead of the one being
   written, so memory stays at a few tensors even for an 11B model;
2. writes into a temporary file next to the output and ``os.replace`` s it into place only after the
   last byte is written and synced. Any failure - a NaN weight, a codec error, Ctrl-C, SIGTERM - removes
   the temporary file, so a failed run leaves nothing behind and never clobbers an existing output; a
   failed write (disk full, file size limit) is a one-line ConvertError naming the output and the OS's reason.
   Only a process killed outright (SIGKILL, power loss) leaves its temporary file, ``.<OUTFILE name>.<random>
   .partial``, which is never the output (docs/reliability.md).
"""

from __future__ import annotations

import math
import os
import sys
from collections import deque
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from .encoders import Pending, encoders_for
from .errors import ConvertError
from gguf_s3d8.fsio import atomic_path, write_error_reason
from .tensor_types import (S3D8Options, TypeChoice, byte_shape, choose_type, encode, encoded_dtype,
                           encoded_nbytes, is_quantisable_weight, weight_type)


@dataclass(frozen=True)
class TensorJob:
    """One output tensor: GGUF name, numpy-order shape (last axis = ggml ne0) and a float32 loader.

    ``load`` must return exactly ``shape``, already transformed into llama.cpp's layout (e.g. the q/k
    row permutation); ``source`` names the input tensor(s) for error messages.
    """

    name: str
    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    source: str


@dataclass(frozen=True)
class ConversionOptions:
    """What the user asked for."""

    out_type: str = "f16"
    fallback_type: str = "q8_0"
    s3d8: S3D8Options = S3D8Options()
    #: where the encoders run (``convert.encoders.BACKENDS``) and on how many threads (None: all cores)
    backend: str = "auto"
    threads: int | None = None


class ModelSource(Protocol):
    """What a model-specific module provides to :func:`write_gguf`."""

    #: gguf architecture name (``general.architecture``), e.g. ``"llama"``.
    arch: str

    def tensor_jobs(self) -> list[TensorJob]:
        """All output tensors in file order (cheap: shapes only, nothing loaded)."""
        ...

    def add_metadata(self, writer: gguf.GGUFWriter, options: ConversionOptions) -> None:
        """Add every KV pair. Called after all tensor infos are added (so parameter counts are known)."""
        ...


@dataclass(frozen=True)
class TensorRow:
    """One line of the conversion report."""

    name: str
    shape: tuple[int, ...]
    qtype: str
    nbytes: int
    reason: str | None


@dataclass
class ConversionReport:
    """What was written: every tensor's type and the fallbacks with their reasons."""

    outfile: Path
    requested: str
    rows: list[TensorRow] = field(default_factory=list)
    file_bytes: int = 0
    dry_run: bool = False

    @property
    def fallbacks(self) -> list[TensorRow]:
        return [r for r in self.rows if r.reason is not None]

    def type_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows:
            out[r.qtype] = out.get(r.qtype, 0) + 1
        return out

    def weight_bits_per_param(self) -> float:
        """Bits per parameter over the quantisable weights only (norms etc. excluded)."""
        rows = [r for r in self.rows if is_quantisable_weight(r.name, r.shape)]
        n = sum(math.prod(r.shape) for r in rows)
        return 8.0 * sum(r.nbytes for r in rows) / n if n else float("nan")

    def format_table(self) -> str:
        """Fallback table (tensor, shape, type written, reason) and a one-line summary."""
        lines: list[str] = []
        fb = self.fallbacks
        if fb:
            n_q = sum(1 for r in self.rows if is_quantisable_weight(r.name, r.shape))
            verb = "would not be" if self.dry_run else "could not be"
            lines.append(f"{len(fb)} of {n_q} weight matrices {verb} written as {self.requested.upper()}:")
            hdr = ("tensor", "shape (n x k)", "written as", "reason")
            body = [(r.name, " x ".join(str(s) for s in r.shape), r.qtype, r.reason or "") for r in fb]
            w = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(hdr)]
            fmt = "  ".join(f"{{:<{x}}}" for x in w[:-1]) + "  {}"
            lines.append(fmt.format(*hdr))
            lines.append(fmt.format(*("-" * x for x in w)))
            lines.extend(fmt.format(*b) for b in body)
        else:
            lines.append(f"no fallbacks: every weight matrix was written as {self.requested.upper()}")
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.type_counts().items()))
        if self.dry_run:
            data = sum(r.nbytes for r in self.rows)
            lines.append(f"dry run: would write {self.outfile} (tensor data {data / 2**20:.1f} MiB; tensors by type: "
                         f"{counts}; {self.weight_bits_per_param():.3f} bits/param over weight matrices)")
        else:
            lines.append(f"wrote {self.outfile} ({self.file_bytes / 2**20:.1f} MiB; tensors by type: {counts}; "
                         f"{self.weight_bits_per_param():.3f} bits/param over weight matrices)")
        return "\n".join(lines)


def _progress(total: int, enabled: bool):  # -> tqdm-like
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", desc="Converting", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, leave=False)


@contextmanager
def _writing(outfile: Path, writer: gguf.GGUFWriter) -> Iterator[None]:
    """Turn a failed write of the temporary output (disk full, file size limit, I/O error) into a one-line
    ConvertError naming ``outfile`` and the OS's reason; the caller removes the temporary file."""
    try:
        yield
    except OSError as e:
        fd = writer.fout[0].fileno() if writer.fout else None
        why = write_error_reason(e, fd)
        raise ConvertError(f"{outfile}: cannot write the output: {why} (nothing written; an existing file of that "
                           "name is unchanged)") from e


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of an output plan: its final type and size, and how to produce the bytes.

    ``produce()`` returns what is written (a numpy array, or a lazy tensor with ``nbytes`` and ``tofile``);
    it must have exactly ``nbytes`` bytes. ``source`` names the input tensor(s) for messages.
    """

    name: str
    shape: tuple[int, ...]
    qtype: QT
    nbytes: int
    reason: str | None
    produce: Callable[[], Any]
    source: str


@dataclass
class OutputPlan:
    """A whole output before any weight is read: the writer holds every KV pair and tensor info (no file
    yet), ``tensors`` lists the tensors in the writer's order."""

    writer: gguf.GGUFWriter
    tensors: list[PlannedTensor]
    requested: str


def check_finite(name: str, source: str, data: np.ndarray) -> None:
    """Refuse NaN / inf weights (ConvertError naming the tensor and its input)."""
    if data.dtype.kind == "f" and not np.isfinite(data).all():
        n_nan = int(np.isnan(data).sum())
        n_inf = int(np.isinf(data).sum())
        src = f" (from {source})" if source and source != name else ""
        raise ConvertError(f"tensor {name}{src} contains non-finite values ({n_nan} NaN, {n_inf} inf); "
                           "refusing to convert a broken checkpoint")


def plan_from_jobs(source: ModelSource, options: ConversionOptions) -> OutputPlan:
    """The plan of a :class:`ModelSource` (GGUF input, mllama): every tensor's type from ``choose_type``."""
    jobs = source.tensor_jobs()
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConvertError(f"duplicate output tensor names: {', '.join(dup)}")
    writer = gguf.GGUFWriter(path=None, arch=source.arch)
    planned: list[PlannedTensor] = []
    for job in jobs:
        ch: TypeChoice = choose_type(job.name, job.shape, options.out_type, options.fallback_type)
        nbytes = encoded_nbytes(job.shape, ch.qtype)
        raw = ch.qtype if encoded_dtype(ch.qtype) == np.uint8 else None  # float types: the writer reads the dtype
        writer.add_tensor_info(job.name, byte_shape(job.shape, ch.qtype), encoded_dtype(ch.qtype), nbytes, raw_dtype=raw)

        def produce(job: TensorJob = job, qtype: QT = ch.qtype) -> np.ndarray:
            data = job.load()
            if tuple(data.shape) != tuple(job.shape):
                raise ConvertError(f"tensor {job.name}: loaded shape {tuple(data.shape)} != declared {job.shape}")
            check_finite(job.name, job.source, data)
            return encode(data, qtype, name=job.name, s3d8=options.s3d8)

        planned.append(PlannedTensor(job.name, job.shape, ch.qtype, nbytes, ch.reason, produce, job.source))
    source.add_metadata(writer, options)
    return OutputPlan(writer, planned, options.out_type)


def planned_types(source: Any, options: ConversionOptions) -> dict[str, QT]:
    """GGUF name -> the type the conversion writes it with (the plan of the source, nothing read or written)."""
    own = getattr(source, "planned_tensors", None)
    if own is not None:
        return {name: qtype for name, _shape, qtype in own(options)}
    return {j.name: choose_type(j.name, j.shape, options.out_type, options.fallback_type).qtype
            for j in source.tensor_jobs()}


def make_plan(source: Any, options: ConversionOptions) -> OutputPlan:
    """The output plan of any source: its own ``plan(options)`` (upstream-driven sources) or the job-based one."""
    own = getattr(source, "plan", None)
    return own(options) if own is not None else plan_from_jobs(source, options)




def _ready(enc: Any) -> bool:
    return not isinstance(enc, Pending) or enc.done()


def write_gguf(source: Any, outfile: Path, options: ConversionOptions, *,
               progress: bool = True, dry_run: bool = False,
               before_tensor: Callable[[int, PlannedTensor], None] | None = None) -> ConversionReport:
    """Convert ``source`` into ``outfile`` atomically; returns the report (see :func:`write_plan`)."""
    return write_plan(make_plan(source, options), outfile, progress=progress, dry_run=dry_run,
                      before_tensor=before_tensor, backend=options.backend, threads=options.threads)


def write_plan(plan: OutputPlan, outfile: Path, *, progress: bool = True, dry_run: bool = False,
               before_tensor: Callable[[int, PlannedTensor], None] | None = None, backend: str = "auto",
               threads: int | None = None) -> ConversionReport:
    """Write ``plan`` into ``outfile`` atomically; returns the report.

    ``dry_run``: report the plan (whose making validated the tokenizer and config) but read no weights and
    write nothing. ``before_tensor(i, tensor)`` is a hook called before tensor ``i`` is produced (tests use it
    to inject a failure mid-way). ``backend``, ``threads``: where the encoders run (``convert.encoders``). The
    tensors are produced (read, checked) one at a time in file order; their C encodings run on ``threads`` worker
    threads meanwhile, at most ``threads + 1`` tensors ahead of the one being written.
    """
    writer = plan.writer
    report = ConversionReport(outfile=outfile, requested=plan.requested)
    report.rows = [TensorRow(t.name, t.shape, t.qtype.name, t.nbytes, t.reason) for t in plan.tensors]
    if dry_run:
        report.dry_run = True
        return report

    outfile = Path(outfile)
    out_dir = outfile.parent if str(outfile.parent) else Path(".")
    if not out_dir.is_dir():
        raise ConvertError(f"output directory {out_dir} does not exist")
    bar = None
    with ExitStack() as commit:
        with _writing(outfile, writer):
            tmp = commit.enter_context(atomic_path(outfile))  # removed again if anything below raises
        try:
            with _writing(outfile, writer):
                writer.write_header_to_file(path=tmp)
                writer.write_kv_data_to_file()
                writer.write_ti_data_to_file()
            bar = progress_bar = _progress(len(plan.tensors), progress)
            with encoders_for(backend, threads, needed=any(weight_type(t.qtype).native for t in plan.tensors),
                              notice=any(weight_type(t.qtype).slice_quantized for t in plan.tensors)) as encoders:
                queue: deque[tuple[PlannedTensor, Any]] = deque()

                def write_head() -> None:
                    t, enc = queue.popleft()
                    if isinstance(enc, Pending):
                        enc = enc.result()
                    if enc.nbytes != t.nbytes:
                        raise RuntimeError(f"tensor {t.name}: encoder produced {enc.nbytes} bytes, planned {t.nbytes}")
                    with _writing(outfile, writer):
                        writer.write_tensor_data(enc)
                    progress_bar.update(1)

                for i, t in enumerate(plan.tensors):
                    if before_tensor is not None:
                        before_tensor(i, t)
                    bar.set_postfix_str(t.name, refresh=False)
                    queue.append((t, t.produce()))
                    while queue and (len(queue) > encoders.threads + 1 or _ready(queue[0][1])):
                        write_head()
                while queue:
                    write_head()
            bar.close()
            bar = None
            assert writer.fout is not None
            with _writing(outfile, writer):
                writer.flush()
                for f in writer.fout:
                    os.fsync(f.fileno())
                writer.close()
        except BaseException:
            if bar is not None:
                bar.close()
            try:
                writer.close()  # flushing what is buffered can fail again (disk full): the file is closed regardless
            except OSError:
                writer.fout = None
            raise
        with _writing(outfile, writer):
            commit.close()  # rename into place, fsync the folder
    report.file_bytes = outfile.stat().st_size
    return report

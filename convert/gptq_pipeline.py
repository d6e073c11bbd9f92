"""GPTQ for S3D8 with llama.cpp's own tools, from an f16 GGUF, in one command.

Usable as ``python -m convert.gptq_pipeline`` (``--help``) and from ``convert/to_gguf.py --calibration-text``.
It runs ``llama-imatrix --save-xtx`` in one or more passes over the calibration text (each pass collects the X^T X
of a range of consecutive blocks, ``--xtx-layers FIRST-LAST``, sized so that its float64 sums fit ``--max-memory``:
4 k (k + 1) bytes per distinct input of width k, ``docs/hessian-format.md``), then ``llama-quantize --imatrix
--hessian F1 --hessian F2 ...`` with every pass's file (GPTQ in C for every S3D8 tensor with a matrix).

``--sequential``: pass p runs on a model whose blocks of the passes before p are already quantized exactly as in the
final file (GPTQ included) and every other tensor F16 (the input's bytes), so each block's X^T X sees the quantized
earlier blocks (the error they make is in the inputs it is fitted to). The partial model is one ``llama-quantize``
call with the final file's type and options plus one leading override, ``^(?!blk\\.(0|1|...)\\.)=f16``: llama-quantize
applies ``--tensor-type`` only when the file type is a quantized one (it is: S3D8 or Q8_0), the first matching
pattern wins, and F16 from an F16 input is the same bytes, so the weights a later pass collects for carry the input's
fingerprints (no "cannot check" warning). The importance matrix is always the first pass's (the f16 model's).

Binaries: ``$S3D8_BIN_DIR``, else ``build/host/bin``. Temporary files go into a work folder (``--work``; a fresh
one next to the output is removed at the end); the output is written to a temporary name and renamed when complete.
With ``--work DIR`` a pass whose inputs and command are unchanged is reused from DIR (a killed run resumes).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf_s3d8.fsio import atomic_path, atomic_write

from .errors import ConvertError

REPO = Path(__file__).resolve().parents[1]
SCOPES = ("last-layer", "all")
#: the scope without --scope / --gptq (all: GPTQ wherever S3D8 is written, docs/hessian-format.md)
DEFAULT_SCOPE = "all"
BUILD_COMMAND = "bash ci/build.sh host"
TOOLS = ("llama-imatrix", "llama-quantize")
GIB = 1 << 30
#: weights of one block that read the very same input (one X^T X between them, docs/hessian-format.md)
SHARED_INPUTS = (("attn_q", "attn_k", "attn_v", "attn_qkv"), ("ffn_gate", "ffn_up"))
#: the lines of a failed tool's log that an error shows
LOG_TAIL_LINES = 15
_BLOCK_WEIGHT = re.compile(r"^blk\.(\d+)\.(.+)\.weight$")


class PipelineError(ConvertError):
    """A problem with the options, the input or the environment (one line, exit status 2)."""


class ToolFailed(PipelineError):
    """A tool exited with an error: the message names the tool and ends with its log's last lines."""


# ------------------------------------------------------------------------------------------------------ planning


@dataclass(frozen=True)
class Pass:
    """One ``llama-imatrix`` pass: the X^T X of blocks ``first..last`` (``bytes``: the float64 sums it holds)."""

    first: int
    last: int
    bytes: int

    @property
    def layers(self) -> str:
        return f"{self.first}-{self.last}"


def sums_bytes(k: int) -> int:
    """Memory of one k x k matrix's sums while llama-imatrix collects them: the float64 packed triangle, 4 k (k + 1)
    bytes (docs/hessian-format.md)."""
    return 4 * k * (k + 1)


def plan_passes(block_widths: Sequence[Sequence[int]], budget: int, *, first_block: int = 0,
                max_blocks: int | None = None) -> list[Pass]:
    """Consecutive blocks grouped into passes whose sums fit ``budget`` bytes and that hold at most ``max_blocks``
    blocks with something to collect: ``block_widths[i]`` are the widths of the distinct inputs of block
    ``first_block + i`` that are collected. A block with nothing to collect costs nothing: it joins the pass around
    it, or no pass at all before the first and after the last block that has inputs. Greedy: each pass takes as
    many blocks as fit, which gives the fewest passes. A single block over the budget is an error."""
    if budget <= 0:
        raise PipelineError(f"the memory budget must be positive (got {budget} bytes)")
    if max_blocks is not None and max_blocks < 1:
        raise PipelineError(f"--blocks-per-pass {max_blocks}: give at least 1")
    passes: list[Pass] = []
    start, end, held, count = -1, -1, 0, 0
    for i, widths in enumerate(block_widths):
        if not widths:
            continue
        b = first_block + i
        need = sum(sums_bytes(k) for k in widths)
        if need > budget:
            raise PipelineError(f"block {b} alone needs {need / GIB:.2f} GiB for its X^T X sums "
                                f"({len(widths)} input(s) of width {', '.join(str(k) for k in widths)}), over the "
                                f"budget of {budget / GIB:.2f} GiB: raise --max-memory, or collect fewer weights "
                                "(--include, --scope last-layer)")
        if start >= 0 and (held + need > budget or (max_blocks is not None and count >= max_blocks)):
            passes.append(Pass(start, b - 1 if end < b - 1 else end, held))
            start, held, count = -1, 0, 0
        if start < 0:
            start = b if not passes else passes[-1].last + 1
        end, held, count = b, held + need, count + 1
    if start < 0:
        raise PipelineError("no block has a weight to collect X^T X for")
    passes.append(Pass(start, end, held))
    return passes


@dataclass(frozen=True)
class ModelInfo:
    """What planning needs of the input: its block count and, per block, the input widths of the weights collected."""

    n_blocks: int
    widths: list[list[int]]  #: per block, one width per distinct input collected
    weights: int  #: the weights collected, all blocks
    roles: tuple[str, ...] = ()  #: their names without ``blk.N.`` and ``.weight`` (e.g. ffn_down), sorted

    def include_regexes(self, include: Sequence[str]) -> list[str]:
        """What llama-imatrix's ``--xtx-include`` gets: the user's expressions, else one for the roles collected
        (so that it collects exactly the weights planned for, not those S3D8 cannot hold)."""
        if include:
            return list(include)
        return [r"\.(" + "|".join(re.escape(r) for r in self.roles) + r")\.weight$"] if self.roles else []


def _input_key(role: str) -> str:
    for group in SHARED_INPUTS:
        if role in group:
            return group[0]
    return role


def model_info(path: Path, include: Sequence[str] = ()) -> ModelInfo:
    """Read the GGUF's block count and the widths of the inputs to collect: every 2-D ``blk.N.*.weight`` whose
    column count is a multiple of 128 (what S3D8 can hold) and, with ``include``, whose name one of the regular
    expressions is found in. Weights of a block that share an input (q/k/v, gate/up) count once; every other weight
    counts as its own input (an upper bound where a model shares more)."""
    from gguf_s3d8 import series_gguf

    try:
        reader = series_gguf().GGUFReader(path)
    except (ValueError, OSError) as e:
        raise PipelineError(f"{path}: cannot read it as a GGUF file ({e})") from e
    arch = reader.fields.get("general.architecture")
    key = f"{arch.contents()}.block_count" if arch is not None else ""
    if key not in reader.fields:
        raise PipelineError(f"{path}: no {key or 'general.architecture'} key (not a llama.cpp model file?)")
    n_blocks = int(reader.fields[key].contents())
    pats = [re.compile(p) for p in include]
    inputs: list[dict[str, int]] = [{} for _ in range(n_blocks)]
    roles: set[str] = set()
    count = 0
    for t in reader.tensors:
        m = _BLOCK_WEIGHT.match(t.name)
        if m is None or len(t.shape) != 2 or int(m.group(1)) >= n_blocks:
            continue
        k = int(t.shape[0])
        if k % 128 or (pats and not any(p.search(t.name) for p in pats)):
            continue
        inputs[int(m.group(1))][_input_key(m.group(2))] = k
        roles.add(m.group(2))
        count += 1
    return ModelInfo(n_blocks, [list(d.values()) for d in inputs], count, tuple(sorted(roles)))


def default_max_memory() -> int:
    """Half the machine's physical memory, in bytes (the sums are not the only thing llama-imatrix holds)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):
        return 8 * GIB


# ------------------------------------------------------------------------------------------------------ the tools


def bin_dir() -> Path:
    env = os.environ.get("S3D8_BIN_DIR")
    return Path(env) if env else REPO / "build" / "host" / "bin"


def find_tools(directory: Path | None = None) -> dict[str, Path]:
    """llama-imatrix and llama-quantize of the build (an error naming the build command when one is missing)."""
    d = directory if directory is not None else bin_dir()
    tools = {name: d / name for name in TOOLS}
    for exe in tools.values():
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            raise PipelineError(f"{exe} not found: build the tools with `{BUILD_COMMAND}` (or set $S3D8_BIN_DIR "
                                "to a folder that has llama-imatrix and llama-quantize)")
    return tools


def run_tool(cmd: Sequence[str], log: Path, what: str) -> float:
    """Run a tool with its output into ``log``; return its wall seconds. A failure raises :class:`ToolFailed`
    with the log's last lines."""
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        try:
            rc = subprocess.run(list(cmd), stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT).returncode
        except OSError as e:
            raise ToolFailed(f"{what}: cannot start {cmd[0]}: {e.strerror or e}") from e
    if rc != 0:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()[-LOG_TAIL_LINES:]
        raise ToolFailed(f"{what} failed (exit status {rc}; log {log}), its last lines:\n  " + "\n  ".join(lines))
    return time.monotonic() - t0


# ------------------------------------------------------------------------------------------------------ the run


@dataclass(frozen=True)
class Options:
    """How to run the path (see ``--help``)."""

    text: Path
    scope: str = DEFAULT_SCOPE
    sequential: bool = False
    max_memory: int = field(default_factory=default_max_memory)
    blocks_per_pass: int | None = None
    include: tuple[str, ...] = ()
    ftype: str = "S3D8"
    tensor_types: tuple[str, ...] = ()
    ctx: int = 512
    chunks: int | None = None
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    nice: int = 0


def check_options(opts: Options) -> None:
    """The option combinations that cannot work, refused before any work."""
    if opts.scope not in SCOPES:
        raise PipelineError(f"--scope {opts.scope}: choose one of {', '.join(SCOPES)}")
    if opts.sequential and opts.scope != "all":
        raise PipelineError("--sequential needs --scope all (the last layer alone is one pass on the f16 model)")
    if not opts.text.is_file():
        raise PipelineError(f"{opts.text}: calibration text not found")
    if opts.threads < 1 or opts.ctx < 1 or (opts.chunks is not None and opts.chunks < 1):
        raise PipelineError("--threads, --ctx and --chunks must be at least 1")
    for spec in opts.tensor_types:
        if "=" not in spec or spec.startswith("=") or spec.endswith("="):
            raise PipelineError(f"--tensor-type {spec!r}: expected REGEX=TYPE")
    for p in opts.include:
        try:
            re.compile(p)
        except re.error as e:
            raise PipelineError(f"--include {p!r}: not a regular expression ({e})") from e


def plan(model: Path, opts: Options) -> tuple[ModelInfo, list[Pass]]:
    """The passes for ``model`` under ``opts`` (last-layer: one pass over the last block)."""
    info = model_info(model, opts.include)
    if info.weights == 0:
        raise PipelineError(f"{model}: no weight to collect X^T X for (2-D blk.N.*.weight with a multiple of 128 "
                            f"columns{', matching --include' if opts.include else ''})")
    if opts.scope == "last-layer":
        last = info.n_blocks - 1
        return info, plan_passes([info.widths[last]], opts.max_memory, first_block=last)
    return info, plan_passes(info.widths, opts.max_memory, max_blocks=opts.blocks_per_pass)


def finished_blocks_override(first_unfinished: int) -> str:
    """The override that keeps everything but blocks ``0 .. first_unfinished - 1`` F16 (first pattern wins)."""
    blocks = "|".join(str(b) for b in range(first_unfinished))
    return rf"^(?!blk\.({blocks})\.)=f16"


@dataclass
class Pipeline:
    """One run: ``model`` (an f16 GGUF) to ``outfile``."""

    model: Path
    outfile: Path
    opts: Options
    work: Path
    tools: dict[str, Path]
    progress: Callable[[str], None]
    includes: tuple[str, ...] = ()  #: llama-imatrix --xtx-include (ModelInfo.include_regexes)
    times: dict[str, float] = field(default_factory=dict)

    def _nice(self) -> list[str]:
        return ["nice", "-n", str(self.opts.nice)] if self.opts.nice else []

    def imatrix_cmd(self, model: Path, p: Pass, n_passes: int, im: Path, xtx: Path) -> list[str]:
        o = self.opts
        cmd = [*self._nice(), str(self.tools["llama-imatrix"]), "-m", str(model), "-f", str(o.text), "-c", str(o.ctx),
               *(["--chunks", str(o.chunks)] if o.chunks else []), "-t", str(o.threads), "-o", str(im),
               "--save-xtx", str(xtx)]
        includes = [x for inc in self.includes for x in ("--xtx-include", inc)]
        if o.scope == "last-layer" or n_passes > 1:
            # --xtx-include alone adds the matching weights of every block: name the range
            cmd += ["--xtx-layers", p.layers]
        return cmd + includes

    def quantize_cmd(self, imatrix: Path, hessians: Sequence[Path], out: Path, overrides: Sequence[str] = ()) -> list[str]:
        o = self.opts
        return [*self._nice(), str(self.tools["llama-quantize"]), "--imatrix", str(imatrix),
                *(x for h in hessians for x in ("--hessian", str(h))),
                *(x for t in (*overrides, *o.tensor_types) for x in ("--tensor-type", t)),
                str(self.model), str(out), o.ftype, str(o.threads)]

    def _identity(self, path: Path) -> list[Any]:
        st = path.stat()
        return [str(path.resolve()), st.st_size, st.st_mtime_ns]

    def _record(self, cmd: list[str], earlier: Sequence[Path]) -> dict[str, Any]:
        """What a pass's result depends on: its command and its inputs' identities (size, modification time); on a
        partial model also the earlier passes' files and the quantize options it was made with."""
        inputs: list[Any] = [self._identity(self.model), self._identity(self.opts.text)]
        if earlier:
            inputs += [self._identity(e) for e in earlier] + [self.opts.ftype, list(self.opts.tensor_types)]
        return {"cmd": cmd, "inputs": inputs}

    def run_pass(self, i: int, passes: list[Pass], done: list[Path]) -> Path:
        """Pass ``i``: its X^T X file (reused from the work folder when its record matches)."""
        p, n = passes[i], len(passes)
        im, xtx = self.work / f"pass-{i}.imatrix.gguf", self.work / f"pass-{i}.xtx.gguf"
        model = self.work / f"partial-{i}.gguf" if self.opts.sequential and i > 0 else self.model
        cmd = self.imatrix_cmd(model, p, n, im, xtx)
        record_path = self.work / f"pass-{i}.json"
        record = self._record(cmd, done if model != self.model else [])
        if xtx.is_file() and im.is_file() and record_path.is_file():
            try:
                if json.loads(record_path.read_text(encoding="utf-8")) == record:
                    self.progress(f"pass {i + 1}/{n} (blocks {p.layers}): reused {xtx}")
                    return xtx
            except ValueError:
                pass
        record_path.unlink(missing_ok=True)
        if model != self.model:
            self.progress(f"pass {i + 1}/{n}: quantizing blocks 0-{p.first - 1} (GPTQ with passes 1-{i}), the rest F16")
            with atomic_path(model) as tmp:
                self.times[f"partial-{i}"] = run_tool(
                    self.quantize_cmd(self.work / "pass-0.imatrix.gguf", done, tmp,
                                      [finished_blocks_override(p.first)]),
                    self.work / f"partial-{i}.log", f"llama-quantize (partial model for pass {i + 1})")
        self.progress(f"pass {i + 1}/{n}: llama-imatrix, X^T X of blocks {p.layers} "
                      f"({p.bytes / GIB:.2f} GiB of sums) on {model.name}")
        self.times[f"pass-{i}"] = run_tool(cmd, self.work / f"pass-{i}.log", f"llama-imatrix (pass {i + 1}/{n})")
        if model != self.model:
            model.unlink()
        atomic_write(record_path, json.dumps(record, indent=1) + "\n")
        return xtx

    def run(self, passes: list[Pass]) -> list[Path]:
        """Every pass, then the final llama-quantize into ``outfile`` (atomically); the X^T X files."""
        done: list[Path] = []
        for i in range(len(passes)):
            done.append(self.run_pass(i, passes, done))
        self.progress(f"llama-quantize --imatrix --hessian ({len(done)} file(s)) -> {self.outfile}")
        with atomic_path(self.outfile) as tmp:
            self.times["quantize"] = run_tool(self.quantize_cmd(self.work / "pass-0.imatrix.gguf", done, tmp),
                                              self.work / "quantize.log", "llama-quantize (final)")
        return done


def _stderr_progress(start: float) -> Callable[[str], None]:
    def say(msg: str) -> None:
        print(f"[gptq {time.monotonic() - start:6.0f} s] {msg}", file=sys.stderr, flush=True)

    return say


def run_pipeline(model: Path, outfile: Path, opts: Options, *, work: Path | None = None, keep_work: bool = False,
                 dry_run: bool = False, progress: Callable[[str], None] | None = None,
                 tools: dict[str, Path] | None = None) -> dict[str, float]:
    """Library entry point: ``model`` (an f16 GGUF) to ``outfile`` by the passes :func:`plan` gives; returns the
    wall seconds of each step (``pass-P``, ``partial-P``, ``quantize``). ``work``: a folder kept afterwards (and
    reused by a second run); without it a fresh folder next to ``outfile`` is removed at the end."""
    check_options(opts)
    if not model.is_file():
        raise PipelineError(f"{model}: no such file")
    if outfile.is_dir():
        raise PipelineError(f"{outfile}: is a directory; give a file name")
    if not outfile.parent.is_dir():
        raise PipelineError(f"{outfile.parent}: the output folder does not exist")
    say = progress if progress is not None else _stderr_progress(time.monotonic())
    tools = tools if tools is not None else find_tools()
    info, passes = plan(model, opts)
    what = "the last block's weights" if opts.scope == "last-layer" else f"{info.weights} weights"
    say(f"{model.name}: {info.n_blocks} blocks, X^T X of {what} in {len(passes)} pass(es) "
        f"({'sequential' if opts.sequential else 'one model'}; budget {opts.max_memory / GIB:.2f} GiB): "
        + ", ".join(f"{p.layers} ({p.bytes / GIB:.2f} GiB)" for p in passes))
    if dry_run:
        return {}
    made_work = work is None
    folder = Path(tempfile.mkdtemp(prefix=f".{outfile.name}.", suffix=".gptq", dir=outfile.parent)) if work is None \
        else work
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        pipe = Pipeline(model, outfile, opts, folder, tools, say, tuple(info.include_regexes(opts.include)))
        pipe.run(passes)
        pipe.times["total"] = time.monotonic() - t0
        say(f"wrote {outfile} in {pipe.times['total']:.0f} s")
        return pipe.times
    finally:
        if made_work and not keep_work:
            shutil.rmtree(folder, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------ CLI

_EPILOG = """\
examples:
  # GPTQ on every S3D8 tensor of llama-quantize's S3D8 file type, as many blocks per pass as 8 GiB of sums allow
  python -m convert.gptq_pipeline model-f16.gguf calibration.txt -o model-s3d8.gguf --max-memory 8
  # the anchors' setting: ffn_down S3D8 with GPTQ, Q8_0 elsewhere; sequential, 6 blocks per pass
  python -m convert.gptq_pipeline model-f16.gguf train.txt -o out.gguf --ftype Q8_0 \\
      --tensor-type '^blk\\.[0-9]+\\.ffn_down\\.weight$=s3d8' --include ffn_down --sequential --blocks-per-pass 6 \\
      --chunks 64 --threads 2
  # the last block only (the few MiB that make S3D8 + imatrix robust, docs/quality.md)
  python -m convert.gptq_pipeline model-f16.gguf calibration.txt -o model-s3d8.gguf --scope last-layer

exit status: 0 ok, 2 bad input/options or a failed tool (its last log lines are shown), 130 interrupted
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m convert.gptq_pipeline", description=__doc__,
                                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, metavar="MODEL_F16", help="the model as an f16 GGUF")
    p.add_argument("text", type=Path, metavar="CALIBRATION_TEXT", help="calibration text (llama-imatrix -f)")
    p.add_argument("-o", "--outfile", type=Path, required=True, help="the quantized GGUF to write")
    p.add_argument("--scope", choices=SCOPES, default=DEFAULT_SCOPE,
                   help="which weights get X^T X and GPTQ: all = every weight S3D8 can hold (k %% 128 == 0, "
                        "and --include), last-layer = the last block's only (default: %(default)s)")
    p.add_argument("--sequential", action="store_true",
                   help="pass p runs on the model with the blocks of passes < p already quantized (GPTQ), so "
                        "each block's X^T X sees the quantized earlier blocks (one more llama-quantize per pass; "
                        "docs/quality.md, 'Sequential GPTQ against one pass (C)')")
    p.add_argument("--max-memory", type=float, default=None, metavar="GiB",
                   help="memory for the X^T X sums of one pass, 4 k (k + 1) bytes per distinct input of width k "
                        "(default: half the machine's RAM); consecutive blocks are grouped into passes under it")
    p.add_argument("--include", action="append", default=[], metavar="REGEX",
                   help="collect X^T X only for the weights whose name this regular expression is found in "
                        "(llama-imatrix --xtx-include; repeatable), e.g. ffn_down")
    p.add_argument("--blocks-per-pass", type=int, default=None, metavar="N",
                   help="at most N blocks per pass (default: as many as --max-memory allows)")
    p.add_argument("--ftype", default="S3D8",
                   help="llama-quantize's file type (default: %(default)s; Q8_0 with --tensor-type ...=s3d8 for a "
                        "mixture of your own)")
    p.add_argument("--tensor-type", action="append", default=[], metavar="REGEX=TYPE",
                   help="llama-quantize --tensor-type (repeatable; applied only with a quantized --ftype)")
    p.add_argument("--ctx", type=int, default=512, help="llama-imatrix -c (default: %(default)s)")
    p.add_argument("--chunks", type=int, default=None, help="llama-imatrix --chunks (default: the whole text)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of both tools "
                   "(default: %(default)s)")
    p.add_argument("--nice", type=int, default=0, help="run the tools under nice -n N (default: %(default)s)")
    p.add_argument("--work", type=Path, default=None,
                   help="work folder, kept (a second run reuses the passes whose inputs did not change); default: a "
                        "temporary folder next to the output, removed at the end")
    p.add_argument("--times-json", type=Path, default=None, help="also write each step's wall seconds as JSON")
    p.add_argument("--dry-run", action="store_true", help="print the passes and run nothing")
    return p


def max_memory_bytes(gib: float | None) -> int:
    if gib is None:
        return default_max_memory()
    if not gib > 0:
        raise PipelineError(f"--max-memory {gib}: give a positive number of GiB")
    return int(gib * GIB)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = Options(text=args.text, scope=args.scope, sequential=args.sequential,
                       max_memory=max_memory_bytes(args.max_memory), blocks_per_pass=args.blocks_per_pass,
                       include=tuple(args.include), ftype=args.ftype, tensor_types=tuple(args.tensor_type),
                       ctx=args.ctx, chunks=args.chunks, threads=args.threads, nice=args.nice)
        times = run_pipeline(args.model, args.outfile, opts, work=args.work, dry_run=args.dry_run)
        if args.times_json is not None and times:
            atomic_write(args.times_json, json.dumps(times, indent=1) + "\n")
        return 0
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no output written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

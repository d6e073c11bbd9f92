"""Convert a Llama-family text model to GGUF, optionally with S3D8 weight matrices.

Usable as ``s3d8-convert``, ``python -m convert.to_gguf`` or ``python convert/to_gguf.py``.
Run with ``--help`` for the options. Exit status: 0 success, 2 bad input or options (one-line message;
``--debug`` shows the traceback), 130/143 interrupted. A failed or interrupted run writes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:
    # Run as a script: make the repository importable (and do not let this folder shadow anything),
    # then hand over to the package module so relative imports work.
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))
    from convert.to_gguf import main as _main

    raise SystemExit(_main())

import argparse
import json
import os
import signal
import traceback
from typing import Any, Sequence

from gguf_s3d8.fsio import atomic_write

from .common import ConversionOptions, ConversionReport, write_gguf
from .encoders import add_arguments as add_encoder_arguments
from .errors import ConvertError
from .gptq_pipeline import DEFAULT_SCOPE as DEFAULT_GPTQ_SCOPE
from .gptq_pipeline import SCOPES as GPTQ_SCOPES
from .tensor_types import FALLBACK_TYPES, OUT_TYPES, S3D8_ENCODERS, S3D8Options

_GGUF_MAGIC = b"GGUF"

_DESCRIPTION = """\
Convert a model to GGUF, optionally with S3D8 weight matrices.

MODEL is either an HF checkpoint directory (config.json, *.safetensors, tokenizer
files) of any architecture the pinned llama.cpp tree's convert_hf_to_gguf.py
converts (Llama, Mistral, Qwen2, Gemma 3, ...: upstream's own code plans the file
- metadata, vocabulary, tensor names and types; see docs/convert.md), or of
MllamaForConditionalGeneration (Llama 3.2 Vision: the text model, and with
--mmproj the vision encoder + projector as a second GGUF for llama-mtmd-cli /
llama-server), or an existing .gguf file (general.architecture llama), whose
tensors are dequantised and re-encoded; its metadata is kept.

The matrices upstream quantises get --type (f16/bf16/q8_0: the file is byte-
identical to upstream's); norms, biases and other small tensors stay as upstream
writes them. Matrices the requested type cannot hold get --fallback-type (S3D8:
k must be a multiple of 128 and the matrix large enough for its 128-byte header
and scales; Q8_0: k a multiple of 32, else F16), and every fallback is listed
with its reason at the end.

The output is written to a temporary file next to OUTFILE and renamed into place
when complete: an error or interruption leaves no partial file behind.
"""

_EPILOG = """\
examples:
  %(prog)s path/to/SmolLM2-hf --type f16 -o smollm2-f16.gguf
  %(prog)s path/to/Llama-3.2-1B --type s3d8 --centroid-rule round -o llama-s3d8.gguf
  %(prog)s SmolLM2-135M-Instruct.Q4_1.gguf --type q8_0 -o smollm2-q8_0.gguf
  %(prog)s path/to/Llama-3.2-11B-Vision-Instruct --type s3d8 -o mllama-s3d8.gguf --mmproj mmproj-f16.gguf \
      --mmproj-type f16
  python -m qat.export run/checkpoint.pt -o run/checkpoint.s3d8.safetensors     # then:
  %(prog)s path/to/SmolLM2-hf --type s3d8 --qat-checkpoint run/checkpoint.s3d8.safetensors -o smollm2-qat-s3d8.gguf
  python -m qat.gptq_s3d8 --model path/to/SmolLM2-hf --calibration wiki.txt -o gptq.safetensors   # then:
  %(prog)s path/to/SmolLM2-hf --type s3d8 --gptq-checkpoint gptq.safetensors -o smollm2-gptq-s3d8.gguf
  %(prog)s path/to/SmolLM2-hf --type s3d8 --calibration-text wiki.txt -o smollm2-gptq-s3d8.gguf   # GPTQ in C

exit status: 0 ok, 2 bad input/options, 130 interrupted (143 on SIGTERM)
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="s3d8-convert", description=_DESCRIPTION, epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, metavar="MODEL", help="HF checkpoint directory or .gguf file")
    p.add_argument("-o", "--outfile", type=Path, metavar="OUTFILE",
                   help="output .gguf path (default: ./<model name>-<TYPE>.gguf)")
    p.add_argument("--type", dest="out_type", choices=OUT_TYPES, default="f16",
                   help="type of the big weight matrices (default: %(default)s)")
    p.add_argument("--fallback-type", choices=FALLBACK_TYPES, default="q8_0",
                   help="type for matrices --type cannot hold (default: %(default)s; "
                        "Q8_0 itself falls back to F16 when k %% 32 != 0)")
    p.add_argument("--centroid-rule", choices=("round", "trunc"), default=None,
                   help="S3D8 codebook centroids: rounded or truncated to integers "
                        "(default: the codec's DEFAULT_CENTROID_RULE)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the S3D8 codebook fit; same seed, same file (default: %(default)s)")
    p.add_argument("--imatrix", type=Path, metavar="FILE", default=None,
                   help="importance matrix from llama-imatrix (GGUF or legacy .dat) for the S3D8 encoder: the "
                        "codebook and scales then minimise the error weighted by each input column's importance "
                        "(the same bytes as llama-quantize --imatrix); without it, and for tensors it lacks, the "
                        "encoder weights each column by its largest weight (data-free, see docs/codec.md)")
    p.add_argument("--encoder", choices=S3D8_ENCODERS, default="iw1",
                   help="S3D8 encoder: iw1 = importance-aware search (with or without --imatrix; what "
                        "llama-quantize runs), reference = the format's reference encoder (absmax scales, plain "
                        "MSE codebook; what QAT's fake quantiser computes) (default: %(default)s)")
    add_encoder_arguments(p)
    p.add_argument("--mmproj", type=Path, metavar="PATH", default=None,
                   help="Llama 3.2 Vision (mllama) only: also write the vision encoder + projector GGUF for mtmd")
    p.add_argument("--mmproj-type", choices=OUT_TYPES, default=None,
                   help="type of the vision matrices with --mmproj (default: same as --type)")
    p.add_argument("--qat-checkpoint", type=Path, metavar="PATH", default=None,
                   help="write the trained student exported by python -m qat.export CHECKPOINT -o PATH (its S3D8 "
                        "containers with the frozen codebooks and scales, and its fp32 weights; MODEL is the "
                        "teacher's HF directory, for config and tokenizer): the file's dequantised weights equal the "
                        "student's fake-quantised ones bit for bit (with --mmproj also the vision file's; "
                        "--mmproj-type must be the training's --vision-type)")
    p.add_argument("--gptq-checkpoint", type=Path, metavar="PATH", default=None,
                   help="write the S3D8 containers of a GPTQ run (python -m qat.gptq_s3d8 -o PATH) verbatim for the "
                        "tensors it holds; they must be S3D8 in this conversion and made from these very weights")
    p.add_argument("--calibration", type=Path, metavar="FILE", default=None, help=argparse.SUPPRESS)  # moved: error
    g = p.add_argument_group("GPTQ in C (llama-imatrix --save-xtx, llama-quantize --hessian; docs/convert.md)")
    g.add_argument("--calibration-text", type=Path, metavar="FILE", default=None,
                   help="run GPTQ with the build's tools: convert MODEL to f16 (into a work folder), collect the "
                        "importance matrix and the X^T X of the weights' inputs on FILE with llama-imatrix (in passes "
                        "that fit --max-memory), then write OUTFILE with llama-quantize --imatrix --hessian ... S3D8 "
                        "(needs --type s3d8; binaries from $S3D8_BIN_DIR or build/host/bin)")
    g.add_argument("--gptq", choices=GPTQ_SCOPES, default=None,
                   help=f"with --calibration-text: which weights get GPTQ: all = every S3D8 weight, last-layer = the "
                        f"last block's (the rest iw1 with the imatrix) (default: {DEFAULT_GPTQ_SCOPE})")
    g.add_argument("--gptq-sequential", action="store_true",
                   help="with --calibration-text: each pass's X^T X from the model with the earlier passes' blocks "
                        "already quantized (slower: one llama-quantize per pass; docs/quality.md, 'Sequential GPTQ "
                        "against one pass (C)')")
    g.add_argument("--max-memory", type=float, default=None, metavar="GiB",
                   help="with --calibration-text: memory for one pass's X^T X sums (default: half the RAM)")
    g.add_argument("--calibration-chunks", type=int, default=None, metavar="N",
                   help="with --calibration-text: llama-imatrix --chunks N of 512 tokens (default: the whole text)")
    p.add_argument("--tokenizer-pre", metavar="NAME", default=None,
                   help="llama.cpp pre-tokenizer name (tokenizer.ggml.pre) when it cannot be detected, "
                        "e.g. llama-bpe or smollm")
    p.add_argument("--report-json", type=Path, metavar="PATH", default=None,
                   help="also write the per-tensor report (name, shape, type, bytes, fallback reason) as JSON")
    p.add_argument("--dry-run", action="store_true",
                   help="check the input and print the type plan and fallback table; read no weights, write nothing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    return p


def open_source(model: Path, *, tokenizer_pre: str | None = None, verbose: bool = False) -> Any:
    """The model source for an HF directory (upstream's model class for its architecture, mllama's from the
    series) or a GGUF file (raises ConvertError for unusable input)."""
    if not model.exists():
        raise ConvertError(f"{model}: no such file or directory")
    if model.is_file():
        with open(model, "rb") as f:
            magic = f.read(4)
        if magic != _GGUF_MAGIC:
            raise ConvertError(f"{model}: not a GGUF file (expected an HF checkpoint directory or a .gguf file)")
        from .gguf_source import GgufSource

        return GgufSource(model)
    from .upstream_source import UpstreamSource

    return UpstreamSource(model, tokenizer_pre=tokenizer_pre, verbose=verbose)


def default_outfile(model: Path, out_type: str) -> Path:
    stem = model.stem if model.is_file() else model.resolve().name
    return Path.cwd() / f"{stem}-{out_type.upper()}.gguf"


def convert(model: Path, outfile: Path, options: ConversionOptions, *, tokenizer_pre: str | None = None,
            progress: bool = True, dry_run: bool = False, qat_checkpoint: Path | None = None,
            qat_tensors: Any = None) -> ConversionReport:
    """Library entry point: convert ``model`` (with the weights of ``qat_checkpoint``, a ``qat.export`` file,
    if given; ``qat_tensors``: that file already read by :func:`convert.qat_checkpoint.read_qat_export`) to
    ``outfile`` (atomically) and return the report."""
    if options.out_type == "s3d8" or options.fallback_type == "s3d8":
        from .tensor_types import s3d8_codec

        s3d8_codec()  # fail early, before any work, if the codec is missing
    if outfile.exists() and outfile.is_dir():
        raise ConvertError(f"{outfile}: is a directory; give a file name with --outfile")
    source = open_source(model, tokenizer_pre=tokenizer_pre)
    if qat_checkpoint is not None:
        from .qat_checkpoint import apply_qat_export, check_teacher, read_qat_export

        tensors = qat_tensors if qat_tensors is not None else read_qat_export(qat_checkpoint)
        check_teacher(model, tensors, qat_checkpoint)
        source, options = apply_qat_export(source, tensors, qat_checkpoint, options)
    return write_gguf(source, outfile, options, progress=progress, dry_run=dry_run)


def _write_report_json(report: ConversionReport, path: Path) -> None:
    rows = [{"name": r.name, "shape": list(r.shape), "type": r.qtype, "nbytes": r.nbytes, "fallback_reason": r.reason}
            for r in report.rows]
    atomic_write(path, json.dumps({"outfile": str(report.outfile), "requested": report.requested,
                                   "file_bytes": report.file_bytes, "tensors": rows}, indent=1) + "\n")


class _Terminated(SystemExit):
    """SIGTERM, raised in the main thread so the temporary output is cleaned up like on Ctrl-C."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated(143)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    outfile: Path = args.outfile if args.outfile is not None else default_outfile(args.model, args.out_type)
    old = signal.signal(signal.SIGTERM, _on_sigterm) if _in_main_thread() else None
    try:
        if args.threads is not None and args.threads < 1:
            raise ConvertError(f"--threads {args.threads}: give at least 1")
        if _gptq_requested(args):
            return _convert_with_gptq(args, outfile)
        options = ConversionOptions(out_type=args.out_type, fallback_type=args.fallback_type,
                                    s3d8=S3D8Options(centroid_rule=args.centroid_rule, seed=args.seed,
                                                     encoder=args.encoder, imatrix=_load_imatrix(args)),
                                    backend=args.backend, threads=args.threads)
        if args.mmproj is not None:
            _check_mmproj_args(args)
        mopts = ConversionOptions(out_type=args.mmproj_type or args.out_type, fallback_type=args.fallback_type,
                                  s3d8=options.s3d8, backend=args.backend, threads=args.threads)
        if args.calibration is not None:
            raise ConvertError("the converter no longer runs GPTQ: run `python -m qat.gptq_s3d8 --model MODEL "
                               "--calibration FILE -o gptq.safetensors` first, then convert with --gptq-checkpoint "
                               "gptq.safetensors (docs/convert.md)")
        if args.gptq_checkpoint is not None:
            options, mopts = _with_gptq(args, options, mopts)
        qat = None
        if args.qat_checkpoint is not None:
            from .qat_checkpoint import read_qat_export

            qat = read_qat_export(args.qat_checkpoint)  # read once, for both outputs
        report = convert(args.model, outfile, options, tokenizer_pre=args.tokenizer_pre, progress=not args.no_progress,
                         dry_run=args.dry_run, qat_checkpoint=args.qat_checkpoint, qat_tensors=qat)
        print(report.format_table())
        if args.mmproj is not None:
            from .mllama import vision_source

            vision: Any = vision_source(args.model)  # an UpstreamSource, or the checkpoint-replaced one
            if qat is not None:
                from .qat_checkpoint import apply_qat_export

                vision, mopts = apply_qat_export(vision, qat, args.qat_checkpoint, mopts)
            print(write_gguf(vision, args.mmproj, mopts, progress=not args.no_progress,
                             dry_run=args.dry_run).format_table())
        if args.report_json is not None:
            _write_report_json(report, args.report_json)
        return 0
    except ConvertError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # unreadable input, unwritable output directory, disk full, ...
        if args.debug:
            traceback.print_exc()
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no output written", file=sys.stderr)
        return 130
    except _Terminated:
        print("terminated: no output written", file=sys.stderr)
        return 143
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _gptq_requested(args: argparse.Namespace) -> bool:
    return (args.calibration_text is not None or args.gptq is not None or args.gptq_sequential
            or args.max_memory is not None or args.calibration_chunks is not None)


def _gptq_options(args: argparse.Namespace) -> Any:
    """--calibration-text and its options, checked against the rest before any work (a convert.gptq_pipeline
    Options)."""
    from .gptq_pipeline import Options, check_options, max_memory_bytes

    if args.calibration_text is None:
        raise ConvertError("--gptq, --gptq-sequential, --max-memory and --calibration-chunks need --calibration-text "
                           "FILE")
    clashes = [name for name, given in (
        ("--imatrix (the passes compute it)", args.imatrix is not None),
        ("--qat-checkpoint", args.qat_checkpoint is not None), ("--gptq-checkpoint", args.gptq_checkpoint is not None),
        ("--mmproj", args.mmproj is not None), ("--report-json", args.report_json is not None),
        ("--encoder reference", args.encoder != "iw1"), ("--centroid-rule", args.centroid_rule is not None),
        ("--seed", args.seed != 0), ("--fallback-type other than q8_0", args.fallback_type != "q8_0")) if given]
    if clashes:
        raise ConvertError(f"--calibration-text runs llama-quantize's S3D8 file type (iw1 at seed 0, Q8_0 fallback): "
                           f"it does not take {', '.join(clashes)}")
    if args.out_type != "s3d8":
        raise ConvertError("--calibration-text writes S3D8 with GPTQ: add --type s3d8")
    opts = Options(text=args.calibration_text, scope=args.gptq or DEFAULT_GPTQ_SCOPE, sequential=args.gptq_sequential,
                   max_memory=max_memory_bytes(args.max_memory), chunks=args.calibration_chunks,
                   threads=args.threads if args.threads is not None else (os.cpu_count() or 1))
    check_options(opts)
    return opts


def _convert_with_gptq(args: argparse.Namespace, outfile: Path) -> int:
    """MODEL to f16 in a work folder next to OUTFILE, then convert.gptq_pipeline into OUTFILE."""
    import shutil
    import tempfile

    from .gptq_pipeline import find_tools, run_pipeline

    opts = _gptq_options(args)
    tools = find_tools()
    if outfile.is_dir():
        raise ConvertError(f"{outfile}: is a directory; give a file name with --outfile")
    if not outfile.parent.is_dir():
        raise ConvertError(f"{outfile.parent}: the output folder does not exist")
    f16_options = ConversionOptions(out_type="f16", backend=args.backend, threads=args.threads)
    if args.dry_run:
        print(convert(args.model, outfile, f16_options, tokenizer_pre=args.tokenizer_pre, dry_run=True).format_table())
        print(f"then GPTQ ({opts.scope}{', sequential' if opts.sequential else ''}) with llama-imatrix and "
              f"llama-quantize from {tools['llama-quantize'].parent} on {opts.text}; passes planned on the f16 file")
        return 0
    work = Path(tempfile.mkdtemp(prefix=f".{outfile.name}.", suffix=".gptq", dir=outfile.parent))
    try:
        f16 = work / "model-f16.gguf"
        print(convert(args.model, f16, f16_options, tokenizer_pre=args.tokenizer_pre,
                      progress=not args.no_progress).format_table())
        run_pipeline(f16, outfile, opts, work=work / "passes", tools=tools)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _with_gptq(args: argparse.Namespace, options: ConversionOptions,
               mopts: ConversionOptions) -> tuple[ConversionOptions, ConversionOptions]:
    """--gptq-checkpoint: the GPTQ containers, checked against the type plan of every output before any work."""
    from .gptq_checkpoint import apply_gptq_file, read_gptq_file

    if args.qat_checkpoint is not None:
        raise ConvertError("--qat-checkpoint already fixes the S3D8 weights; to train from a GPTQ start use "
                           "python -m qat.train --init-from GPTQ_FILE, then python -m qat.export and --qat-checkpoint")
    if "s3d8" not in (args.out_type, args.mmproj_type):
        raise ConvertError("--gptq-checkpoint writes S3D8 containers: add --type s3d8")
    if args.imatrix is not None:
        raise ConvertError("--imatrix and GPTQ exclude each other (GPTQ takes the importance from its calibration data)")
    outputs = [(open_source(args.model, tokenizer_pre=args.tokenizer_pre), options)]
    if args.mmproj is not None:
        from .mllama import vision_source

        outputs.append((vision_source(args.model), mopts))
    tensors, where = read_gptq_file(args.gptq_checkpoint), args.gptq_checkpoint
    new = apply_gptq_file(outputs, tensors, where)
    return new[0], new[1] if len(new) > 1 else mopts


def _load_imatrix(args: argparse.Namespace) -> object | None:
    """The --imatrix file, read and checked before any work (None without --imatrix)."""
    if args.imatrix is None:
        return None
    if "s3d8" not in (args.out_type, args.mmproj_type):
        raise ConvertError("--imatrix is used by the S3D8 encoder only: add --type s3d8")
    if args.encoder != "iw1":
        raise ConvertError("--imatrix needs --encoder iw1 (the reference encoder does not use importance)")
    from gguf_s3d8.imatrix import ImatrixError, read_imatrix

    try:
        return read_imatrix(args.imatrix)
    except ImatrixError as e:
        raise ConvertError(str(e)) from e


def _check_mmproj_args(args: argparse.Namespace) -> None:
    """--mmproj needs an mllama HF directory and a second output path; checked before any work."""
    from .mllama import is_mllama

    if args.model.is_file() or not is_mllama(args.model):
        raise ConvertError(f"{args.model}: --mmproj needs an HF MllamaForConditionalGeneration directory")
    if args.outfile is not None and args.mmproj.resolve() == args.outfile.resolve():
        raise ConvertError("--mmproj and --outfile name the same file")


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    raise SystemExit(main())

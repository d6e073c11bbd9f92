"""Command line: ``python -m gguf_s3d8 {inspect,dump} FILE`` (also installed as ``s3d8-inspect FILE``).

inspect  list every tensor (name, type, shape, bits per weight, S3D8 codebook summary), validate every S3D8
         container and print a summary; exit status 1 if any container is corrupt, 2 if the file cannot
         be read.
dump     run the series' gguf-py's gguf-dump (which knows S3D8), so S3D8 tensors are listed (all gguf-dump options
         pass through, e.g. ``--markdown``, ``--json``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

_COMMANDS = ("inspect", "dump")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gguf_s3d8",
        description="Inspect and verify S3D8 tensors in GGUF files. A bare FILE means 'inspect FILE'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  python -m gguf_s3d8 inspect model.gguf\n  python -m gguf_s3d8 dump model.gguf --markdown",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{inspect,dump}")
    pi = sub.add_parser("inspect", help="list tensors, summarise codebooks and validate every S3D8 container",
                        description="List every tensor (name, type, shape, bits per weight, codebook summary), "
                                    "validate each S3D8 container and print a summary. Exit status: 0 all "
                                    "valid, 1 some S3D8 container corrupt, 2 file unreadable.")
    pi.add_argument("file", help="GGUF file")
    pi.add_argument("--quiet", "-q", action="store_true", help="print only errors and the summary line")
    pd = sub.add_parser("dump", help="the series' gguf-dump, which knows S3D8 (options pass through)", add_help=False)
    pd.add_argument("args", nargs=argparse.REMAINDER, help="arguments for gguf-dump (FILE and its options)")
    return p


def _inspect(path: str, quiet: bool) -> int:
    import io

    from .inspection import inspect_gguf, print_report

    try:
        report = inspect_gguf(path)
    except Exception as e:  # unreadable / not GGUF: report and fail cleanly
        print(f"error: cannot read {path!r} as GGUF: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    buf = io.StringIO()
    print_report(report, buf)
    text = buf.getvalue()
    print(text.splitlines()[-1] if quiet else text.rstrip("\n"))
    for err in report.errors:
        print(f"error: {err}", file=sys.stderr)
    if report.errors:
        print(f"FAILED: {len(report.errors)} corrupt S3D8 container(s)", file=sys.stderr)
        return 1
    n = sum(1 for t in report.tensors if t.codebook is not None)
    print(f"OK: {n} S3D8 tensor(s) verified")
    return 0


def _dump(args: list[str]) -> int:
    from .gguf_py import series_gguf

    series_gguf()
    from gguf.scripts import gguf_dump

    saved = sys.argv
    sys.argv = ["gguf-dump", *args]
    try:
        gguf_dump.main()
    finally:
        sys.argv = saved
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] not in _COMMANDS and not args[0].startswith("-"):
        args.insert(0, "inspect")
    if args and args[0] == "dump":  # everything after 'dump' belongs to gguf-dump, options included
        return _dump(args[1:])
    ns = _parser().parse_args(args)
    if ns.command == "inspect":
        return _inspect(ns.file, ns.quiet)
    return _dump(ns.args)


if __name__ == "__main__":
    sys.exit(main())

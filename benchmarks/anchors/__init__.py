"""The parts of ``benchmarks/quality_anchors.py`` (the CLI): model, gguf_dir, parsers, runner, bench, report,
each importing only those before it."""

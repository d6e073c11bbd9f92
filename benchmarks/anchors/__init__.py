"""The parts of ``benchmarks/quality_anchors.py`` (the CLI): model, gguf_dir, parsers, runner, variants, bench, targets,
report, each importing only those before it."""

"""What the benchmark scripts share: the repository's paths, the host build's tools, logged commands, the CPU's
name, paths as reports show them and the raw results kept next to a report. Every script of ``benchmarks/`` imports it
first: importing it puts the repository root and ``ci/`` on ``sys.path``, so the scripts can import the project's
packages (``gguf_s3d8``, ``convert``, ``qat``) and ``ci/upstream.py`` when run as ``python benchmarks/<script>.py``;
no script sets ``sys.path`` itself. Files they write go through ``gguf_s3d8.fsio`` (``atomic_write``,
``atomic_path``), sections of a report through ``report_sections.write_section``.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "work" / "llama.cpp"
BUILD = ROOT / "build" / "host"

for _folder in (ROOT, ROOT / "ci"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Run a command (echoed to stderr), failing on a non-zero exit."""
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, **kw)


def tool(name: str) -> str:
    """A binary of the host build; exits with the command that builds it when it is missing."""
    exe = BUILD / "bin" / name
    if not exe.exists():
        sys.exit(f"missing {exe}: build the host preset first (bash ci/build.sh host)")
    return str(exe)


def shown(path: Path) -> Path:
    """A path as a report shows it: relative to the repository when inside it."""
    path = path.resolve()
    return path.relative_to(ROOT) if ROOT in path.parents else path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def data_file(doc: Path, name: str) -> Path:
    """Where the raw results of report ``doc`` are kept: ``data/`` in its folder (docs/data/), made if missing."""
    (doc.parent / "data").mkdir(parents=True, exist_ok=True)
    return doc.parent / "data" / name


def image_file(doc: Path, name: str) -> Path:
    """Where the plots of report ``doc`` go: ``img/`` in its folder (docs/img/), made if missing."""
    (doc.parent / "img").mkdir(parents=True, exist_ok=True)
    return doc.parent / "img" / name


def doc_link(doc: Path, path: Path) -> str:
    """``path`` as a markdown link in report ``doc``: relative to the report's folder."""
    return path.relative_to(doc.parent).as_posix()


def keep_raw_results(raw: Path, kept: Path, report_only: bool) -> Path:
    """The raw results a report is written from, kept beside it (``kept``, in docs/data/): a measuring run copies its
    fresh ``raw`` file there; ``--report-only`` reuses the kept copy (on a fresh clone there is no ``raw``) and
    copies ``raw`` only when nothing is kept yet. Exits with the reason when neither exists."""
    if not report_only or not kept.exists():
        if not raw.exists():
            sys.exit(f"no raw results in {shown(raw)} or {shown(kept)}: run without --report-only first")
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(raw, kept)
    return kept


def write_llama_layer(path: Path, n_embd: int, n_ff: int, matrix: Callable[[str, tuple[int, int]], Any],
                      tokenizer: Path | None = None) -> None:
    """A one-layer Llama GGUF (f16 matrices, 32 heads, 8 KV heads) whose seven layer matrices are
    ``matrix(name, (rows, cols))`` (``attn_q`` .. ``ffn_down``). Without ``tokenizer``: a 256-token vocabulary too
    small for S3D8, embeddings zero, no tokenizer (llama-quantize reads it, nothing can tokenize text for it). With
    ``tokenizer`` (a GGUF model file): its ``tokenizer.*`` keys and arrays are copied, so llama-imatrix and
    llama-perplexity can read text, and ``token_embd`` (tied output) has the tokenizer's vocabulary as rows, filled
    by ``matrix("token_embd", (n_vocab, n_embd))``."""
    import gguf_s3d8  # noqa: F401  (the series' gguf-py, which knows S3D8)
    import gguf
    import numpy as np

    n_vocab, tok_fields = 256, []
    if tokenizer is not None:
        r = gguf.GGUFReader(tokenizer)
        tok_fields = [(n, f) for n, f in r.fields.items() if n.startswith("tokenizer.")]
        n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    kv = n_embd // 4
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(32)
    w.add_head_count_kv(8)
    w.add_rope_dimension_count(n_embd // 32)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, f in tok_fields:
        vt = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vt, sub_type=sub)
    embd = (np.asarray(matrix("token_embd", (n_vocab, n_embd))) if tokenizer is not None
            else np.zeros((n_vocab, n_embd)))
    w.add_tensor("token_embd.weight", embd.astype(np.float16))
    del embd
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, np.float32))
    for name, shape in (("attn_q", (n_embd, n_embd)), ("attn_k", (kv, n_embd)), ("attn_v", (kv, n_embd)),
                        ("attn_output", (n_embd, n_embd)), ("ffn_gate", (n_ff, n_embd)), ("ffn_up", (n_ff, n_embd)),
                        ("ffn_down", (n_embd, n_ff))):
        w.add_tensor(f"blk.0.{name}.weight", np.asarray(matrix(name, shape)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

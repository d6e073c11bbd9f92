"""Shared pieces of the mllama tests: locating the binaries, converting the tiny checkpoint, running the dump tool.

The binaries come from ``$S3D8_BIN_DIR`` (default ``<repo>/build/host/bin``); a missing binary is a test
*failure* with the command that builds it, never a skip.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]


def bin_dir() -> Path:
    return Path(os.environ.get("S3D8_BIN_DIR", REPO_ROOT / "build" / "host" / "bin"))


def binary(name: str) -> Path:
    path = bin_dir() / name
    if not path.is_file() or not os.access(path, os.X_OK):
        import pytest

        pytest.fail(f"{path} is missing: build it with `cmake --build --preset host` (target {name}) "
                    f"or point S3D8_BIN_DIR at the folder that holds it", pytrace=False)
    return path


def _code_hash() -> str:
    """Hash of everything a conversion runs: this project's converter and codec, and the patched tree's converter and
    gguf-py (upstream's code with the series' patches applied: a patch to either, or another pin, changes the bytes);
    cached conversions are redone when any of it changes."""
    import hashlib

    h = hashlib.sha256()
    files = [p for folder in ("convert", "gguf_s3d8") for p in sorted((REPO_ROOT / folder).glob("*.py"))]
    tree = REPO_ROOT / "work" / "llama.cpp"
    files += sorted(tree.glob("convert_hf_to_gguf*.py")) + sorted((tree / "gguf-py" / "gguf").rglob("*.py"))
    for f in files + [Path(__file__)]:  # this file too: it sets the conversion options
        h.update(str(f.relative_to(REPO_ROOT) if f.is_relative_to(REPO_ROOT) else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def convert(model_dir: Path, out_dir: Path | None = None, out_type: str = "f32") -> tuple[Path, Path]:
    """Text and mmproj GGUFs of the checkpoint (written once per out_dir).

    Without out_dir, the files are cached next to the checkpoint, keyed by the type and the converter/codec
    sources (an S3D8 conversion takes minutes; each file is written atomically by the converter).
    """
    from convert.common import ConversionOptions
    from convert.mllama import convert as convert_mllama
    from convert.tensor_types import S3D8Options

    if out_dir is None:
        out_dir = model_dir.parent / f"{model_dir.name}-gguf" / f"{out_type}-{_code_hash()}"
        out_dir.mkdir(parents=True, exist_ok=True)
    text = out_dir / f"text-{out_type}.gguf"
    mmproj = out_dir / f"mmproj-{out_type}.gguf"
    if not (text.is_file() and mmproj.is_file()):
        # the parity tests check the model and the kernels, not the encoder: the format's reference encoder
        # keeps the inputs (and the greedy-token margins measured on them) independent of encoder changes
        opts = ConversionOptions(out_type=out_type, s3d8=S3D8Options(encoder="reference"))
        convert_mllama(model_dir, text, opts, mmproj=mmproj, tokenizer_pre="llama-bpe", progress=False)
    return text, mmproj


@dataclass
class Dump:
    prompt_logits: np.ndarray
    step_logits: np.ndarray
    tokens: list[int]
    cross: list[np.ndarray]
    log: str  # stderr of the run (llama.cpp's log)
    cross_valid: list[int]  # rows of each image's states that are not padding (its own tiles)


def run_dump(text: Path, tokens: Sequence[int], out_dir: Path, *, mmproj: Path | None = None,
             images: Sequence[Path] = (), cross: Sequence[tuple[Path, int]] = (), n_steps: int = 0,
             cache_type: str = "f32", cross_type: str | None = None, flash_attn: str = "off",
             extra: Sequence[str] = (), env: dict[str, str] | None = None, timeout: float = 120,
             image_max_tiles: int | None = None) -> Dump:
    """Run llama-mllama-dump; cache_type is the self-attention K/V type, cross_type the cross-attention store's
    (default: the same), env adds environment variables (e.g. LLAMA_ATTN_ROT_DISABLE), image_max_tiles caps the
    tiles of an image (--image-max-tiles; default: the projector's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [str(binary("llama-mllama-dump")), "-m", str(text), "--tokens", ",".join(str(t) for t in tokens),
           "--n-steps", str(n_steps), "-ctk", cache_type, "-ctv", cache_type, "-fa", flash_attn, "-t", "2",
           "-o", str(out_dir)]
    if mmproj is not None:
        cmd += ["--mmproj", str(mmproj)]
    for img in images:
        cmd += ["--image", str(img)]
    for path, n_valid in cross:
        cmd += ["--cross", str(path), "--n-valid", str(n_valid)]
    if cross_type is not None:
        cmd += ["-ctkx", cross_type, "-ctvx", cross_type]
    if image_max_tiles is not None:
        cmd += ["--image-max-tiles", str(image_max_tiles)]
    cmd += list(extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if p.returncode != 0:
        raise AssertionError(f"llama-mllama-dump failed ({p.returncode}):\n{' '.join(cmd)}\n{p.stderr[-4000:]}")
    n_cross = len(images) + len(cross)
    return Dump(np.load(out_dir / "prompt_logits.npy"), np.load(out_dir / "step_logits.npy"),
                [int(t) for t in np.load(out_dir / "tokens.npy")],
                [np.load(out_dir / f"cross_{i}.npy") for i in range(n_cross)], p.stderr,
                [int(v) for v in np.load(out_dir / "cross_valid.npy")])

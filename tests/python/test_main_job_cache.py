"""The main job's cache (tools/main_job.py): a file made by other tools or inputs is made again, never measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import main_job  # type: ignore[import-not-found]  # noqa: E402


def test_a_cached_file_is_remade_when_its_signature_changes(tmp_path: Path) -> None:
    out = tmp_path / "model.gguf"
    assert main_job.stale(out, ["tool-a", "imatrix-1"])  # missing
    out.write_bytes(b"old")
    assert main_job.stale(out, ["tool-a", "imatrix-1"])  # made before made.json knew it: removed, made again
    assert not out.exists()
    out.write_bytes(b"new")
    main_job.record_made(out, ["tool-a", "imatrix-1"])
    assert not main_job.stale(out, ["tool-a", "imatrix-1"]) and out.read_bytes() == b"new"
    assert main_job.stale(out, ["tool-b", "imatrix-1"]) and not out.exists()  # a rebuilt llama-quantize
    other = tmp_path / "other.gguf"
    other.write_bytes(b"x")
    main_job.record_made(other, ["s"])
    assert set(json.loads((tmp_path / "made.json").read_text())) == {"model.gguf", "other.gguf"}


def test_the_signatures_follow_the_bytes(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"1")
    b.write_bytes(b"1")
    d = main_job._digest([a])
    assert main_job._digest([b]) != d  # the same bytes under another name: the name is part of the digest
    assert main_job._digest([a]) == d
    a.write_bytes(b"2")
    assert main_job._digest([a]) != d
    assert len(main_job._encoder_digest()) == 16

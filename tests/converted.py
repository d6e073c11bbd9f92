"""What the converter tests share (test_convert_smollm2.py, test_convert_upstream.py): our conversion of a model,
made once per model, type and options in the test module's output folder, and a GGUF's metadata as they compare it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest

from convert.to_gguf import main


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test module's folder of converted files."""
    return tmp_path_factory.mktemp("converted")


def our_gguf(model_dir: Path, out_type: str, outputs: Path, *extra: str) -> Path:
    """``convert/to_gguf.py MODEL --type OUT_TYPE [EXTRA...]`` into ``outputs``, run in-process the first time."""
    out = outputs / f"ours-{model_dir.name}-{out_type}{''.join(extra)}.gguf"
    if not out.exists():
        assert main([str(model_dir), "--type", out_type, "-o", str(out), "--no-progress", *extra]) == 0
    return out


def gguf_kv(r: gguf.GGUFReader) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Every metadata key but the file's own (``GGUF.*``): its value types and contents, in the file's order."""
    return {k: (tuple(int(t) for t in f.types), f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}

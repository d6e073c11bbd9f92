"""Helpers of the mllama tests: the llama-server wrapper, the server-load run, the margins, the builds and the S3D8
reference. The tiny model, its conversion harness and transformers' reference moved to ``fixtures/`` (issue 48:
the benchmarks build from them too); ``from tests.mllama import harness, reference, tiny_model`` still gives those
modules (:data:`MOVED`), so the tests that import them by this name need no change."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

#: modules that now live in ``fixtures``, importable from here by their old names
MOVED = ("harness", "reference", "tiny_model")

if TYPE_CHECKING:
    from fixtures import harness as harness, reference as reference, tiny_model as tiny_model


def __getattr__(name: str) -> ModuleType:
    if name in MOVED:
        return importlib.import_module(f"fixtures.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

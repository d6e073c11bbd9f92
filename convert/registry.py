"""The HF architectures this project converts with its own code instead of upstream's model classes.

Every other architecture goes through upstream's ``convert_hf_to_gguf`` machinery
(``convert/upstream_source.py``). Model modules register a factory with :func:`register_hf_architecture`;
``to_gguf`` imports the modules listed in :data:`MODEL_MODULES` so their registrations run. Today that is only
``MllamaForConditionalGeneration`` (two output files, text + mtmd vision), until its model class is in the series.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable, Protocol

from .common import ModelSource


class SourceFactory(Protocol):
    def __call__(self, model_dir: Path, *, tokenizer_pre: str | None = None) -> ModelSource: ...


#: Modules that register HF architectures (imported lazily by :func:`hf_factories`).
MODEL_MODULES: list[str] = ["convert.mllama"]

_FACTORIES: dict[str, SourceFactory] = {}


def register_hf_architecture(*names: str) -> Callable[[SourceFactory], SourceFactory]:
    """Decorator: ``factory(model_dir, tokenizer_pre=...)`` converts checkpoints of these architectures."""

    def deco(factory: SourceFactory) -> SourceFactory:
        for n in names:
            _FACTORIES[n] = factory
        return factory

    return deco


def hf_factories() -> dict[str, SourceFactory]:
    """All registered architectures (importing the model modules on first use)."""
    for m in MODEL_MODULES:
        importlib.import_module(m)
    return dict(_FACTORIES)

"""Where the project keeps what it derives: the repository root and the cache root (``$S3D8_CACHE``, else
``<repo>/.cache``), for ``qat.text_eval``'s teacher cache and the fixtures (``fixtures.assets``)."""

from __future__ import annotations

import os
from pathlib import Path


def repo_root() -> Path:
    """The project root: the folder that holds the ``qat`` package."""
    return Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Cache root: ``$S3D8_CACHE`` if set (relative paths are taken from the repo root), else ``<repo>/.cache``."""
    env = os.environ.get("S3D8_CACHE")
    if env:
        p = Path(env).expanduser()
        return p if p.is_absolute() else repo_root() / p
    return repo_root() / ".cache"

"""The error type of ``qat``'s command-line tools (the lowest layer of ``qat``: imports nothing)."""

from __future__ import annotations


class TrainError(Exception):
    """A user-facing error (bad option, unusable data or checkpoint): printed as one line, exit status 2."""

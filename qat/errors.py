"""The error type of ``qat``'s command-line tools and how they report one (the lowest layer of ``qat``: imports
nothing of it)."""

from __future__ import annotations

import sys


class TrainError(Exception):
    """A user-facing error (bad option, unusable data or checkpoint): printed as one line, exit status 2."""


def cli_error(message: str) -> int:
    """Print ``error: MESSAGE`` on stderr and give the exit status of bad input or a failed write (2)."""
    print(f"error: {message}", file=sys.stderr)
    return 2

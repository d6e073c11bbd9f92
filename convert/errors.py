"""Errors the converter reports to the user as one line (exit code 2), without a traceback."""

from __future__ import annotations


class ConvertError(Exception):
    """A problem with the user's input or options (missing file, unsupported model, NaN weights, ...).

    The CLI prints ``error: <message>`` and exits with status 2; ``--debug`` adds the traceback.
    Anything else that escapes is a bug in the converter and is reported with a traceback.
    """

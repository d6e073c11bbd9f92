"""Errors the converter reports to the user as one line (exit code 2), without a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ConvertError(Exception):
    """A problem with the user's input or options (missing file, unsupported model, NaN weights, ...).

    The CLI prints ``error: <message>`` and exits with status 2; ``--debug`` adds the traceback.
    Anything else that escapes is a bug in the converter and is reported with a traceback.
    """


def read_json(path: Path, *, missing_hint: str = "") -> Any:
    """Parse the JSON file ``path``; a missing file or invalid JSON is a :class:`ConvertError` naming the file.

    ``missing_hint`` is appended to the "is missing" message (e.g. what the directory should have been).
    """
    if not path.is_file():
        raise ConvertError(f"{path.parent}: {path.name} is missing{missing_hint}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ConvertError(f"{path}: not valid JSON ({e})") from e

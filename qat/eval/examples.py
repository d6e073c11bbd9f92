"""The record every dataset reader yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Example:
    """One question about one image.

    ``answers`` holds what the task's scorer compares against:

    * VQAv2: the (ten) annotator answers;
    * ChartQA: one element, the label;
    * DocVQA: the accepted answers;
    * AI2D: one element, the 0-based index of the correct option as a decimal string (``"2"``).

    ``options`` is the multiple-choice list (AI2D only, empty otherwise).
    """

    id: str
    image: Path
    question: str
    answers: tuple[str, ...]
    options: tuple[str, ...] = field(default=())


class DatasetError(ValueError):
    """A dataset file is missing or not in the expected layout; the message names the file."""

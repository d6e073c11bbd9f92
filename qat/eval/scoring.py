"""The metrics, as the authors computed them (reference recipe section 7; LM ``training/eval/vqa.py@e1cf``).

``output`` is always the model's raw text (the transformers backend keeps special tokens such as
``<|eot_id|>``, as the authors' decode did; the scorers below strip what the authors stripped).

* :func:`normalise` - the VQA answer normalisation: whitespace characters to spaces; lower case; drop ``.``
  unless a digit follows; number words ``none`` (→ 0, as in the authors' table, which the recipe's paraphrase
  omits), ``zero`` … ``twenty`` to digits; drop the articles a/an/the; drop commas between digits; each of
  ``; / [ ] " { } ( ) = + \\ _ - > < @ ` , ? !`` to a space; collapse spaces; strip. Unlike the official VQA
  script there is no contraction table and ``'``, ``:``, ``%``, ``*``, ``|`` and ``#`` are kept.
* :func:`vqa_accuracy` - min(#{non-empty normalised annotator answers that the normalised output *starts with*} / 3, 1),
  counting duplicates. This is the recipe's prefix match, not the official average over the ten 9-subsets
  (an output "yes it is" scores like "yes").
* :func:`chartqa_accuracy` - the text after the first ``answer:`` (case-insensitive, ``*`` allowed around the
  colon; none → empty). If the label parses with Python's ``float``: the first number (``-?\\d*\\.?\\d+`` after
  number words → digits) must lie strictly inside (0.95·label, 1.05·label) as computed in floating point (so a
  label ≤ 0 never matches, and for label 100 both 95 and 105 fail); else the normalised answer must equal the
  normalised label. "45%" is not a float: such labels take the text path.
* :func:`anls` - per answer: lower, strip, remove ``<|eot_id|>`` (in that order), character Levenshtein distance
  over the longer length; a distance ≥ 0.5 scores 0, otherwise 1 − distance; the best answer counts.
  Two empty strings score 1 (the authors' code divided by zero there).
* :func:`ai2d_accuracy` - the text after the first ``answer:`` / ``option:`` / ``answer is:`` / ``option is:``
  (case-insensitive, ``*`` allowed); its first ``[1-4])`` must be label + 1. A bare ``2`` or a letter scores 0.
"""

from __future__ import annotations

import re

WORD_TO_DIGITS: dict[str, str] = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10", "eleven": "11", "twelve": "12", "thirteen": "13",
    "fourteen": "14", "fifteen": "15", "sixteen": "16", "seventeen": "17", "eighteen": "18", "nineteen": "19",
    "twenty": "20",
}
PUNCTUATION = ';/[]"{}()=+\\_-><@`,?!'
EOT = "<|eot_id|>"

_NUMBER_WORD = re.compile(r"\b(" + "|".join(WORD_TO_DIGITS) + r")\b")
_PUNCT = re.compile("[" + re.escape(PUNCTUATION) + "]")
_CHART_ANSWER = re.compile(r"\banswer\**:\**(.*)", re.IGNORECASE | re.DOTALL)
_AI2D_ANSWER = re.compile(r"\b(?:answer|option)(?:\s+is)?\**:\**(.*)", re.IGNORECASE | re.DOTALL)
_NUMBER = re.compile(r"-?\d*\.?\d+")
_OPTION = re.compile(r"([1-4])\)")


def number_words_to_digits(text: str) -> str:
    return _NUMBER_WORD.sub(lambda m: WORD_TO_DIGITS[m.group()], text)


def normalise(text: str) -> str:
    """The VQA answer normalisation (module docstring)."""
    text = re.sub(r"\s", " ", text).lower()
    text = re.sub(r"\.(?!\d)", "", text)
    text = number_words_to_digits(text)
    text = re.sub(r"\b(a|an|the)\b", "", text)
    text = re.sub(r"(?<=\d),(?=\d)", "", text)
    text = _PUNCT.sub(" ", text)
    return re.sub(r"\s+", " ", text).strip()


def vqa_accuracy(output: str, answers: list[str] | tuple[str, ...]) -> float:
    out = normalise(output)
    matches = sum(1 for a in map(normalise, answers) if a and out.startswith(a))
    return min(matches / 3, 1.0)


def _after(pattern: re.Pattern[str], text: str) -> str:
    m = pattern.search(text)
    return m.group(1).strip().replace(EOT, "") if m else ""


def chartqa_accuracy(output: str, label: str) -> float:
    answer = _after(_CHART_ANSWER, output)
    try:
        value = float(label)
    except ValueError:
        return float(normalise(answer) == normalise(label))
    numbers = _NUMBER.findall(number_words_to_digits(answer.lower()))
    return float(bool(numbers) and 0.95 * value < float(numbers[0]) < 1.05 * value)


def levenshtein(a: str, b: str) -> int:
    """Character edit distance (insert, delete, substitute; each costs 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _anls_prep(text: str) -> str:
    return text.lower().strip().replace(EOT, "")


def anls(output: str, answers: list[str] | tuple[str, ...], threshold: float = 0.5) -> float:
    out = _anls_prep(output)
    best = 0.0
    for ans in map(_anls_prep, answers):
        longest = max(len(out), len(ans))
        dist = levenshtein(out, ans) / longest if longest else 0.0
        best = max(best, 1.0 - dist if dist < threshold else 0.0)
    return best


def ai2d_accuracy(output: str, label: int | str) -> float:
    options = _OPTION.findall(_after(_AI2D_ANSWER, output))
    return float(bool(options) and int(options[0]) == int(label) + 1)

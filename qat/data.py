"""The synthetic-data sample record shared by the generator (``qat.generate``) and the QAT training code.

JSONL schema: one JSON object per line, UTF-8, keys exactly these (written in this order)::

    {"id": int,                 # sample index i; the prompt (and seed of the teacher's sampling) is a pure
                                #   function of (seed, id), see qat.prompts.sample_prompt
     "seed": int,               # master seed of the run (qat.prompts.DEFAULT_SEED = 693785 unless changed)
     "image": str | null,       # path of the image file; null in text-only mode. The generator writes
                                #   ABSOLUTE paths; read_samples also accepts paths relative to the JSONL's
                                #   folder and resolves them to absolute paths
     "template": "chat" | "plain",
     "prompt": str,             # the user prompt text before templating (wrapper and instruction block
                                #   included, e.g. "Task: Describe the image ...\\n")
     "prompt_text": str,        # the full templated text fed to the model, ending exactly where the response
                                #   begins; tokenise it with add_special_tokens=False - it already starts with
                                #   the BOS text (e.g. "<|begin_of_text|>") when the model expects a BOS. Each
                                #   "<|image|>" in it stands for the image
     "response": str,           # the generated text, without the EOS / end-of-turn token
     "finish_reason": "stop" | "length",   # "stop": the teacher ended the turn; "length": hit max_new_tokens
     "teacher": str}            # which teacher produced it (model path, or "endpoint:<url>#<model>")

Training text of a sample = ``prompt_text + response`` (+ the model's end-of-turn token when
``finish_reason == "stop"``); the KL loss masks the ``prompt_text`` positions.

Files are appended one line at a time (write, flush, fsync), so a killed writer leaves at most one
truncated final line; :func:`recover` drops it so that generation can resume, and :func:`read_samples`
ignores it (a file may be read while it is still being written).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Callable, Literal, NamedTuple, TypeVar

__all__ = ["Sample", "SampleHead", "SampleWriter", "append_sample", "read_samples", "recover", "TEMPLATES", "FINISH_REASONS"]

TEMPLATES = ("chat", "plain")
FINISH_REASONS = ("stop", "length")
T = TypeVar("T")
Template = Literal["chat", "plain"]
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Sample:
    """One teacher sample; field meanings are in the module docstring."""

    id: int
    seed: int
    image: str | None
    template: Template
    prompt: str
    prompt_text: str
    response: str
    finish_reason: FinishReason
    teacher: str

    def __post_init__(self) -> None:
        for name in ("id", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"Sample.{name} must be an int, got {v!r}")
        if self.id < 0:
            raise ValueError(f"Sample.id must be >= 0, got {self.id}")
        for name in ("prompt", "prompt_text", "response", "teacher"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Sample.{name} must be a str")
        if self.image is not None and not isinstance(self.image, str):
            raise ValueError(f"Sample.image must be a str or None, got {self.image!r}")
        if self.template not in TEMPLATES:
            raise ValueError(f"Sample.template must be one of {TEMPLATES}, got {self.template!r}")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"Sample.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "Sample":
        """Build from a parsed JSON object; the keys must be exactly the schema's."""
        names = [f.name for f in fields(cls)]
        if set(d) != set(names):
            missing, extra = sorted(set(names) - set(d)), sorted(set(d) - set(names))
            raise ValueError(f"sample keys differ from the schema (missing {missing}, unexpected {extra})")
        return cls(**{k: d[k] for k in names})

    def to_json(self) -> str:
        """The JSONL line for this sample (no trailing newline; non-ASCII kept as UTF-8)."""
        return json.dumps(asdict(self), ensure_ascii=False)


class SampleHead(NamedTuple):
    """What resuming needs of a stored sample (keeps a large file's scan small in memory)."""

    id: int
    seed: int
    teacher: str


def _scan(path: Path, keep: Callable[[Sample], T]) -> tuple[list[T], int]:
    """``keep(sample)`` for every complete sample of a JSONL file, streamed, and the byte length of its
    intact prefix.

    Only the final line may be damaged (no newline, or not valid JSON: a killed writer); a damaged
    line elsewhere raises ``ValueError`` naming the line.
    """
    out: list[T] = []
    good_end = 0
    pending: tuple[int, str] | None = None  # a bad line, fatal unless it is the last
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if pending is not None:
                raise ValueError(f"{path}:{pending[0]}: bad sample line ({pending[1]})")
            if not raw.endswith(b"\n"):  # truncated final line
                break
            try:
                sample = Sample.from_dict(json.loads(raw.decode("utf-8"))) if raw.strip() else None
            except (ValueError, TypeError) as e:
                pending = (lineno, str(e))
                continue
            if sample is not None:
                out.append(keep(sample))
            good_end += len(raw)
    return out, good_end


def read_samples(path: str | os.PathLike, *, resolve_images: bool = True) -> list[Sample]:
    """All complete samples of a JSONL file, sorted by id (a truncated final line is ignored).

    With ``resolve_images`` (default) relative image paths are made absolute against the file's folder.
    Duplicate ids raise ``ValueError``.
    """
    path = Path(path)
    samples, _ = _scan(path, lambda s: s)
    seen: set[int] = set()
    for s in samples:
        if s.id in seen:
            raise ValueError(f"{path}: sample id {s.id} occurs twice")
        seen.add(s.id)
    if resolve_images:
        base = path.resolve().parent
        samples = [s if s.image is None or os.path.isabs(s.image)
                   else Sample(**{**asdict(s), "image": str(base / s.image)}) for s in samples]
    return sorted(samples, key=lambda s: s.id)


def recover(path: str | os.PathLike) -> list[SampleHead]:
    """Prepare a JSONL file for appending: cut a truncated final line off (in place) and return the
    (id, seed, teacher) of its complete samples in file order. A missing file is created empty."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return []
    samples, good_end = _scan(path, lambda s: SampleHead(s.id, s.seed, s.teacher))
    if good_end != path.stat().st_size:
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return samples


class SampleWriter:
    """Appends samples to a JSONL file, one durable line each (write, flush, fsync)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._f: IO[str] | None = open(self.path, "a", encoding="utf-8", newline="\n")

    def append(self, sample: Sample) -> None:
        if self._f is None:
            raise ValueError("SampleWriter is closed")
        self._f.write(sample.to_json() + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> "SampleWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def append_sample(path: str | os.PathLike, sample: Sample) -> None:
    """Append one sample to ``path`` durably (opens and closes the file; use SampleWriter for many)."""
    with SampleWriter(path) as w:
        w.append(sample)

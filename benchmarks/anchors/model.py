"""The anchors benchmark's vocabulary: paths and defaults, the models and their variant tensors, the extra files
(``--extra``), the errors and the log line."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DEFAULT_JSON = DOCS / "data" / "quality_anchors.json"
DEFAULT_PLOT = DOCS / "img" / "quality_anchors.png"
DEFAULT_MARKDOWN = DOCS / "quality-anchors.md"
IK_TYPES = ("iq2_kl", "iq2_k", "iq2_ks", "iq2_s")
#: mainline's stock types (S3D8's rows are S3D8_ROWS; "s3d8" here is a plain S3D8 row with the t2 imatrix)
MAINLINE_TYPES = ("iq2_s", "iq2_m", "q2_k", "iq3_xxs")
#: llama-quantize's ftype whose per-tensor choices "iq2_m" copies onto the variant tensors
MIX_TYPES = ("iq2_m",)
PROJECTS = ("mainline", "ik", "extra")
#: flash attention on in both benchmarks (ik's default; mainline's "auto" picks it on the CPU too)
BENCH_FA = {"mainline": ("-fa", "on"), "ik": ("-fa", "1"), "extra": ("-fa", "on")}
OUTSIDE_TYPE = "Q8_0"
RESULTS_VERSION = 2
#: the imatrix / X^T X variants every S3D8 row with ``variants`` is made for (benchmarks/anchors/variants.py)
VARIANTS = ("t2", "t1", "pert")


@dataclass(frozen=True)
class S3D8Row:
    """One S3D8 row: how ``llama-quantize`` makes its file from a variant's imatrix and X^T X."""

    key: str  #: its ``--s3d8-rows`` name
    label: str
    imatrix: bool  #: with ``--imatrix``
    hessian: str  #: "" (none), "last" (the last block's X^T X only) or "all" (every variant tensor's)
    mix: bool  #: the types ``llama-quantize --dry-run ... S3D8`` gives the variant tensors, else S3D8 on all of them
    variants: bool  #: made for every variant and reported as the worst (else once, from t2's inputs or none)


S3D8_ROWS: dict[str, S3D8Row] = {r.key: r for r in (
    S3D8Row("iw1", "S3D8 iw1", True, "", False, True),
    S3D8Row("last", "S3D8 + last-layer X^T X", True, "last", False, True),
    S3D8Row("gptq", "S3D8 GPTQ all ffn_down", True, "all", False, True),
    S3D8Row("mix", "S3D8 default mix (imatrix only)", True, "", True, True),
    S3D8Row("mix-noim", "S3D8 default mix, no imatrix", False, "", True, False),
    S3D8Row("noim", "S3D8 iw1, no imatrix", False, "", False, False),
)}


@dataclass(frozen=True)
class Model:
    #: the model whose f16 file, text, imatrices and base logits are used (a MODELS key)
    base: str
    title: str
    #: the tensors that get the variant's type: ``blk.N.<role>.weight`` for these roles
    roles: tuple[str, ...]

    @property
    def key(self) -> str:
        """The spec's name: the model's, with the roles when they are not its default ones."""
        default = MODELS[self.base].roles if self.base in MODELS else self.roles
        return self.base if self.roles == default else f"{self.base}:{','.join(self.roles)}"

    @property
    def folder(self) -> str:
        return self.key.replace(":", "-").replace(",", "+")

    @property
    def regex(self) -> str:
        """One regular expression for the variant tensors, as both projects' ``llama-quantize`` take it."""
        roles = self.roles[0] if len(self.roles) == 1 else "(" + "|".join(self.roles) + ")"
        return rf"^blk\.[0-9]+\.{roles}\.weight$"

    def is_variant(self, name: str) -> bool:
        return re.fullmatch(self.regex.strip("^$"), name) is not None


#: each model with its default variant tensors: those S3D8 can hold. SmolLM2's other matrices have k = 576 (not a
#: multiple of 128); Gemma-3-270M's attn_output (k = 1024, 640 rows: 640 % 3 = 1 needs 1216 rows at k = 1024,
#: docs/s3d8-format.md) is too small for an S3D8 slice, so its default is ffn_down alone (k = 2048) and
#: ``gemma3:attn_output,ffn_down`` measures the other types on both (S3D8's row then fails, and says why)
MODELS: dict[str, Model] = {
    "smollm2": Model("smollm2", "SmolLM2-135M-Instruct", ("ffn_down",)),
    "gemma3": Model("gemma3", "Gemma-3-270M", ("ffn_down",)),
}
_ROLE = re.compile(r"[a-z0-9_]+")


def parse_model_spec(text: str) -> Model:
    """``MODEL`` or ``MODEL:ROLE[,ROLE...]`` (e.g. ``gemma3:attn_output,ffn_down``): a model and its variant
    tensors (``blk.N.ROLE.weight``)."""
    base, sep, roles = text.partition(":")
    if base not in MODELS:
        raise argparse.ArgumentTypeError(f"unknown model {base!r} in {text!r} (known: {', '.join(MODELS)})")
    if not sep:
        return MODELS[base]
    parts = tuple(r.strip() for r in roles.split(","))
    if not all(_ROLE.fullmatch(r) for r in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: roles are tensor-name parts such as ffn_down, attn_output")
    return Model(base, MODELS[base].title, parts)


class ToolError(RuntimeError):
    """A tool failed; the message names it and ends with its output's tail."""


class NotApplicable(ToolError):
    """The type cannot hold the variant tensors (llama-quantize fell back to another type): a row that says so,
    not a failure of the run."""


def log(msg: str) -> None:
    print(f"\033[1m[anchors]\033[0m {msg}", file=sys.stderr, flush=True)

# ---------------------------------------------------------------------------------------------------- arguments

@dataclass(frozen=True)
class Extra:
    model: str
    name: str
    path: Path


def parse_extra(text: str) -> Extra:
    """``MODEL:NAME=PATH`` (e.g. ``smollm2:S3D8 GPTQ=.cache/main-job/smollm2-135m-s3d8-gptq.gguf``); MODEL is a
    ``--models`` entry, with its roles after a ``:`` when it has some (``gemma3:attn_output,ffn_down:NAME=PATH``)."""
    head, sep, path = text.partition("=")
    model, sep2, name = head.rpartition(":")
    model, name, path = model.strip(), name.strip(), path.strip()
    if not sep or not sep2 or not name or not path:
        raise argparse.ArgumentTypeError(f"--extra wants MODEL:NAME=PATH, got {text!r}")
    try:
        model = parse_model_spec(model).key
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"--extra {text!r}: {e}") from None
    return Extra(model, name, Path(path))

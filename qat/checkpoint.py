"""The QAT checkpoint file (``qat.train`` writes it, ``qat.train --resume``, the converter's ``--qat-checkpoint``,
``qat.eval --student`` and the experiments read it): one ``torch.save`` of a dict with ``format`` =
:data:`CHECKPOINT_FORMAT`, ``version`` = :data:`CHECKPOINT_VERSION`, and the run's state (``model``: fp32 master
weights; ``specs``: the weight specs with their frozen codebooks/scales; optimiser, schedule, losses, ...).

Reading one needs torch only: no model building, data or training loop (those are in :mod:`qat.training`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from qat.errors import TrainError

__all__ = ["CHECKPOINT_NAME", "CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "save_checkpoint", "load_checkpoint",
           "remove_stale_checkpoint_tmps"]

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = "s3d8-qat-checkpoint"
CHECKPOINT_VERSION = 1


def _checkpoint_tmp(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.{pid}.tmp")


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """torch.save into a temporary file next to ``path``, fsync, rename, fsync the folder: never a half-written
    file. A failed write (disk full, file size limit) raises TrainError naming ``path`` and the OS's reason; the
    previous checkpoint is untouched and the temporary file removed. Only a process killed outright leaves its
    temporary file ``.<name>.<pid>.tmp``, which the next run removes (:func:`remove_stale_checkpoint_tmps`)."""
    from gguf_s3d8.fsio import atomic_path, write_error_reason

    try:
        with atomic_path(path, tmp=_checkpoint_tmp(path, os.getpid())) as tmp:
            f = open(tmp, "wb")
            try:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
                why = write_error_reason(e, f.fileno())
                try:
                    f.close()  # flushing the rest fails again on a full disk; the file is closed regardless
                except OSError:
                    pass
                if why is None:
                    raise
                raise TrainError(f"{path}: cannot write the checkpoint: {why} (the previous {path.name}, if any, "
                                 "is unchanged)") from e
            f.close()
    except OSError as e:  # open or rename
        raise TrainError(f"{path}: cannot write the checkpoint: {e.strerror or e}") from e


def remove_stale_checkpoint_tmps(path: Path) -> list[Path]:
    """Remove the temporary files ``.<name>.<pid>.tmp`` next to ``path`` that processes killed while saving
    (SIGKILL, OOM killer, power loss) left behind, those whose process no longer runs; returns them."""
    removed = []
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name[len(path.name) + 2: -len(".tmp")]
        if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
            continue
        try:
            tmp.unlink()
        except FileNotFoundError:
            continue
        removed.append(tmp)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A QAT checkpoint written by :func:`save_checkpoint` (raises TrainError if it is not one)."""
    if not path.is_file():
        raise TrainError(f"{path}: no such checkpoint")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises assorted types for corrupt files
        raise TrainError(f"{path}: cannot read checkpoint ({e})") from e
    if not isinstance(ck, dict) or ck.get("format") != CHECKPOINT_FORMAT:
        raise TrainError(f"{path}: not a QAT checkpoint (format {ck.get('format') if isinstance(ck, dict) else None!r})")
    if ck.get("version") != CHECKPOINT_VERSION:
        raise TrainError(f"{path}: checkpoint version {ck.get('version')} (expected {CHECKPOINT_VERSION})")
    return ck

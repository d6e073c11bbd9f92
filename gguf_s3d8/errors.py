"""Exception classes. Every message names the tensor it is about, so a converter or loader error
points straight at the offending weight."""

from __future__ import annotations


def tensor_label(name: str) -> str:
    """How a tensor is called in messages: its quoted name, or a placeholder when the caller gave none."""
    return repr(name) if name else "<unnamed tensor>"


class S3D8Error(ValueError):
    """Base class of every error this package raises about a tensor."""

    def __init__(self, name: str, reason: str) -> None:
        self.tensor_name = name
        self.reason = reason
        super().__init__(f"S3D8 tensor {tensor_label(name)}: {reason}")


class S3D8FormatError(S3D8Error):
    """A container (section 4 of the format) is corrupt or inconsistent with its buffer."""


class S3D8IneligibleError(S3D8Error):
    """A matrix was requested as S3D8 but its shape cannot hold an S3D8 container."""


class S3D8InputError(S3D8Error):
    """The input to quantisation is unusable: wrong rank or dtype, non-finite values, bad codebook."""

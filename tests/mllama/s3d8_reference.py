"""transformers running the weights of a converted GGUF the way llama.cpp's kernels use them.

For the S3D8 parity test: every linear layer whose GGUF tensor is S3D8 computes ``y = x W^T`` with the codec's
integer reference (per-token int8 activation quantisation, exact int32 accumulation, fixed fp32 epilogue: the
arithmetic of the ggml kernels, bit for bit), S3D8 embedding tables are replaced by their dequantised values (what
``ggml_get_rows`` returns), and F16 fallbacks round both operands to f16 as ggml's CPU matmul does. Everything
else (norms, attention, gates, tables) stays float32, so the two implementations differ only by float rounding.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np


def _f16_conv(x, *, w16, stride, padding):
    """A Conv2d whose input and weights are rounded to f16 (what llama.cpp's F16 convolution computes)."""
    import torch

    return torch.nn.functional.conv2d(x.half().float(), w16, stride=stride, padding=padding)


def _gguf_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    from gguf_s3d8 import series_gguf  # the patch series' gguf-py, which defines S3D8

    reader = series_gguf().GGUFReader(path)
    return {t.name: (t.tensor_type.name, np.asarray(t.data)) for t in reader.tensors}


def patch_model(model, model_dir: Path, ggufs: list[Path]) -> dict[str, str]:
    """Make ``model`` compute with the GGUF weights as llama.cpp does; returns {gguf name: how it is emulated}."""
    import torch
    from torch import nn

    from convert.upstream_source import checkpoint_placements
    from gguf_s3d8.quantize import decode_int8, dequantized_values
    from gguf_s3d8.reference import epilogue, integer_matmul
    from gguf_s3d8.activations import quantize_activations
    from gguf_s3d8.scales import scales_to_fp32

    tensors: dict[str, tuple[str, np.ndarray]] = {}
    for p in ggufs:
        tensors.update(_gguf_tensors(p))
    # where the converter put each module's weight (both files; the vision type does not change the names)
    place = checkpoint_placements(model_dir, vision_type="f16")

    modules = dict(model.named_modules())
    report: dict[str, str] = {}

    def make_s3d8_forward(w_int, alpha, inv_perm, bias):
        def forward(x):
            shape = x.shape
            xa = x.detach().reshape(-1, shape[-1]).numpy().astype(np.float32)
            x_q, s_bits = quantize_activations(xa)
            y = epilogue(integer_matmul(x_q, w_int), scales_to_fp32(s_bits), alpha)
            if inv_perm is not None:
                y = y[:, inv_perm]
            out = torch.from_numpy(np.ascontiguousarray(y)).reshape(*shape[:-1], -1)
            return out + bias if bias is not None else out
        return forward

    def make_f16_forward(w16, bias):
        def forward(x):
            y = torch.nn.functional.linear(x.half().float(), w16)
            return y + bias if bias is not None else y
        return forward

    for mod_name, mod in modules.items():
        if not isinstance(mod, (nn.Linear, nn.Embedding, nn.Conv2d)):
            continue
        placed = place(mod_name + ".weight")
        if placed is None:
            continue
        gname = placed.gguf_name
        ttype, data = tensors[gname]
        if isinstance(mod, nn.Embedding):
            if ttype == "S3D8":
                w_int, alpha = decode_int8(data)
                with torch.no_grad():
                    mod.weight.copy_(torch.from_numpy(dequantized_values(w_int, alpha)))
                report[gname] = "dequantised rows"
            continue
        if isinstance(mod, nn.Conv2d):
            if ttype == "F16":
                w16 = mod.weight.detach().half().float()
                stride, padding = mod.stride, mod.padding
                mod.forward = functools.partial(_f16_conv, w16=w16, stride=stride, padding=padding)  # type: ignore[method-assign]
                report[gname] = "f16 conv"
            continue
        bias = mod.bias.detach() if mod.bias is not None else None
        if ttype == "S3D8":
            w_int, alpha = decode_int8(data)
            inv_perm = None if placed.rows is None else np.argsort(placed.rows)  # self-attention q/k: RoPE rows
            mod.forward = make_s3d8_forward(w_int, alpha, inv_perm, bias)  # type: ignore[method-assign]
            report[gname] = "s3d8 integer matmul"
        elif ttype == "F16":
            mod.forward = make_f16_forward(mod.weight.detach().half().float(), bias)  # type: ignore[method-assign]
            report[gname] = "f16 matmul"
        elif ttype not in ("F32",):
            raise NotImplementedError(f"{gname}: no emulation of {ttype} in the reference")
    return report

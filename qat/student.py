"""The QAT student: an HF Llama whose every Linear and Embedding computes with the weights the GGUF will hold.

Each weight matrix is fake-quantised exactly as ``convert/to_gguf.py --type s3d8`` stores it (type and llama.cpp's
row order from the converter's plan, upstream's model class: :func:`plan_weights`):

* **S3D8** where the container can hold the matrix: per-matrix codebook fitted once with
  ``gguf_s3d8.fit_codebook`` (default centroid rule, ``seed``) at creation and frozen; bf16 absmax row scales
  recomputed from the current fp32 master every step; values from :func:`qat.s3d8_torch.s3d8_dequantised`.
* the **fallback type** otherwise (Q8_0, or F16 when k % 32 != 0; ``--fallback-type`` of the converter):
  :mod:`qat.ggml_torch`, bit-exact with ``gguf.quants``.

The input of every quantised Linear is fake-quantised as llama.cpp's CPU matmul quantises it for that weight
type: per-token INT8 (format §3) for S3D8, Q8_0 blocks for Q8_0, f16/bf16 rounding for F16/BF16 (so that the
exported GGUF reproduces the student's forward). Embedding lookups read the dequantised table unquantised.

**Simulation students** (``qat.train --format ID``, :func:`plan_format`): every Linear and Embedding weight (a tied
lm_head / embedding once) computes with a ``qat.formats`` format instead - the baseline sweep's scope, no GGUF
form. The format's per-matrix part is fitted once on the teacher's weight and frozen (a :class:`WeightSpec` of
type ``"format"``, :func:`format_spec`; ``fmt.qat_fit``), the scales come from the current master every step (``fmt.qat_quantise``); activations are
not quantised and the weight gradient is the plain straight-through identity.

Gradients are straight-through: d w_hat / d w = identity plus the dynamic-scale path of the reference
(``alpha = amax / 127`` differentiated at the row's arg-max: ``+ sign(w_max) / 127 * sum_j g_j (q_j - u_j)``
with ``q = w_hat / alpha``, ``u = w / alpha``); activations pass the gradient through unchanged. Fake-quantised
weights are cached per parameter version, so gradient-checkpoint recomputation and tied weights do not redo
the nearest-centroid search.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from gguf_s3d8 import ggml_types

__all__ = ["WeightSpec", "plan_weights", "fake_quant_weight", "weights_stepped", "quantise_student", "QuantLinear", "QuantEmbedding",
           "student_specs", "format_spec", "plan_format", "spec_from_state", "start_from_containers"]


@dataclass(frozen=True)
class GgufType:
    """A GGUF weight type as the student computes with it: the dequantised value of a weight (fp32, GGUF row
    order; ``spec`` gives S3D8 its codebook and frozen scales), the activation quantisation llama.cpp's CPU
    matmul applies for it (None: none), and the elements per dynamic scale along a row (``scale_block(k)``; None:
    no dynamic scale, the gradient is the plain identity)."""

    dequantised: Callable[[torch.Tensor, "WeightSpec"], torch.Tensor]
    activations: Callable[[torch.Tensor], torch.Tensor] | None
    scale_block: Callable[[int], int | None]


def _no_scale(k: int) -> int | None:
    return None


def _format_values(g: torch.Tensor, spec: "WeightSpec") -> torch.Tensor:
    assert spec.format_id is not None and spec.fitted is not None
    return _simulated_format(spec.format_id).qat_quantise(g, spec.fitted)


@functools.lru_cache(maxsize=None)
def _simulated_format(format_id: str) -> Any:
    from qat.formats import format_from_id

    return format_from_id(format_id)


#: The type of a simulation student's weight (:func:`format_spec`): a ``qat.formats`` format, not a GGUF type
#: (its fitted part in the spec; activations not quantised, identity gradient).
FORMAT = "format"
WEIGHT_TYPES = tuple(t.name for t in ggml_types.WEIGHT_TYPES)  #: the types a GGUF weight can have


@functools.lru_cache(maxsize=None)
def student_type(qtype: str) -> GgufType:
    """How the student computes with a weight of type ``qtype`` (one of :data:`WEIGHT_TYPES`, or ``"format"``):
    for a GGUF type, what the table of types (``gguf_s3d8.ggml_types``) names - its torch twin with the spec's
    frozen part (``qat.formats.twin_values``), the activations' twin (``torch_activations``) and its dynamic scale
    (``scale_block``)."""
    if qtype == FORMAT:
        return GgufType(_format_values, None, _no_scale)
    from qat.formats import torch_activations, twin_values

    t = ggml_types.ggml_type(qtype)
    values = twin_values(t.name)
    return GgufType(lambda g, spec: values(g, spec.frozen()), torch_activations(t.name), t.scale_block)


@dataclass
class WeightSpec:
    """How one HF weight is stored in the GGUF: type, llama.cpp row permutation, frozen S3D8 codebook and, for a
    student started from GPTQ or the importance-aware encoder (:func:`start_from_containers`), frozen S3D8 row
    scales (the weight-space rule then assigns entries; without them: absmax scales of the current master).

    A simulation student's weight (:func:`format_spec`) has type ``"format"``: the ``qat.formats`` format
    ``format_id`` with ``fitted``, its ``fmt.qat_fit`` of the teacher's weight (the value of a master ``w`` is
    ``fmt.qat_quantise(w, fitted)``, scales from ``w``); it has no GGUF tensor (``gguf_name`` is the format id)."""

    hf_name: str
    gguf_name: str
    qtype: str                      # one of WEIGHT_TYPES, or FORMAT
    perm: torch.Tensor | None       # GGUF row r = HF row perm[r] (q/k RoPE layout), None = identity
    codebook: torch.Tensor | None   # (32, 3) uint8 for S3D8
    scales: torch.Tensor | None = None  # (n,) int32 holding bf16 bit patterns, GGUF row order; None = absmax
    format_id: str | None = None    # qtype "format": the qat.formats format
    fitted: dict[str, torch.Tensor] | None = None  # qtype "format": its frozen fitted part

    def state(self) -> dict[str, Any]:
        return {"hf_name": self.hf_name, "gguf_name": self.gguf_name, "qtype": self.qtype, "perm": self.perm,
                "codebook": self.codebook, "scales": self.scales, "format_id": self.format_id, "fitted": self.fitted}

    @property
    def fmt(self) -> Any:
        """The ``qat.formats`` format of a simulated weight."""
        if self.format_id is None:
            raise ValueError(f"{self.hf_name}: a {self.qtype} weight has no simulated format")
        return _simulated_format(self.format_id)

    def gguf_type(self) -> GgufType:
        if self.qtype != FORMAT and self.qtype not in WEIGHT_TYPES:
            raise ValueError(f"{self.hf_name}: unknown weight type {self.qtype!r}")
        return student_type(self.qtype)

    def frozen(self) -> dict[str, torch.Tensor]:
        """The frozen per-matrix part of a GGUF weight, as its torch twin takes it (``qat_quantise``'s ``fitted``):
        the S3D8 codebook and, if frozen, the row scales; nothing for the other types."""
        return {k: v for k, v in (("codebook", self.codebook), ("scales", self.scales)) if v is not None}

    def dequantised(self, w: torch.Tensor) -> torch.Tensor:
        """The GGUF's dequantised value of the fp32 master ``w`` (HF row order)."""
        w = w.detach().to(torch.float32)
        g = w if self.perm is None else w[self.perm]
        h = self.gguf_type().dequantised(g, self)
        if self.perm is None:
            return h
        out = torch.empty_like(h)
        out[self.perm] = h
        return out

    def activation_quantiser(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return self.gguf_type().activations

    def scale_block(self, k: int) -> int | None:
        """Elements per dynamic scale along a row (S3D8: the row, Q8_0: 32); None for unscaled types and for
        frozen S3D8 scales."""
        return None if self.scales is not None else self.gguf_type().scale_block(k)

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> "WeightSpec":
        return cls(**d)


def format_spec(hf_name: str, format_id: str, fitted: dict[str, torch.Tensor]) -> WeightSpec:
    """A simulation student's weight: ``qat.formats`` format ``format_id`` with its frozen fitted part."""
    _simulated_format(format_id)  # an unknown id fails here, not at the first forward
    return WeightSpec(hf_name, format_id, FORMAT, None, None, format_id=format_id, fitted=dict(fitted))


def spec_from_state(d: dict[str, Any]) -> WeightSpec:
    """The spec of a checkpoint entry (``WeightSpec.state()``; also the ``{"kind": "format", ...}`` entries that
    checkpoints of simulation students held before the two spec classes became one)."""
    if d.get("kind") == "format":
        return format_spec(d["hf_name"], d["format"], dict(d["fitted"]))
    return WeightSpec.from_state(d)


def plan_format(model: nn.Module, format_id: str, *, progress: bool = False) -> dict[str, WeightSpec]:
    """A simulated :class:`WeightSpec` (:func:`format_spec`) per distinct Linear/Embedding weight, fitted on its current (teacher) value.

    The scope of ``qat.gptq.quantise_model`` (the baseline sweep's direct cast): every Linear and every
    Embedding, tied weights once (keyed by the parameter's first name, e.g. the embedding's, as
    :func:`plan_weights`).
    """
    from tqdm import tqdm

    fmt = _simulated_format(format_id)
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}  # first name wins
    mods = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    specs: dict[str, WeightSpec] = {}
    for mod in tqdm(mods, desc=f"Fitting {format_id}", disable=not progress, leave=False):
        hf_name = names[id(mod.weight)]
        if hf_name not in specs:
            specs[hf_name] = format_spec(hf_name, format_id, fmt.qat_fit(mod.weight.detach().to(torch.float32)))
    return specs


# ---------------------------------------------------------------------------------------------------
# planning: which type, which layout, which codebook


#: Where the converter puts an HF weight: (GGUF name, GGUF shape, GGUF type, row permutation or None).
Placement = tuple[str, tuple[int, ...], str, "torch.Tensor | None"]


def _plan(model: nn.Module, place: Callable[[str, torch.Tensor], Placement], *, centroid_rule: str | None,
          seed: int, progress: bool, fit_codebooks: bool = True,
          given_codebooks: Collection[str] = ()) -> dict[str, WeightSpec]:
    """A spec per distinct Linear/Embedding weight (tied weights once, under the first name), placed by ``place``;
    S3D8 codebooks are fitted on the weight in the GGUF's row order (left None without ``fit_codebooks``, and for
    the GGUF names in ``given_codebooks``, whose codebooks the caller sets, e.g. :func:`start_from_containers`)."""
    import gguf_s3d8
    from tqdm import tqdm

    rule = centroid_rule or gguf_s3d8.DEFAULT_CENTROID_RULE
    seen: set[int] = set()
    specs: dict[str, WeightSpec] = {}
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    for mod_name, mod in tqdm(mods, desc="Fitting codebooks", disable=not progress, leave=False):
        hf_name = f"{mod_name}.weight"
        if id(mod.weight) in seen:
            continue
        seen.add(id(mod.weight))
        w = mod.weight.detach().to(torch.float32)
        gguf_name, gguf_shape, qtype, perm = place(hf_name, w)
        if not ggml_types.ggml_type(qtype).lossless and tuple(w.shape) != tuple(gguf_shape):
            raise ValueError(f"{hf_name}: shape {tuple(w.shape)}, the converter writes {gguf_name} as {gguf_shape}")
        codebook = None
        if qtype == ggml_types.S3D8.name and fit_codebooks and gguf_name not in given_codebooks:
            w_gguf = (w if perm is None else w[perm]).numpy()
            codebook = torch.from_numpy(gguf_s3d8.fit_codebook(w_gguf, centroid_rule=rule, seed=seed, name=gguf_name))
        specs[hf_name] = WeightSpec(hf_name, gguf_name, qtype, perm, codebook)
    return specs


def plan_weights(model: nn.Module, model_dir: Path, *, vision_type: str | None = None, fallback_type: str = "q8_0",
                 centroid_rule: str | None = None, seed: int = 0, progress: bool = False, fit_codebooks: bool = True,
                 given_codebooks: Collection[str] = ()) -> dict[str, WeightSpec]:
    """A :class:`WeightSpec` per Linear/Embedding weight of the HF model loaded from ``model_dir``, placed by the
    converter's own plan - upstream's model class for the architecture (``convert.upstream_source``): GGUF name,
    row layout (e.g. Llama's q/k permutation) and type exactly as ``convert/to_gguf.py --type s3d8`` writes them;
    with ``vision_type`` also the mmproj file's (mllama: ``--mmproj-type``; the vision tile tables are F32 there).

    Tied weights (``lm_head.weight`` sharing ``model.embed_tokens.weight``) get one spec, under the name the
    checkpoint stores (the embedding), exactly as the converter writes only ``token_embd``.
    """
    from convert.errors import ConvertError
    from convert.upstream_source import checkpoint_placements

    try:
        placements = checkpoint_placements(model_dir, fallback_type=fallback_type, vision_type=vision_type)
    except ConvertError as e:
        raise ValueError(str(e)) from e

    def place(hf_name: str, w: torch.Tensor) -> Placement:
        p = placements(hf_name)
        if p is None:
            raise ValueError(f"{hf_name}: the converter writes no tensor for this weight")
        t = ggml_types.ggml_type(p.qtype)
        perm = None if t.lossless or p.rows is None else torch.from_numpy(np.ascontiguousarray(p.rows))
        return p.gguf_name, p.shape, t.name, perm

    return _plan(model, place, centroid_rule=centroid_rule, seed=seed, progress=progress, fit_codebooks=fit_codebooks,
                 given_codebooks=given_codebooks)


# ---------------------------------------------------------------------------------------------------
# fake quantisation with straight-through gradients


def _dequantised(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """The GGUF's dequantised value of the fp32 master ``w`` (HF row order); a simulated format's value."""
    return spec.dequantised(w)


def start_from_containers(model: nn.Module, tensors: Any) -> tuple[list[str], list[str]]:
    """Start a student from finished S3D8 containers (``gguf_s3d8.tensor_file.S3D8TensorFile``, e.g. GPTQ's):
    every S3D8 weight the file holds gets the container's codebook and frozen scales, and its master becomes
    the container's dequantised values (in HF row order), so the step-0 student computes exactly with the
    file's weights. Returns the GGUF names started so and those whose container was computed from other weights
    than the student's current ones (fingerprints, e.g. GPTQ run on f16-rounded weights); raises ValueError for a
    shape or type mismatch."""
    import gguf_s3d8
    from gguf_s3d8.container import read_container
    from gguf_s3d8.tensor_file import weight_fingerprint

    done: list[str] = []
    other: list[str] = []
    seen: set[int] = set()
    for m in model.modules():
        if not isinstance(m, (QuantLinear, QuantEmbedding)) or id(m.spec) in seen:
            continue
        seen.add(id(m.spec))
        spec = m.spec
        if spec.gguf_name not in tensors.containers:
            continue
        if spec.qtype != ggml_types.S3D8.name:
            raise ValueError(f"{spec.gguf_name}: the file holds an S3D8 container, the student stores {spec.qtype}")
        c = tensors.containers[spec.gguf_name]
        parts = read_container(c, name=spec.gguf_name)
        values = torch.from_numpy(gguf_s3d8.dequantize_s3d8(c, name=spec.gguf_name))
        if tuple(values.shape) != tuple(m.weight.shape):
            raise ValueError(f"{spec.gguf_name}: container of shape {tuple(values.shape)}, weight {tuple(m.weight.shape)}")
        hf = values if spec.perm is None else torch.empty_like(values).index_copy_(0, spec.perm, values)
        w = m.weight.detach().to(torch.float32)
        if weight_fingerprint((w if spec.perm is None else w[spec.perm]).numpy()) != tensors.fingerprints[spec.gguf_name]:
            other.append(spec.gguf_name)
        with torch.no_grad():
            m.weight.copy_(hf)
        spec.codebook = torch.from_numpy(np.array(parts.codebook, dtype=np.uint8))
        spec.scales = torch.from_numpy(parts.scales_bf16.astype(np.int32))
        done.append(spec.gguf_name)
    return done, other


class _FakeQuantWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, w_hat: torch.Tensor, block: int | None) -> torch.Tensor:
        ctx.block = block
        if block is not None:
            ctx.save_for_backward(w, w_hat)
        return w_hat.view_as(w_hat)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.block is None:
            return g, None, None
        w, w_hat = ctx.saved_tensors
        b = w.detach().reshape(-1, ctx.block)
        amax, arg = b.abs().max(dim=1)
        alpha = amax / 127
        ok = alpha > 0
        gb = g.reshape(-1, ctx.block)
        # d w_hat / d alpha = q - u = (w_hat - w) / alpha; d alpha / d w[arg] = sign(w[arg]) / 127
        s = (gb * (w_hat.reshape(-1, ctx.block) - b)).sum(dim=1) / torch.where(ok, alpha, torch.ones_like(alpha))
        extra = torch.where(ok, s, torch.zeros_like(s)) * torch.sign(b.gather(1, arg[:, None])[:, 0]) / 127
        out = gb.clone()
        out.scatter_add_(1, arg[:, None], extra[:, None])
        return out.reshape(g.shape), None, None


class _STE(torch.autograd.Function):
    """Forward: the given value; backward: the gradient unchanged (activations)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
        return x_hat

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _WeightCache:
    """Dequantised weights keyed by parameter identity, autograd version and, for trainable weights, the
    optimiser step (:meth:`new_step`).

    The version alone covers an in-place optimiser step in one process; it does not cover FSDP2, which
    all-gathers each step's new weights into the same unsharded Parameters without bumping their version
    (``torch.autograd._unsafe_preserve_version_counter``). Within a step every use of a weight (micro-batches,
    checkpoint recomputation, a tied LM head) shares one value. Frozen weights stay cached across steps.

    Entries hold a weak reference to their parameter and are checked against it, so a new parameter that
    reuses a freed one's ``id`` never sees a stale value; entries of freed parameters are dropped.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, tuple[int, int], WeightSpec, torch.Tensor]] = {}
        self._step = 0

    def new_step(self) -> None:
        """Expire the values of every trainable weight (call after each optimiser step)."""
        self._step += 1

    def get(self, w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
        key, stamp = id(w), (w._version, self._step if w.requires_grad else 0)
        hit = self._entries.get(key)
        if hit is not None and hit[0]() is w and hit[1] == stamp and hit[2] is spec:
            return hit[3]
        value = _dequantised(w, spec)
        self._entries[key] = (weakref.ref(w, functools.partial(self._drop, key)), stamp, spec, value)
        return value

    def _drop(self, key: int, ref: weakref.ref) -> None:
        hit = self._entries.get(key)
        if hit is not None and hit[0] is ref:
            del self._entries[key]


_CACHE = _WeightCache()


def weights_stepped() -> None:
    """Tell the fake quantisation that the optimiser has changed the trainable weights (hook it to the
    optimiser's step: ``opt.register_step_post_hook(lambda *_: weights_stepped())``)."""
    _CACHE.new_step()


def fake_quant_weight(w: torch.Tensor, spec: WeightSpec) -> torch.Tensor:
    """The dequantised GGUF value of ``w`` (forward) with the straight-through gradient (backward)."""
    return _FakeQuantWeight.apply(w, _CACHE.get(w, spec), spec.scale_block(w.shape[-1]))


class QuantLinear(nn.Module):
    """``y = act_q(x) @ fake_quant(W)^T (+ b)``; shares the original module's Parameters (ties survive)."""

    def __init__(self, base: nn.Linear, spec: WeightSpec, act_quant: bool = True) -> None:
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.spec = spec
        self.act = spec.activation_quantiser() if act_quant else None
        self.in_features, self.out_features = base.in_features, base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is not None:
            x = _STE.apply(x, self.act(x))
        return F.linear(x, fake_quant_weight(self.weight, self.spec), self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.spec.qtype} ({self.spec.gguf_name})"


class QuantEmbedding(nn.Module):
    """Embedding lookup in the fake-quantised table (llama.cpp's GET_ROWS dequantises the stored rows)."""

    def __init__(self, base: nn.Embedding, spec: WeightSpec) -> None:
        super().__init__()
        self.weight = base.weight
        self.padding_idx = base.padding_idx
        self.spec = spec

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, fake_quant_weight(self.weight, self.spec), self.padding_idx)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, {self.spec.qtype} ({self.spec.gguf_name})"


def quantise_student(model: nn.Module, specs: dict[str, WeightSpec], *, act_quant: bool = True) -> nn.Module:
    """Replace every Linear/Embedding of ``model`` (in place) by its fake-quantised version; returns it."""
    by_param = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for spec in specs.values():
        by_param[id(params[spec.hf_name])] = spec
    for mod_name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, (nn.Linear, nn.Embedding)):
                found = by_param.get(id(child.weight))
                if found is None:
                    raise ValueError(f"no weight spec for {mod_name}.{child_name}")
                new = QuantLinear(child, found, act_quant) if isinstance(child, nn.Linear) else QuantEmbedding(child, found)
                setattr(mod, child_name, new)
    return model


def student_specs(model: nn.Module) -> dict[str, WeightSpec]:
    """The specs of a quantised student (one per distinct weight)."""
    out: dict[str, WeightSpec] = {}
    for m in model.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            out[m.spec.hf_name] = m.spec
    return out

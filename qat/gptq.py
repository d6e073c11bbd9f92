"""GPTQ for every format of ``qat.formats`` (scalar INT/Student-t/Lloyd-Max and the S3D8 vector variant).

Algorithm (reference-recipe section 6, mirroring GPTQModel as the reference does):

* Hessian ``H = (2/N) sum_x x x^T`` (float64 accumulation) of the inputs ``x`` seen by a Linear over N
  calibration token rows (:class:`HessianCollector`, forward pre-hooks).
* Dead inputs (``H_ii == 0``): ``H_ii = 1`` and the weight column is zeroed before quantisation.
* Damping ``H + d * mean(diag H) * I`` with ``d = 0.05``; when the Cholesky factorisation fails, ``d`` grows
  by 0.01 until it succeeds (:func:`inverse_hessian_factor`).
* Group-aware act order: columns are permuted *within* each scale group of the format (the block of G
  inputs, or the whole row) by decreasing ``H_ii``, and the groups are ordered by their largest ``H_ii``
  (GPTQModel's ``act_group_aware``). A group's columns therefore stay together, so its scale parameters
  are computed once - from the group's current (error-updated) values when GPTQ reaches its first
  column (``static_groups=False``) - and hold for all of its columns: the output is a valid instance of
  the format (same scales per block as a direct cast would store).
* ``U = chol(H^-1)^T`` (upper); lazy batch updates over blocks of 128 columns: each column is quantised,
  its error ``(w - q) / U_jj`` is fed back to the remaining columns of the block through row j of U, and
  to the later blocks once per block.
* The permutation is undone at the end.

The per-matrix, fixed parts of a format (Student-t and Lloyd-Max tables, S3D8 codebook and bf16 row
scales) are fitted once on the original weight by ``fmt.quantiser(w)`` - exactly as the direct cast fits
them - and the same quantiser object quantises each column. For S3D8 a column's quantisation is the
vector quantisation of its row triples (3 rows x 1 column) to the nearest centroid with signs, done by
the codec (``qat.formats.S3D8Quantiser``); the error of all three rows is fed back. Hence, with
``H = I`` (no cross-column coupling) GPTQ returns the direct cast bit for bit (tested).

Model level: :func:`collect_hessians` runs calibration batches through the *unquantised* model once and
keeps one Hessian per Linear (Linears fed the same input tensor, e.g. q/k/v, share one). All Linears
are then quantised from these Hessians ("one-shot", not GPTQModel's layer-sequential re-capture after
each quantised layer - a deliberate simplification that lets one set of Hessians serve every format;
it is documented in ``docs/baselines.md``). :func:`quantise_model` applies GPTQ (or a direct cast) to
every ``nn.Linear`` - in mllama also the vision encoder, cross-attention, projector and lm_head - and a
direct cast to every ``nn.Embedding`` whose weight is not tied to an already quantised Linear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

import torch

from qat.formats import GroupQuantiser, WeightFormat, direct_cast
from qat.mllama_hf import meta_taps

__all__ = [
    "GPTQConfig",
    "GPTQStats",
    "HessianCollector",
    "collect_hessians",
    "group_aware_order",
    "inverse_hessian_factor",
    "gptq_quantise",
    "quantise_model",
    "linear_modules",
    "layer_stages",
    "gptq_sequential",
]


@dataclass(frozen=True)
class GPTQConfig:
    """GPTQ settings (defaults are the reference's)."""

    damp: float = 0.05  # fraction of mean(diag H) added to the diagonal
    damp_step: float = 0.01  # added to ``damp`` after each failed Cholesky
    max_damp: float = 10.0
    block: int = 128  # lazy batch size (columns)
    act_order: bool = True  # group-aware act order


@dataclass
class GPTQStats:
    """What happened to one matrix."""

    damp: float  # damping fraction finally used
    dead_columns: int
    cholesky_failures: int


# ---------------------------------------------------------------------------------------------------
# Hessians


class HessianCollector:
    """Accumulates ``sum x x^T`` (float64) and the row count of a Linear's inputs."""

    def __init__(self, k: int) -> None:
        self.xtx = torch.zeros(k, k, dtype=torch.float64)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        self.xtx.addmm_(x2.T, x2)
        self.n += x2.shape[0]

    def hessian(self) -> torch.Tensor:
        """``(2/N) sum x x^T`` as float32 (zeros if nothing was seen)."""
        if self.n == 0:
            return torch.zeros_like(self.xtx, dtype=torch.float32)
        return (self.xtx * (2.0 / self.n)).to(torch.float32)


def linear_modules(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every ``nn.Linear`` of a model by qualified name (lm_head included)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


class _StopForward(Exception):
    """Raised by a hook once every wanted module has seen its input (the rest of the forward is useless)."""


def collect_hessians(model: torch.nn.Module, batches: Iterable[dict[str, Any]],
                     modules: dict[str, torch.nn.Linear] | None = None,
                     progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
                     stop_early: bool = False) -> dict[str, HessianCollector]:
    """Run ``model(**batch)`` for each calibration batch and collect every Linear's input Hessian (Llama 3.2
    Vision with Meta's intermediate-layer taps, :func:`qat.mllama_hf.meta_taps`, so the projector sees the
    inputs it sees in llama.cpp).

    Consecutive hooks that see the very same input tensor (q/k/v, gate/up) share one collector, so the
    product is computed and stored once. Modules that receive no input get a collector with ``n == 0``.
    ``stop_early``: abandon each forward pass as soon as every module in ``modules`` has been called once
    (for layer-sequential GPTQ, where only one layer's modules are hooked).
    """
    modules = linear_modules(model) if modules is None else modules
    collectors: dict[str, HessianCollector] = {}
    last: dict[str, Any] = {"x": None, "c": None}

    seen: set[str] = set()

    def hook(name: str) -> Callable[..., None]:
        def fn(mod: torch.nn.Module, args: tuple[Any, ...]) -> None:
            seen.add(name)
            x = args[0]
            if x is last["x"] and last["c"].xtx.shape[0] == x.shape[-1]:
                collectors.setdefault(name, last["c"])
                if collectors[name] is last["c"]:
                    return _maybe_stop()
            c = collectors.setdefault(name, HessianCollector(x.shape[-1]))
            c.add(x)
            last["x"], last["c"] = x, c
            _maybe_stop()
        return fn

    def _maybe_stop() -> None:
        if stop_early and len(seen) == len(modules):
            raise _StopForward

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        with torch.no_grad(), meta_taps():  # an mllama vision encoder taps layer inputs, as llama.cpp does
            for batch in (progress(batches) if progress else batches):
                seen.clear()
                try:
                    model(**batch)
                except _StopForward:
                    pass
                last["x"] = last["c"] = None
    finally:
        for h in handles:
            h.remove()
    for n, m in modules.items():
        collectors.setdefault(n, HessianCollector(m.in_features))
    return collectors


# ---------------------------------------------------------------------------------------------------
# core


def group_aware_order(diag: torch.Tensor, group: int) -> torch.Tensor:
    """Column permutation: within each group of ``group`` consecutive columns by decreasing ``diag``
    (stable), groups by decreasing maximum (stable). Equal diagonals give the identity."""
    k = diag.numel()
    starts = list(range(0, k, group))
    members = [torch.arange(s, min(k, s + group)) for s in starts]
    inner = [m[torch.argsort(diag[m], descending=True, stable=True)] for m in members]
    gmax = torch.stack([diag[m].max() for m in members])
    order = torch.argsort(gmax, descending=True, stable=True)
    return torch.cat([inner[i] for i in order.tolist()])


def inverse_hessian_factor(h: torch.Tensor, cfg: GPTQConfig = GPTQConfig()) -> tuple[torch.Tensor, float, int]:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1``, increasing ``damp`` on failure.

    Returns (factor, damping fraction used, number of failed attempts). float64 internally.
    """
    h64 = h.to(torch.float64)
    mean_diag = float(torch.diagonal(h64).mean())
    eye = torch.eye(h.shape[0], dtype=torch.float64)
    damp, failures = cfg.damp, 0
    while True:
        l, info = torch.linalg.cholesky_ex(h64 + damp * mean_diag * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(l)
            u, info2 = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info2) == 0:
                return u, damp, failures
        failures += 1
        damp += cfg.damp_step
        if damp > cfg.max_damp:
            raise RuntimeError(f"Hessian not positive definite even with damping {damp:.2f} x mean(diag)")


def gptq_quantise(w: torch.Tensor, h: torch.Tensor, quantiser: GroupQuantiser,
                  cfg: GPTQConfig = GPTQConfig()) -> tuple[torch.Tensor, GPTQStats]:
    """GPTQ-quantise an fp32 weight (rows, k) with Hessian ``h`` (k, k) and a fitted format quantiser.

    Returns the dequantised weight (rows, k) float32 and statistics. See the module docstring.
    """
    w = w.detach().to(torch.float32).clone()
    rows, k = w.shape
    h = h.detach().to(torch.float32).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    group = max(1, min(quantiser.group or k, k))
    perm = group_aware_order(torch.diagonal(h), group) if cfg.act_order else torch.arange(k)
    inv = torch.argsort(perm)
    w = w[:, perm].contiguous()
    h = h[perm][:, perm]
    u, damp, failures = inverse_hessian_factor(h, cfg)
    u = u.to(torch.float32)
    # position -> (first position of its group, one past its last) in the permuted order; groups are
    # contiguous there because the permutation keeps them together
    gid = perm // group
    q = torch.zeros_like(w)
    params: object = None
    pos = 0
    while pos < k:
        end = min(k, pos + cfg.block)
        if group <= cfg.block:  # end blocks on group boundaries, so a group's columns share one block
            while end < k and gid[end] == gid[end - 1]:
                end += 1
        w1 = w[:, pos:end].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[pos:end, pos:end]
        for i in range(end - pos):
            j = pos + i
            if j == 0 or gid[j] != gid[j - 1]:
                g_end = j + int((gid[j:] == gid[j]).sum())  # contiguous run
                cols = torch.cat([w1[:, i:], w[:, end:]], dim=1)[:, : g_end - j]
                params = quantiser.group_params(cols[:, torch.argsort(perm[j:g_end])])  # original order
            col = w1[:, i:i + 1]
            qc = quantiser.quantise_columns(col, params).to(torch.float32)
            q[:, j:j + 1] = qc
            e = (col - qc) / u1[i, i]
            w1[:, i:] -= e @ u1[i:i + 1, i:]
            err1[:, i:i + 1] = e
        w[:, end:] -= err1 @ u[pos:end, end:]
        pos = end
    return q[:, inv].contiguous(), GPTQStats(damp=damp, dead_columns=int(dead.sum()), cholesky_failures=failures)


# ---------------------------------------------------------------------------------------------------
# model level


@dataclass
class ModelQuantReport:
    """Which tensors were quantised how."""

    gptq: dict[str, GPTQStats] = field(default_factory=dict)
    direct: list[str] = field(default_factory=list)  # direct cast (embeddings, Linears without data)
    bits: float = 0.0  # total stored bits of the quantised tensors
    params: int = 0  # their parameter count

    @property
    def bits_per_param(self) -> float:
        return self.bits / self.params if self.params else math.nan

    def merge(self, other: "ModelQuantReport") -> None:
        """Add the tensors of ``other`` (quantised in another pass over the same model)."""
        self.gptq.update(other.gptq)
        self.direct += other.direct
        self.bits += other.bits
        self.params += other.params


def quantise_model(model: torch.nn.Module, fmt: WeightFormat, *, method: Literal["gptq", "direct"] = "gptq",
                   hessians: dict[str, HessianCollector] | None = None, cfg: GPTQConfig = GPTQConfig(),
                   include: Callable[[str, torch.nn.Module], bool] = lambda name, mod: True,
                   progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None,
                   quantisers: dict[str, GroupQuantiser] | None = None) -> ModelQuantReport:
    """Quantise (in place) every ``nn.Linear`` and ``nn.Embedding`` weight of ``model`` with ``fmt``.

    ``method="gptq"`` needs ``hessians`` (from :func:`collect_hessians`); Linears whose collector saw no
    data fall back to a direct cast (listed in the report). Embeddings are direct-cast unless their weight
    is the same tensor as a quantised Linear's (tied lm_head): then they already hold its quantised values.
    ``include(name, module)`` restricts the scope. Weights are quantised in float32 and written back in
    the parameter's dtype. ``quantisers``: a dict (by module name) of already fitted quantisers to reuse
    and fill - the fit depends only on the original weight, so a direct cast and GPTQ of the same format
    can share it (S3D8's codebook fit is the slow part).
    """
    if method == "gptq" and hessians is None:
        raise ValueError("method='gptq' needs hessians")
    report = ModelQuantReport()
    done: set[int] = set()
    targets = [(n, m) for n, m in model.named_modules()
               if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) and include(n, m)]
    targets.sort(key=lambda t: isinstance(t[1], torch.nn.Embedding))  # Linears first (tied lm_head)
    for name, mod in (progress(targets) if progress else targets):
        p = mod.weight
        if id(p) in done:
            continue
        done.add(id(p))
        w = p.detach().to(torch.float32)
        if quantisers is not None and name in quantisers:
            quantiser = quantisers[name]
        else:
            quantiser = fmt.quantiser(w)
            if quantisers is not None:
                quantisers[name] = quantiser
        coll = hessians.get(name) if hessians is not None else None
        if method == "gptq" and isinstance(mod, torch.nn.Linear) and coll is not None and coll.n > 0:
            q, stats = gptq_quantise(w, coll.hessian(), quantiser, cfg)
            report.gptq[name] = stats
        else:
            q = direct_cast(quantiser, w)
            report.direct.append(name)
        with torch.no_grad():
            p.copy_(q.to(p.dtype))
        report.bits += fmt.bits_per_param(tuple(w.shape)) * w.numel()
        report.params += w.numel()
    return report


def layer_stages(model: torch.nn.Module) -> list[list[str]]:
    """Linears grouped by decoder/encoder layer (``...layers.<i>.``), in module order; others alone."""
    import re

    stages: dict[str, list[str]] = {}
    for name in linear_modules(model):
        m = re.match(r"(.*\.layers\.\d+)\.", name)
        stages.setdefault(m.group(1) if m else name, []).append(name)
    return list(stages.values())


def _names_in(names: frozenset[str]) -> Callable[[str, torch.nn.Module], bool]:
    """``include`` for :func:`quantise_model`: the modules whose qualified name is in ``names``."""
    return lambda n, m: n in names


def gptq_sequential(model: torch.nn.Module, fmt: WeightFormat, batches: list[dict[str, Any]], *,
                    cfg: GPTQConfig = GPTQConfig(), quantisers: dict[str, GroupQuantiser] | None = None,
                    progress: Callable[[Iterable[Any]], Iterable[Any]] | None = None) -> ModelQuantReport:
    """Layer-sequential GPTQ (as GPTQModel): the Hessians of each layer's Linears are collected with all
    earlier layers already quantised, then that layer is quantised; then embeddings (direct cast, unless
    tied to a quantised Linear). Costs one (early-stopped) calibration pass per layer."""
    mods = linear_modules(model)
    report = ModelQuantReport()
    stages = layer_stages(model)
    for stage in (progress(stages) if progress else stages):
        hs = collect_hessians(model, batches, modules={n: mods[n] for n in stage}, stop_early=True)
        part = quantise_model(model, fmt, method="gptq", hessians=hs, cfg=cfg, quantisers=quantisers,
                              include=_names_in(frozenset(stage)))
        report.merge(part)
    done = {id(m.weight) for m in mods.values()}
    report.merge(quantise_model(model, fmt, method="direct", include=lambda n, m: id(m.weight) not in done))
    return report

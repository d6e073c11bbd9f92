"""Why no layer-local objective picks the good S3D8 encoding of SmolLM2's last ``ffn_down`` (issue 34).

``research/s3d8_robustness.py`` found the whole machine-to-machine lottery of S3D8 + imatrix in one matrix,
``blk.29.ffn_down`` (docs/quality.md, "The lottery, localised"). This script measures, for iw1 encodings of that
matrix (k-means seeds x imatrix variants), how much each one costs the model and which error measure an encoder
could have used to tell them apart:

- **layer KLD**: KLD(f16 || model) on the main job's held-out text (24 x 512 tokens, transformers' tokenizer)
  when only this matrix is replaced by its dequantised encoding. Exact for the last layer, cheaply: the input of
  ``ffn_down`` and the residual before it are captured once from the f16 transformers model, then the residual,
  the final RMSNorm and the LM head are recomputed per encoding.
- **Fisher**: the second-order estimate ``1/2 E_t E_y~p[(s_ty . (dW x_t))^2]`` with ``s_ty`` the gradient of
  ``log p(y)`` with respect to the final residual (two labels sampled per token, fixed seed): the part of the
  error the logits see. If it tracks the layer KLD, the KLD is explained by second-order output-side effects.
- **encoders**: ``iw1`` (``llama-quantize --imatrix``'s bytes at seed 0) and ``gptq`` (``llama-quantize --imatrix
  --hessian``'s algorithm, the numpy/torch twin ``qat.gptq_s3d8``: iw1's codebook and scales from the imatrix variant
  and seed, then GPTQ with the X^T X of this matrix's inputs on the main job's *training* text; under ``pert`` the
  X^T X is perturbed like the imatrix, every entry by 1 +- 1e-6, symmetrically). Both encode the f16 GGUF's weights,
  what llama-quantize reads.
- **local measures** an encoder can compute from the weights and llama-quantize's inputs: iw1's own objective
  ``sum_ij u_j dW_ij^2`` (imatrix ``u``), the full ``tr(dW XtX dW^T)`` (what GPTQ minimises; from the captured
  inputs), the plain weight MSE, and ``tr(dW (diag(u - mu^2) + mu mu^T) dW^T)`` from the imatrix's ``in_sum``.

Each measure's Spearman rank correlation with the layer KLD is reported. Needs the main job's cache
(``bash ci/main.sh``), the HF checkpoint it converted (``.cache/models/SmolLM2-135M-Instruct-hf``) and torch.
Run (about 1 minute per encoding on 2 cores):

    .venv/bin/python research/s3d8_last_layer.py --encoders iw1 gptq --seeds 0 1 2 3 4 --imatrices t2 pert \\
        --json research/results/s3d8_last_layer.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from gguf_s3d8 import dequantize_s3d8, series_gguf
from gguf_s3d8.fsio import atomic_path, atomic_write

# benchmarks/ is a folder of scripts, not a package: the script's own folder is sys.path[0] when it runs
from s3d8_fit_streams import MAIN_JOB, ROOT  # type: ignore[import-not-found]
from s3d8_robustness import (  # type: ignore[import-not-found]
    ENCODERS,
    PERTURBATION_SEED,
    imatrix_variant,
    perturbation_factors,
)

HF_DIR = ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct-hf"
CHUNKS, CTX = 24, 512
FISHER_LABELS, FISHER_SEED = 2, 0
CACHE = MAIN_JOB / "robustness"


def _forward_chunks(text: Path, chunks: int, torch: Any) -> tuple[Any, list[Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy, optional

    tok = AutoTokenizer.from_pretrained(HF_DIR)
    model = AutoModelForCausalLM.from_pretrained(HF_DIR, dtype=torch.float32).eval()
    ids = tok(text.read_text(), return_tensors="pt").input_ids[0]
    if ids.numel() < chunks * CTX:
        sys.exit(f"{text} has {ids.numel()} tokens, fewer than {chunks} x {CTX}")
    return model, [ids[c * CTX:(c + 1) * CTX][None] for c in range(chunks)]


def training_hessian(layer: int, torch: Any) -> Any:
    """``H = (2/N) X^T X`` of ``blk.<layer>.ffn_down``'s inputs over the main job's training text (64 x 512 tokens,
    what llama-imatrix read), collected by qat.gptq's own collector, as qat.gptq_s3d8 forms it (cached)."""
    path = CACHE / f"last-layer-hessian-{layer}.pt"
    if path.exists():
        return torch.load(path)
    from qat.gptq import collect_hessians  # torch

    model, chunks = _forward_chunks(MAIN_JOB / "train.txt", 64, torch)
    down = {"down": model.model.layers[layer].mlp.down_proj}
    hessian = collect_hessians(model, [{"input_ids": c} for c in chunks], down, stop_early=True)["down"].hessian()
    _save(torch, hessian, path)
    return hessian


def _save(torch: Any, obj: Any, path: Path) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


def perturbed(hessian: Any, torch: Any) -> Any:
    """Every entry times 1 + e or 1 - e (e = RELATIVE_PERTURBATION, a fixed random sign per entry, symmetric)."""
    factors = perturbation_factors(np.random.default_rng(PERTURBATION_SEED + 1), hessian.shape, symmetric=True)
    return (hessian.double() * torch.from_numpy(factors)).float()


def gguf_weight(name: str) -> np.ndarray:
    """The weight as llama-quantize reads it: the f16 GGUF's values in float32."""
    tensors = {t.name: t for t in series_gguf().GGUFReader(MAIN_JOB / "smollm2-135m-f16.gguf").tensors}
    return np.array(tensors[name].data, dtype=np.float32)


def capture(layer: int, torch: Any) -> dict[str, Any]:
    """Inputs of ``blk.<layer>.ffn_down`` and the residual entering that layer's MLP on the held-out text, with
    the tensors needed to finish the forward pass (cached)."""
    path = CACHE / f"last-layer-states-{layer}.pt"
    if path.exists():
        return dict(torch.load(path))
    model, chunks = _forward_chunks(MAIN_JOB / "eval.txt", CHUNKS, torch)
    if layer != model.config.num_hidden_layers - 1:
        sys.exit(f"layer {layer} is not the last ({model.config.num_hidden_layers - 1}): the capture finishes the "
                 "forward pass with the final norm and the LM head only")
    xs: list[Any] = []
    hs: list[Any] = []
    block = model.model.layers[layer]
    h1 = block.mlp.down_proj.register_forward_hook(lambda _m, inp, _o: xs.append(inp[0][0].clone()))
    h2 = block.post_attention_layernorm.register_forward_pre_hook(lambda _m, inp: hs.append(inp[0][0].clone()))
    with torch.no_grad():
        for c in chunks:
            model(c)
    h1.remove()
    h2.remove()
    states = {"x": torch.stack(xs), "h": torch.stack(hs), "w": block.mlp.down_proj.weight.detach().clone(),
              "g": model.model.norm.weight.detach().clone(), "eps": float(model.config.rms_norm_eps),
              "head": model.lm_head.weight.detach().clone()}
    _save(torch, states, path)
    return states


class LastLayer:
    """The model's output as a function of the last ``ffn_down`` matrix, everything else f16 (float32 here)."""

    def __init__(self, states: dict[str, Any], torch: Any) -> None:
        self.t = torch
        self.x, self.h, self.w = states["x"], states["h"], states["w"]
        self.g, self.eps, self.head = states["g"], states["eps"], states["head"]
        with torch.no_grad():
            self.base = [self._logp(self.w, b) for b in range(self.x.shape[0])]
        self.scores = self._fisher_scores()

    def _logp(self, w: Any, b: int) -> Any:
        r = self.h[b] + self.x[b] @ w.T
        n = r * self.t.rsqrt(r.pow(2).mean(-1, keepdim=True) + self.eps) * self.g
        return self.t.log_softmax(n @ self.head.T, -1)

    def _fisher_scores(self) -> Any:
        """d log p(y) / d residual for FISHER_LABELS labels y ~ p per token: (chunks, tokens, labels, d)."""
        torch = self.t
        gen = torch.Generator().manual_seed(FISHER_SEED)
        out = []
        for b in range(self.x.shape[0]):
            r = (self.h[b] + self.x[b] @ self.w.T).requires_grad_(True)
            n = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + self.eps) * self.g
            lp = torch.log_softmax(n @ self.head.T, -1)
            ys = torch.multinomial(lp.exp().detach(), FISHER_LABELS, replacement=True, generator=gen)
            grads = [torch.autograd.grad(lp.gather(1, ys[:, i:i + 1]).sum(), r, retain_graph=True)[0]
                     for i in range(FISHER_LABELS)]
            out.append(torch.stack(grads, 1))
        return torch.stack(out)

    def kld(self, w: Any) -> float:
        with self.t.no_grad():
            total = 0.0
            for b, lp in enumerate(self.base):
                total += float((lp.exp() * (lp - self._logp(w, b))).sum())
            return total / (self.x.shape[0] * self.x.shape[1])

    def fisher(self, w: Any) -> float:
        with self.t.no_grad():
            d = self.x @ (w - self.w).T
            return float(0.5 * ((self.scores * d[:, :, None, :]).sum(-1) ** 2).mean())


def imatrix_mean(path: Path, name: str) -> np.ndarray | None:
    """The mean input ``in_sum / counts`` of one weight in a GGUF imatrix (None when the file has no ``in_sum``)."""
    tensors = {t.name: t for t in series_gguf().GGUFReader(path).tensors}
    if name + ".in_sum" not in tensors:
        return None
    count = float(np.asarray(tensors[name + ".counts"].data).reshape(-1)[0])
    return np.asarray(tensors[name + ".in_sum"].data, dtype=np.float64).reshape(-1) / count


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layer", type=int, default=29, help="the last layer (default 29)")
    ap.add_argument("--encoders", nargs="+", choices=["iw1", "gptq"], default=["iw1", "gptq"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--imatrices", nargs="+", default=["t2", "pert"], metavar="VARIANT",
                    help="t2, t1, pert or an imatrix file (s3d8_robustness.py; default: t2 pert)")
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "build" / "host" / "bin")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    import torch  # heavy, optional

    torch.set_num_threads(args.threads)
    name = f"blk.{args.layer}.ffn_down.weight"
    model = LastLayer(capture(args.layer, torch), torch)
    w32 = gguf_weight(name)
    w = model.w.double().numpy()  # the transformers weights the layer KLD compares with (bf16 values)
    hessian = training_hessian(args.layer, torch) if "gptq" in args.encoders else None
    x = model.x.reshape(-1, model.x.shape[-1]).double()
    xtx = (x.T @ x / x.shape[0]).numpy()
    mean = imatrix_mean(MAIN_JOB / "imatrix.gguf", name)
    rows: list[dict[str, Any]] = []
    for spec in args.imatrices:
        u = imatrix_variant(spec, args.bin_dir)[name].astype(np.float64)
        mu_h = None if mean is None else np.outer(mean, mean) + np.diag(u - mean * mean)
        for encoder, seed in [(e, s) for e in args.encoders for s in args.seeds]:
            container = ENCODERS["iw1"](w32, u.astype(np.float32), seed, name)
            if encoder == "gptq":
                from qat.gptq_s3d8 import gptq_s3d8_matrix  # torch

                h = hessian if spec != "pert" else perturbed(hessian, torch)
                container = gptq_s3d8_matrix(w32, h, name=name, seed=seed, start=container).container
            wq = dequantize_s3d8(container).astype(np.float64)
            dw = wq - w
            row = {"encoder": encoder, "imatrix": spec, "seed": seed,
                   "layer_kld": model.kld(torch.from_numpy(wq.astype(np.float32))),
                   "fisher": model.fisher(torch.from_numpy(wq.astype(np.float32))),
                   "iw1_objective": float(((dw * dw) @ u).sum()),
                   "xtx_error": float(np.einsum("ij,jk,ik->", dw, xtx, dw)),
                   "weight_mse": float((dw * dw).sum())}
            if mu_h is not None:
                row["imatrix_mean_error"] = float(np.einsum("ij,jk,ik->", dw, mu_h, dw))
            rows.append(row)
            print(" ".join(f"{k} {v:.5g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    corr: dict[str, dict[str, float]] = {}
    for encoder in args.encoders:
        mine = [r for r in rows if r["encoder"] == encoder]
        klds = [r["layer_kld"] for r in mine]
        print(f"{encoder}: layer KLD worst {max(klds):.4f} best {min(klds):.4f} over {len(klds)} encodings")
        corr[encoder] = {m: spearman(klds, [r[m] for r in mine]) for m in mine[0]
                         if m not in ("encoder", "imatrix", "seed", "layer_kld")}
        print(f"{encoder}: Spearman rank correlation with the layer KLD: "
              + ", ".join(f"{m} {v:+.2f}" for m, v in corr[encoder].items()))
    if args.json:
        atomic_write(args.json, json.dumps({"layer": args.layer, "encoders": args.encoders, "rows": rows,
                                            "spearman": corr, "fisher_labels": FISHER_LABELS, "chunks": CHUNKS,
                                            "ctx": CTX}, indent=1) + "\n")


if __name__ == "__main__":
    main()

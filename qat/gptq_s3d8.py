"""GPTQ for the S3D8 GGUF: calibration text in, finished S3D8 containers out (``convert/to_gguf.py --gptq-checkpoint``).

For every matrix the converter stores as S3D8 (the type plan of ``convert.tensor_types.choose_type``, in
llama.cpp's row order, as :mod:`qat.student` plans it):

1. **Hessian** ``H = (2/N) sum x x^T`` of the matrix's inputs over the calibration tokens
   (:func:`qat.gptq.collect_hessians` on the fp32 model, one pass, stopped after the last S3D8 matrix).
2. **Start**: the importance-aware encoder ``iw1`` (what ``llama-quantize --imatrix`` runs: in C through
   ``libs3d8-native`` when it is built, else :mod:`gguf_s3d8.importance`, the same bytes) with the importance ``diag(H)`` - llama-imatrix's statistic (mean squared activation per
   input column, up to the factor 2 that ``iw1``'s normalisation removes) - gives the codebook and the per-row
   scales, which stay fixed.
3. **GPTQ** (:func:`qat.gptq.gptq_quantise`, act order, damping 0.05, lazy blocks of 128): column by column,
   each row triple takes its nearest codebook entry *in weight space* under the fixed scales
   (:func:`qat.s3d8_torch.s3d8_weight_space_values`) and the error is fed back through the inverse Hessian.
4. **Container**: the GPTQ values re-encoded with ``gguf_s3d8.importance.quantize_s3d8_with_scales`` - checked
   to give back every value bit for bit.

The containers go into an S3D8 tensor file (:mod:`gguf_s3d8.tensor_file`, with the fingerprint of each source
weight), which ``convert/to_gguf.py MODEL --type s3d8 --gptq-checkpoint FILE`` writes verbatim into the GGUF
(GPTQ is this first command; the converter does not run it) and ``qat.train --init-from FILE`` starts QAT from.

Calibration data: a plain text file (tokenised, cut into ``--seq-len`` windows) or a ``qat.generate`` JSONL
(prompt + response per sample; for Llama 3.2 Vision with the images, which the vision encoder, projector and
cross-attention layers need). Matrices that see no calibration input keep the ``iw1`` encoding without
importance (listed in the report).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from convert.tensor_types import FALLBACK_TYPES, OUT_TYPES
from gguf_s3d8.ggml_types import S3D8, WEIGHT_TYPES, ggml_type
from qat.errors import TrainError, cli_error
from qat.formats import torch_twin
from qat.gptq import GPTQConfig, GPTQStats, collect_hessians, gptq_quantise
from qat.training.data import sample_inputs, tokenise_samples
from qat.training.models import load_teacher, model_type

PRODUCER = "gptq-iw1"
#: ``--weights-dtype``: the element-wise float types (the type of an unquantised GGUF the model may come from)
FLOAT_TYPES = tuple(t.name for t in WEIGHT_TYPES if t.block_size == 1)


class GPTQError(Exception):
    """Unusable input (model, calibration file, options); the message says what to do."""


class FrozenS3D8Quantiser:
    """The GPTQ column quantiser of one S3D8 matrix (``qat.gptq.GroupQuantiser``): fixed codebook and row scales
    for the whole matrix, nearest entry in weight space."""

    group = 0  # one parameter set (the fixed scales) for the whole row

    def __init__(self, codebook: np.ndarray, scales_bf16: np.ndarray) -> None:
        from gguf_s3d8.scales import scales_to_fp32

        self._codebook = torch.from_numpy(np.array(codebook, dtype=np.uint8))
        self._alpha = torch.from_numpy(scales_to_fp32(np.asarray(scales_bf16, dtype=np.uint16)).astype(np.float32))

    def group_params(self, cols: torch.Tensor) -> None:
        return None

    def quantise_columns(self, cols: torch.Tensor, params: object = None) -> torch.Tensor:
        from qat.s3d8_torch import s3d8_weight_space_values

        return s3d8_weight_space_values(cols, self._codebook, self._alpha)


@dataclass
class MatrixResult:
    """One S3D8 matrix: its container and how it was made."""

    container: np.ndarray
    fingerprint: str
    stats: GPTQStats | None  # None: no calibration input reached it (iw1 without importance)
    seconds: float


def iw1_container(w: np.ndarray, importance: np.ndarray | None, *, name: str, seed: int = 0,
                  centroid_rule: str | None = None) -> np.ndarray:
    """The iw1 container of ``w`` (GPTQ's start): in C when ``libs3d8-native`` is built (llama-quantize's own code,
    several times faster), else in numpy - the same bytes (tests/python/test_native.py). A library from another build
    of the series is an error, never a silent fallback (``convert.encoders.load_backend``)."""
    import os

    from convert.encoders import load_backend
    from convert.errors import ConvertError
    from gguf_s3d8.importance import quantize_s3d8_importance

    rule = {"centroid_rule": centroid_rule} if centroid_rule else {}
    try:
        native: Any = load_backend("auto", notice=False)
    except ConvertError as e:
        raise GPTQError(str(e)) from e
    if native is None:
        return quantize_s3d8_importance(w, importance, name=name, seed=seed, **rule)
    return native.quantize(w, "s3d8", importance=importance, seed=seed, threads=os.cpu_count() or 1, name=name,
                           **rule)


def gptq_s3d8_matrix(w: np.ndarray, hessian: torch.Tensor | None, *, name: str = "", seed: int = 0,
                     centroid_rule: str | None = None, cfg: GPTQConfig = GPTQConfig(),
                     start: np.ndarray | None = None) -> MatrixResult:
    """GPTQ one fp32 matrix (n, k) in llama.cpp's row order with its input Hessian (k, k) (module docstring).

    ``hessian`` None: the ``iw1`` container without importance (no data reached the matrix). ``start``: a
    container of this matrix whose codebook and scales to keep (e.g. ``llama-quantize --imatrix``'s, the C twin
    of iw1) instead of running iw1 here."""
    import gguf_s3d8
    from gguf_s3d8.container import read_container
    from gguf_s3d8.importance import quantize_s3d8_with_scales
    from gguf_s3d8.tensor_file import weight_fingerprint

    t0 = time.time()
    w = np.ascontiguousarray(w, dtype=np.float32)
    importance = None if hessian is None else torch.diagonal(hessian).clamp(min=0).numpy().astype(np.float32)
    if start is None:
        start = iw1_container(w, importance, name=name, seed=seed, centroid_rule=centroid_rule)
    if hessian is None:
        return MatrixResult(start, weight_fingerprint(w), None, time.time() - t0)
    parts = read_container(start, name=name)
    quantiser = FrozenS3D8Quantiser(parts.codebook, parts.scales_bf16)
    q, stats = gptq_quantise(torch.from_numpy(w), hessian, quantiser, cfg)
    values = q.numpy()
    container = quantize_s3d8_with_scales(values, parts.codebook, parts.scales_bf16, name=name)
    if not np.array_equal(gguf_s3d8.dequantize_s3d8(container, name=name).view(np.uint32), values.view(np.uint32)):
        raise AssertionError(f"{name}: the S3D8 container does not reproduce the GPTQ values")  # an invariant
    return MatrixResult(container, weight_fingerprint(w), stats, time.time() - t0)


# ---------------------------------------------------------------------------------------------------
# calibration data


@dataclass
class Calibration:
    """Model inputs of the calibration pass and what they were made of."""

    batches: list[dict[str, torch.Tensor]]
    tokens: int
    source: str
    sha256: str
    info: dict[str, Any] = field(default_factory=dict)


def read_calibration(model_dir: Path, path: Path, *, tokens: int, seq_len: int) -> Calibration:
    """Calibration batches for ``model_dir`` from a text file or a ``qat.generate`` JSONL (up to ``tokens``)."""
    if not path.is_file():
        raise GPTQError(f"{path}: no such calibration file")
    if tokens < 1 or seq_len < 2:
        raise GPTQError("--calibration-tokens must be >= 1 and --calibration-seq-len >= 2")
    try:
        mllama = model_type(model_dir) == "mllama"
    except TrainError as e:
        raise GPTQError(str(e)) from e
    raw = path.read_bytes()
    sha = hashlib.sha256(raw).hexdigest()
    if path.suffix == ".jsonl":
        return _jsonl_calibration(model_dir, path, sha, tokens=tokens, seq_len=seq_len)
    if mllama:
        raise GPTQError(f"{path}: Llama 3.2 Vision needs calibration samples with images - a qat.generate JSONL "
                        "(python -m qat.generate --model DIR --out calib.jsonl), not plain text")
    from transformers import AutoTokenizer

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GPTQError(f"{path}: not UTF-8 text ({e})") from e
    ids = AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"]
    n_win = min(len(ids) // seq_len, max(1, tokens // seq_len))
    if n_win == 0:
        raise GPTQError(f"{path}: {len(ids)} tokens, fewer than one window of --seq-len {seq_len}")
    batches = [{"input_ids": torch.tensor(ids[i * seq_len:(i + 1) * seq_len])[None]} for i in range(n_win)]
    return Calibration(batches, n_win * seq_len, str(path), sha, {"kind": "text", "windows": n_win, "seq_len": seq_len})


def _jsonl_calibration(model_dir: Path, path: Path, sha: str, *, tokens: int, seq_len: int) -> Calibration:
    from qat.data import read_samples
    try:
        samples = read_samples(path)
    except (ValueError, OSError) as e:
        raise GPTQError(f"{path}: cannot read the samples ({e})") from e
    tokenizer, batcher, image_token_id = sample_inputs(model_dir)
    try:
        examples = tokenise_samples(samples, tokenizer, seq_len, image_token_id)
    except TrainError as e:
        raise GPTQError(str(e)) from e
    if not examples:
        raise GPTQError(f"{path}: no sample fits --seq-len {seq_len}")
    batches, n = [], 0
    for ex in examples:
        if n >= tokens:
            break
        try:
            inputs, _ = batcher([ex])
        except TrainError as err:
            raise GPTQError(str(err)) from err
        batches.append(inputs)
        n += len(ex.ids)
    return Calibration(batches, n, str(path), sha, {"kind": "jsonl", "samples": len(batches), "seq_len": seq_len})


# ---------------------------------------------------------------------------------------------------
# model level


@dataclass
class GPTQRun:
    """Every S3D8 matrix of a model, GPTQ'd."""

    results: dict[str, MatrixResult]  # by GGUF name
    info: dict[str, Any]

    def tensor_file(self) -> Any:
        from gguf_s3d8.tensor_file import S3D8TensorFile

        return S3D8TensorFile({k: r.container for k, r in self.results.items()},
                              {k: r.fingerprint for k, r in self.results.items()}, PRODUCER, self.info)


def _weights_rounded(model: nn.Module, dtype: str) -> None:
    """Round every parameter to ``dtype`` (f16/bf16: its torch twin; f32: as is) in place: the values a conversion
    from such a GGUF holds."""
    if ggml_type(dtype).lossless:
        return
    rounded = torch_twin(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(rounded(p))


def s3d8_plan(model: nn.Module, model_dir: Path, *, fallback_type: str, vision_type: str) -> dict[str, Any]:
    """The weight specs of the converter's plan (qat.student), without fitting codebooks."""
    from qat.student import plan_weights

    config: Any = model.config  # an HF config
    vision = vision_type if config.model_type == "mllama" else None
    return plan_weights(model, model_dir, vision_type=vision, fallback_type=fallback_type, fit_codebooks=False)


def gptq_s3d8_model(model_dir: Path, calibration: Calibration, *, fallback_type: str = "q8_0",
                    vision_type: str = "s3d8", seed: int = 0, centroid_rule: str | None = None,
                    weights_dtype: str = "f32", cfg: GPTQConfig = GPTQConfig(), progress: bool = True,
                    start: Path | None = None) -> GPTQRun:
    """GPTQ every matrix the converter stores as S3D8 (module docstring); ``start``: an S3D8 GGUF of the same
    model whose codebooks and scales to keep (:func:`start_containers`)."""
    from tqdm import tqdm

    t0 = time.time()
    model = load_teacher(model_dir)
    _weights_rounded(model, weights_dtype)
    specs = {k: s for k, s in s3d8_plan(model, model_dir, fallback_type=fallback_type, vision_type=vision_type).items()
             if s.qtype == S3D8.name}
    if not specs:
        raise GPTQError(f"{model_dir}: no matrix of this model can be stored as S3D8 (nothing to GPTQ)")
    params = dict(model.named_parameters(remove_duplicate=False))
    # the Linear that computes with each S3D8 weight (a tied embedding: the LM head sharing it)
    linears: dict[str, nn.Linear] = {}
    by_param = {id(params[name]): name for name in specs}
    for mod in model.modules():
        if isinstance(mod, nn.Linear) and id(mod.weight) in by_param:
            linears.setdefault(by_param[id(mod.weight)], mod)
    bar = (lambda it, **kw: tqdm(it, **kw)) if progress else (lambda it, **kw: it)
    hessians = collect_hessians(model, calibration.batches, modules=dict(linears),
                                progress=lambda b: bar(b, desc="Calibration", total=len(calibration.batches), leave=False),
                                stop_early=True)
    t_h = time.time() - t0
    starts = start_containers(start, {s.gguf_name for s in specs.values()}) if start is not None else {}
    results: dict[str, MatrixResult] = {}
    for hf_name, spec in bar(list(specs.items()), desc="GPTQ S3D8", leave=False):
        w = params[hf_name].detach().to(torch.float32)
        w_gguf = (w if spec.perm is None else w[spec.perm]).numpy()
        coll = hessians.get(hf_name)
        h = coll.hessian() if coll is not None and coll.n > 0 else None
        results[spec.gguf_name] = gptq_s3d8_matrix(w_gguf, h, name=spec.gguf_name, seed=seed,
                                                   centroid_rule=centroid_rule, cfg=cfg, start=starts.get(spec.gguf_name))
    info = {"producer": PRODUCER, "calibration": {"file": Path(calibration.source).name, "sha256": calibration.sha256,
                                                  "tokens": calibration.tokens, **calibration.info},
            "gptq": {"damp": cfg.damp, "block": cfg.block, "act_order": cfg.act_order},
            "seed": seed, "centroid_rule": centroid_rule, "weights_dtype": weights_dtype,
            "start": "iw1 (importance diag(H))" if start is None else f"codebooks and scales of {start.name}",
            "no_calibration_input": sorted(k for k, r in results.items() if r.stats is None),
            "seconds": {"calibration": round(t_h, 1), "total": round(time.time() - t0, 1)}}
    return GPTQRun(results, info)


def start_containers(path: Path, names: set[str]) -> dict[str, np.ndarray]:
    """The S3D8 containers of ``names`` in the GGUF ``path`` (GPTQError if the file lacks one or is no S3D8 GGUF)."""
    from gguf_s3d8 import series_gguf  # the patch series' gguf-py, which defines S3D8

    try:
        reader = series_gguf().GGUFReader(path)
    except (OSError, ValueError) as e:
        raise GPTQError(f"--start {path}: cannot read the GGUF ({e})") from e
    found = {t.name: np.array(t.data, dtype=np.uint8) for t in reader.tensors
             if t.name in names and t.tensor_type.name == "S3D8"}
    missing = sorted(names - set(found))
    if missing:
        raise GPTQError(f"--start {path}: no S3D8 tensor {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    return found


# ---------------------------------------------------------------------------------------------------
# CLI

_DESCRIPTION = """\
GPTQ for S3D8: quantise every matrix that the converter stores as S3D8 with
error feedback from calibration data (importance-aware codebook and scales from
the same data), and write the finished containers for

  python convert/to_gguf.py MODEL --type s3d8 --gptq-checkpoint OUT -o model.gguf
  python -m qat.train --teacher MODEL --init-from OUT ...   (QAT from this start)

"""


def add_calibration_options(p: argparse.ArgumentParser) -> None:
    """The calibration options of GPTQ (the converter took them too while it ran GPTQ for ``--calibration``)."""
    p.add_argument("--calibration-tokens", type=int, default=32768, metavar="N",
                   help="calibration tokens, at most (default %(default)s)")
    p.add_argument("--calibration-seq-len", type=int, default=512, metavar="L",
                   help="tokens per calibration sequence (default %(default)s)")
    p.add_argument("--gptq-damp", type=float, default=0.05, metavar="D",
                   help="GPTQ damping, fraction of mean(diag H) (default %(default)s, the reference's)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m qat.gptq_s3d8", description=_DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, metavar="DIR", help="HF checkpoint directory (Llama or mllama)")
    p.add_argument("--calibration", type=Path, required=True, metavar="FILE",
                   help="plain text (UTF-8) or a qat.generate JSONL (required for mllama: samples with images)")
    p.add_argument("-o", "--out", type=Path, required=True, metavar="FILE", help="S3D8 tensor file to write (.safetensors)")
    add_calibration_options(p)
    p.add_argument("--fallback-type", choices=FALLBACK_TYPES, default="q8_0",
                   help="the converter's --fallback-type (decides which matrices are S3D8; default %(default)s)")
    p.add_argument("--vision-type", choices=OUT_TYPES, default="s3d8",
                   help="mllama: the converter's --mmproj-type (default %(default)s)")
    p.add_argument("--weights-dtype", choices=FLOAT_TYPES, default="f32",
                   help="round the weights to this type first: use f16 to convert from an f16 GGUF of the same "
                        "model afterwards (default %(default)s: as loaded)")
    p.add_argument("--seed", type=int, default=0, help="seed of the codebook fit (default %(default)s)")
    p.add_argument("--start", type=Path, default=None, metavar="GGUF",
                   help="keep the codebooks and scales of this S3D8 GGUF of the model (e.g. from llama-quantize "
                        "--imatrix, the fast C twin of the iw1 start) instead of fitting them here")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def run(model: Path, calibration: Path, *, tokens: int, seq_len: int, damp: float, fallback_type: str = "q8_0",
        vision_type: str = "s3d8", weights_dtype: str = "f32", seed: int = 0, progress: bool = True,
        start: Path | None = None) -> GPTQRun:
    """Read the calibration file and GPTQ the model (the CLI's work)."""
    cal = read_calibration(model, calibration, tokens=tokens, seq_len=seq_len)
    return gptq_s3d8_model(model, cal, fallback_type=fallback_type, vision_type=vision_type, seed=seed,
                           weights_dtype=weights_dtype, cfg=GPTQConfig(damp=damp), progress=progress, start=start)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from gguf_s3d8.tensor_file import write_s3d8_tensors

    try:
        result = run(args.model, args.calibration, tokens=args.calibration_tokens, seq_len=args.calibration_seq_len,
                     damp=args.gptq_damp, fallback_type=args.fallback_type, vision_type=args.vision_type,
                     weights_dtype=args.weights_dtype, seed=args.seed, progress=not args.no_progress, start=args.start)
        write_s3d8_tensors(args.out, result.tensor_file())
    except GPTQError as e:
        return cli_error(str(e))
    except OSError as e:
        return cli_error(f"{e.filename or args.out}: {e.strerror or e}")
    info = result.info
    print(f"{args.out}: {len(result.results)} S3D8 matrices, GPTQ on {info['calibration']['tokens']} calibration "
          f"tokens in {info['seconds']['total']:.0f} s")
    if info["no_calibration_input"]:
        print(f"  without calibration input (iw1 without importance): {', '.join(info['no_calibration_input'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Any HF checkpoint upstream's converter handles, converted by upstream's own ``ModelBase`` machinery.

Upstream's model class for the checkpoint (``conversion.get_model_class``, e.g. ``LlamaModel``, ``Qwen2Model``,
``Gemma3Model``) does everything it does for ``convert_hf_to_gguf.py``: hyper-parameters, the tokenizer (every
kind: SentencePiece, byte-level BPE with all its pre-tokenizers, ...), ``general.*`` metadata, tensor names and
layouts (q/k permutation, RoPE factors, fused or split tensors) and the per-tensor types. We run its
``prepare_tensors`` and ``prepare_metadata`` on lazy tensors, so the whole file is planned before any weight is
read, and add what is ours through two hooks of a subclass (:class:`_S3D8Hooks`, the methods upstream's own model
classes override):

* ``modify_tensors``: records the float tensor behind each output name (what upstream then quantises);
* ``tensor_force_quant``: records which outputs *follow the requested type* (upstream decides nothing for them;
  the remaining rules make norms, 1-D and non-``.weight`` tensors F32).

``--type f32/f16/bf16/q8_0`` writes upstream's plan unchanged, so the file is byte-identical to upstream's.
``--type s3d8`` plans with upstream's F16 and then writes every tensor that follows the requested type as S3D8
where S3D8 can hold it (``convert.tensor_types.choose_type``), else as ``--fallback-type`` (F16: upstream's bytes);
every other tensor, every key (but ``general.file_type``) and the order of both are upstream's F16 file's.
Writing streams one tensor at a time (atomic, ``convert.common.write_plan``).

``UpstreamSource(..., mmproj=True)`` does the same with upstream's ``MmprojModel`` class of the architecture (what
``convert_hf_to_gguf.py --mmproj`` writes; mllama's vision file). :meth:`UpstreamSource.weight_placements` and
:func:`checkpoint_placements` give QAT and GPTQ the plan of every checkpoint tensor (GGUF name, shape, type, row
order) from the same classes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

from .common import ConversionOptions, OutputPlan, PlannedTensor, check_finite
from .errors import ConvertError, read_json
from .tensor_types import choose_type, encode, encoded_nbytes, file_type_of, qtype_of, upstream_type, weight_type
from .upstream_tree import upstream_converter

#: Files one of which every tokenizer kind upstream reads has.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tekken.json", "tokenizer.tiktoken")

def quiet_upstream_logging(verbose: bool = False) -> None:
    """Upstream logs every tensor at INFO and warnings to stderr; the CLI prints its own report."""
    log = logging.getLogger("hf-to-gguf")
    log.setLevel(logging.DEBUG if verbose else logging.ERROR)


class _S3D8Hooks:
    """Mixed in before upstream's model class: records, per output tensor, its float data and whether it
    follows the requested type; answers ``--tokenizer-pre``."""

    s3d8_float: dict[str, Any]
    s3d8_hf_name: dict[str, str]
    s3d8_follows_type: set[str]
    s3d8_tokenizer_pre: str | None

    def modify_tensors(self, data_torch: Any, name: str, bid: int | None) -> Iterable[tuple[str, Any]]:
        for new_name, data in super().modify_tensors(data_torch, name, bid):  # type: ignore[misc]
            self.s3d8_float[new_name] = data
            self.s3d8_hf_name[new_name] = name
            yield new_name, data

    def tensor_force_quant(self, name: str, new_name: str, bid: int | None, n_dims: int) -> Any:
        forced = super().tensor_force_quant(name, new_name, bid, n_dims)  # type: ignore[misc]
        if isinstance(forced, bool):
            self.s3d8_follows_type.add(new_name)
        return forced

    def get_vocab_base_pre(self, tokenizer: Any) -> str:
        if self.s3d8_tokenizer_pre is not None:
            return self.s3d8_tokenizer_pre
        try:
            return super().get_vocab_base_pre(tokenizer)  # type: ignore[misc]
        except NotImplementedError as e:
            raise ConvertError(f"{getattr(self, 'dir_model', '')}: unrecognised BPE pre-tokenizer (none of the "
                               "pre-tokenizers upstream's converter knows gives this tokenizer's probe encoding); "
                               "name llama.cpp's pre-tokenizer with --tokenizer-pre") from e


def _hooked_class(cls: Any) -> Any:  # an upstream model class (convert_hf_to_gguf: untyped)
    # TextModel.__init_subclass__ requires model_arch in the class's own namespace
    return type(f"S3D8{cls.__name__}", (_S3D8Hooks, cls), {"model_arch": cls.model_arch})


def _upstream_errors() -> tuple[type[BaseException], ...]:
    return (ValueError, KeyError, IndexError, TypeError, AssertionError, NotImplementedError, FileNotFoundError,
            OSError, AttributeError)


@dataclass(frozen=True)
class _Output:
    """One tensor as upstream planned it."""

    name: str
    upstream_qtype: QT
    follows_type: bool


@dataclass(frozen=True)
class WeightPlacement:
    """Where a conversion puts one checkpoint tensor (:meth:`UpstreamSource.weight_placements`)."""

    gguf_name: str
    shape: tuple[int, ...]     # numpy order, as written
    qtype: QT
    rows: np.ndarray | None    # GGUF row r = checkpoint row rows[r]; None when the rows keep their order


class UpstreamSource:
    """An HF checkpoint directory converted through upstream's model class for its architecture: the text model
    (``TextModel`` subclass), or with ``mmproj`` the vision/audio encoder file (``MmprojModel`` subclass, what
    ``convert_hf_to_gguf.py --mmproj`` writes)."""

    def __init__(self, model_dir: Path, *, tokenizer_pre: str | None = None, verbose: bool = False,
                 mmproj: bool = False) -> None:
        self.model_dir = model_dir
        self.tokenizer_pre = tokenizer_pre
        self.mmproj = mmproj
        self._verbose = verbose
        self._weights: Mapping[str, Any] | None = None
        self._weights_label = ""
        self._jobs_plan: tuple[Any, list[_Output]] | None = None
        up = upstream_converter()
        quiet_upstream_logging(verbose)
        cfg = read_json(model_dir / "config.json", missing_hint=" (not an HF checkpoint directory)")
        archs = cfg.get("architectures") if isinstance(cfg, dict) else None
        if not archs or not isinstance(archs, list):
            raise ConvertError(f"{model_dir / 'config.json'}: no 'architectures' entry; cannot tell which model this is")
        self.hf_arch = str(archs[0])
        try:
            self._cls = _hooked_class(up.get_model_class(self.hf_arch, mmproj=mmproj))
        except NotImplementedError:
            what = "has no vision/audio model class in" if mmproj else "is not one"
            raise ConvertError(f"{model_dir / 'config.json'}: unsupported architecture {self.hf_arch!r} ({what} "
                               f"upstream's convert_hf_to_gguf.py{' --mmproj' if mmproj else ''} converts; `python "
                               "work/llama.cpp/convert_hf_to_gguf.py --print-supported-models` lists them)") from None
        if not mmproj and not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
            raise ConvertError(f"{model_dir}: no tokenizer ({' / '.join(_TOKENIZER_FILES)}) - the GGUF needs the "
                               "vocabulary")
        self.arch = gguf.MODEL_ARCH_NAMES[self._cls.model_arch]
        self._model = self._new_model("f16")
        if not self._model.model_tensors:
            raise ConvertError(f"{model_dir}: no model.safetensors (or model-*.safetensors parts, or "
                               "pytorch_model*.bin) found")

    # -- upstream's model instance ------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run upstream code; its exceptions become one-line ConvertErrors naming the checkpoint."""
        import torch

        try:
            with torch.inference_mode():
                return fn()
        except ConvertError:
            raise
        except _upstream_errors() as e:
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ConvertError(f"{self.model_dir}: upstream's {self._cls.__mro__[2].__name__} failed while {what}: "
                               f"{type(e).__name__}{': ' + msg if msg else ''}") from e

    def _new_model(self, out_type: str) -> Any:
        ftype = gguf.LlamaFileType(file_type_of(upstream_type(out_type)))  # S3D8 is planned as F16 (module docstring)

        def make() -> Any:
            m = self._cls(self.model_dir, ftype, self.model_dir / "unused.gguf")
            m.s3d8_float, m.s3d8_hf_name, m.s3d8_follows_type = {}, {}, set()
            m.s3d8_tokenizer_pre = self.tokenizer_pre
            return m

        return self._call("reading the config and the checkpoint index", make)

    def canonical_name(self, hf_name: str) -> str | None:
        """``hf_name`` (any spelling of the checkpoint or of the loaded HF model) as upstream indexes it, or None
        for tensors this file does not hold (upstream's ``filter_tensors``: e.g. mllama's vision tower)."""
        item = self._cls.filter_tensors((hf_name, lambda: None))
        return None if item is None else item[0]

    def hf_tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """The checkpoint's tensors (names as upstream indexes them) and shapes; nothing is read."""
        return {name: tuple(int(d) for d in gen().shape) for name, gen in self._model.model_tensors.items()}

    def replace_weights(self, weights: Mapping[str, Any], label: str) -> None:
        """Convert these weights (HF name -> tensor, in the checkpoint's layout; ``--qat-checkpoint``) instead of
        the checkpoint's for the names the checkpoint has; upstream's ``modify_tensors`` then lays them out."""
        self._weights, self._weights_label = weights, label

    # -- plan ---------------------------------------------------------------------------------------

    def _planned_model(self, out_type: str, *, metadata: bool = True) -> tuple[Any, list[_Output]]:
        """A fresh upstream model instance for ``out_type`` with ``prepare_tensors`` and (with ``metadata``)
        ``prepare_metadata`` run (lazy tensors: nothing is read but safetensors headers)."""
        model = self._new_model(out_type)
        if self._weights is not None:
            from conversion import LazyTorchTensor

            for name in list(model.model_tensors):
                if name in self._weights:
                    w = self._weights[name]
                    model.model_tensors[name] = (lambda w=w: LazyTorchTensor.from_eager(w))
        self._call("planning the tensors", model.prepare_tensors)
        if metadata:
            self._call("writing the metadata and vocabulary", lambda: model.prepare_metadata(vocab_only=False))
        if len(model.gguf_writer.tensors) != 1:
            raise ConvertError("split outputs are not supported")
        outputs = [_Output(name, QT(int(ti.dtype)), name in model.s3d8_follows_type)
                   for name, ti in model.gguf_writer.tensors[0].items()]
        return model, outputs

    def planned_tensors(self, options: ConversionOptions) -> list[tuple[str, tuple[int, ...], QT]]:
        """(GGUF name, numpy-order shape, type) of every output tensor for these options, without writing."""
        return [(t.name, t.shape, t.qtype) for t in self.plan(options).tensors]

    def plan(self, options: ConversionOptions) -> OutputPlan:
        model, outputs = self._planned_model(options.out_type)
        writer: gguf.GGUFWriter = model.gguf_writer
        infos = writer.tensors[0]
        t = weight_type(options.out_type)
        requested_qt = qtype_of(upstream_type(options.out_type))
        planned: list[PlannedTensor] = []
        for out in outputs:
            ti = infos[out.name]
            shape = tuple(int(s) for s in ti.shape)
            follows = out.follows_type and out.upstream_qtype == requested_qt
            reason = None
            qtype = out.upstream_qtype
            if t.upstream and t.fallback is not None and out.follows_type and qtype == qtype_of(t.fallback):
                reason = f"{t.gguf_name}: {t.ineligibility(int(shape[-2]) if len(shape) > 1 else 1, int(shape[-1]))}"
            recode = False
            if not t.upstream and follows:
                ch = choose_type(out.name, shape, options.out_type, options.fallback_type)
                qtype, reason, recode = ch.qtype, ch.reason, ch.qtype != requested_qt
                if recode:
                    infos[out.name] = type(ti)(shape=list(shape), dtype=qtype, nbytes=encoded_nbytes(shape, qtype),
                                               tensor=ti.tensor)
            hf = model.s3d8_hf_name.get(out.name, "")
            src = f"{self._weights_label}:{hf}" if self._weights is not None and hf in self._weights else hf
            planned.append(PlannedTensor(out.name, shape, qtype, infos[out.name].nbytes, reason,
                                         self._producer(model, out.name, qtype, recode, options), src))
        if not t.upstream:
            _set_kv(writer, gguf.Keys.General.FILE_TYPE, file_type_of(options.out_type), gguf.GGUFValueType.UINT32)
        return OutputPlan(writer, planned, options.out_type)

    def weight_placements(self, out_type: str, fallback_type: str) -> dict[str, WeightPlacement]:
        """Where this conversion puts each checkpoint tensor (keyed by the name upstream indexes it by, see
        :meth:`canonical_name`): GGUF name, shape, type and row order - what QAT and GPTQ plan with. Types are those
        :meth:`plan` gives; the row order is upstream's own ``modify_tensors`` applied to the row indices (e.g.
        Llama's q/k permutation for RoPE). Only the tensors are planned (no vocabulary, no weight is read)."""
        import torch

        model, outputs = self._planned_model(upstream_type(out_type), metadata=False)
        infos = model.gguf_writer.tensors[0]
        requested_qt = qtype_of(upstream_type(out_type))
        scratch = self._new_model("f16")  # modify_tensors records what it sees: keep that off the planned model
        out: dict[str, WeightPlacement] = {}
        for o in outputs:
            hf = model.s3d8_hf_name.get(o.name)
            if hf is None or hf not in self._model.model_tensors:
                continue  # generated by upstream (e.g. rope_freqs): no checkpoint tensor behind it
            if hf in out:
                raise ConvertError(f"{self.model_dir}: {hf} becomes several tensors ({out[hf].gguf_name}, {o.name}); "
                                   "QAT and GPTQ need one output tensor per checkpoint tensor")
            shape = tuple(int(d) for d in infos[o.name].shape)
            qtype = o.upstream_qtype
            if not weight_type(out_type).upstream and o.follows_type and qtype == requested_qt:
                qtype = choose_type(o.name, shape, out_type, fallback_type).qtype
            n = int(self._model.model_tensors[hf]().shape[0]) if shape else 1
            ids = torch.arange(n, dtype=torch.int64).reshape(n, *([1] * (len(shape) - 1))) if shape else \
                torch.zeros((), dtype=torch.int64)
            bid = next((int(p) for p in hf.split(".") if p.isdecimal()), None)  # as upstream's prepare_tensors

            def lay_out(ids: Any = ids, hf: str = hf, bid: int | None = bid) -> list[tuple[str, Any]]:
                return list(scratch.modify_tensors(ids, hf, bid))

            moved: list[tuple[str, Any]] = self._call(f"laying out {hf}", lay_out)
            if len(moved) != 1 or moved[0][0] != o.name or tuple(moved[0][1].shape) != tuple(ids.shape):
                raise ConvertError(f"{self.model_dir}: upstream's layout of {hf} is not a row reordering; QAT and "
                                   "GPTQ cannot plan it")
            rows = np.asarray(moved[0][1]).reshape(n)
            out[hf] = WeightPlacement(o.name, shape, qtype, None if np.array_equal(rows, np.arange(n)) else rows)
        return out

    def tensor_jobs(self) -> list[Any]:
        """The output tensors as job-like rows (name, shape, float loader, HF source name) - what
        ``--gptq-checkpoint`` checks against (planned at F16: names and shapes only)."""
        from .common import TensorJob

        if self._jobs_plan is None:
            self._jobs_plan = self._planned_model("f16")
        model, outputs = self._jobs_plan
        infos = model.gguf_writer.tensors[0]
        return [TensorJob(o.name, tuple(int(s) for s in infos[o.name].shape),
                          (lambda n=o.name: _eager_float(model.s3d8_float[n])),  # type: ignore[misc]
                          model.s3d8_hf_name.get(o.name, ""))
                for o in outputs]

    @staticmethod
    def _producer(model: Any, name: str, qtype: QT, recode: bool, options: ConversionOptions) -> Callable[[], Any]:
        def produce() -> Any:
            infos = model.gguf_writer.tensors[0]
            lazy_out = infos[name].tensor
            src = model.s3d8_float.pop(name, None)
            hf = model.s3d8_hf_name.get(name, name)
            try:
                if src is not None:
                    data = _eager(src)  # evaluated once: upstream's lazy output below reuses it
                    check_finite(name, hf, data)
                    if recode:
                        return encode(np.asarray(data, dtype=np.float32), qtype, name=name, s3d8=options.s3d8)
                elif recode:
                    raise ConvertError(f"tensor {name}: upstream gave no float data to re-encode as {qtype.name}")
                if isinstance(lazy_out, gguf.LazyChunkedTensor):
                    return lazy_out  # written chunk by chunk
                return gguf.LazyNumpyTensor.to_eager(lazy_out)
            except ConvertError:
                raise
            except (ValueError, OSError, RuntimeError) as e:
                raise ConvertError(f"tensor {name} (from {hf}): cannot read or convert it: {type(e).__name__}: "
                                   f"{str(e).strip().splitlines()[0] if str(e).strip() else ''} (checkpoint file "
                                   "truncated or corrupt?)") from e

        return produce


def _eager(t: Any) -> np.ndarray:
    """A (lazy) torch tensor of upstream's as a numpy array (evaluated once: upstream's lazy output reuses it)."""
    from conversion import LazyTorchTensor

    e = LazyTorchTensor.to_eager(t)
    if hasattr(e, "numpy"):
        import torch

        if e.dtype not in (torch.float16, torch.float32):
            e = e.to(torch.float32)
        return e.numpy()
    return np.asarray(e)


def _eager_float(t: Any) -> np.ndarray:
    return np.asarray(_eager(t), dtype=np.float32)


def _set_kv(writer: gguf.GGUFWriter, key: str, value: Any, vtype: gguf.GGUFValueType) -> None:
    """Replace a KV pair's value where it stands (its position in the file stays upstream's)."""
    for kv in writer.kv_data:
        if key in kv:
            kv[key] = gguf.GGUFValue(value, vtype)
            return
    writer.add_key_value(key, value, vtype)


def checkpoint_placements(model_dir: Path, *, fallback_type: str = "q8_0",
                          vision_type: str | None = None) -> Callable[[str], WeightPlacement | None]:
    """Where ``convert/to_gguf.py --type s3d8 --fallback-type FALLBACK [--mmproj ... --mmproj-type VISION]`` puts
    each tensor of the checkpoint in ``model_dir``, looked up by any HF spelling of its name (the checkpoint's or the
    loaded model's parameter name); None for a tensor neither file holds. ``vision_type``: also the vision/audio file
    (``--mmproj``) with that type, for architectures upstream has an mmproj class for (mllama)."""
    sources = [(UpstreamSource(model_dir), "s3d8")]
    if vision_type is not None and _has_mmproj(sources[0][0].hf_arch):
        sources.append((UpstreamSource(model_dir, mmproj=True), vision_type))
    tables = [(src, src.weight_placements(t, fallback_type)) for src, t in sources]

    def place(hf_name: str) -> WeightPlacement | None:
        for src, table in tables:
            name = src.canonical_name(hf_name)
            if name is not None and name in table:
                return table[name]
        return None

    return place


def _has_mmproj(hf_arch: str) -> bool:
    try:
        upstream_converter().get_model_class(hf_arch, mmproj=True)
    except NotImplementedError:
        return False
    return True

"""Backends that answer one prompt about one image with greedy decoding.

Anything with ``answer(image_path, prompt, max_new_tokens) -> str`` is a :class:`Backend`; ``prompt`` is the task
prompt (user text), the backend adds the chat framing and the image.

* :class:`TransformersBackend` wraps an ``MllamaForConditionalGeneration`` (or any module that takes the
  ``MllamaProcessor`` outputs, e.g. a fake-quantised student) and its processor. The text is the authors' instruct
  framing ``<|start_header_id|>user<|end_header_id|>\\n\\n<|image|>{prompt}<|eot_id|><|start_header_id|>assistant
  <|end_header_id|>\\n\\n``; the processor prepends ``<|begin_of_text|>``. Decoding is greedy; the answer is the
  decode of the new tokens *with* special tokens (e.g. a trailing ``<|eot_id|>``), pad tokens removed, as the
  authors scored it. One example at a time (the authors batched with left padding; greedy answers can differ
  in rare near-ties). A model without ``generate`` is decoded by :func:`greedy_generate` (no KV cache: slow,
  meant for small models and tests). The vision encoder runs with Meta's intermediate-layer taps
  (:func:`qat.mllama_hf.meta_taps`; transformers 5 taps one layer late, docs/mllama.md), as in llama.cpp, QAT
  and ``qat.generate``. :meth:`TransformersBackend.from_qat_checkpoint` evaluates a QAT student (fake-quantised
  weights and activations: the function of its exported GGUF).
* :class:`OpenAIBackend` posts to an OpenAI-compatible ``/v1/chat/completions`` (llama-server started with
  ``--mmproj``): one user message with an ``image_url`` part (base64 data URL) then a ``text`` part,
  ``temperature`` 0 and ``max_tokens``; the answer is ``choices[0].message.content``. The server's chat
  template frames the turn (for Llama 3.2 Vision the same user/assistant headers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence, runtime_checkable

from qat.generate import image_base64, load_rgb
from qat.mllama_hf import meta_taps
from qat.prompts import CHAT_TEMPLATE

#: the authors' instruct framing (LM ``utility.LLAMA_PROMPT_TEMPLATES["instruct"]``), the one QAT data uses too
INSTRUCT_TEMPLATE = CHAT_TEMPLATE


@runtime_checkable
class Backend(Protocol):
    def answer(self, image_path: Path, prompt: str, max_new_tokens: int) -> str:
        """The model's greedy answer to ``prompt`` about the image at ``image_path``."""
        ...


def greedy_generate(model: Any, inputs: dict[str, Any], max_new_tokens: int, eos_ids: Sequence[int]) -> list[int]:
    """Greedy decoding by full forward passes of ``model(**inputs).logits`` (batch of one).

    Each new token attends the image like the last prompt token (the last ``cross_attention_mask`` row is
    repeated, as transformers does). Stops after an end-of-sequence id (which is kept) or ``max_new_tokens``.
    """
    import torch

    inputs = dict(inputs)
    new: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(**inputs).logits
            tok = int(logits[0, -1].argmax())
            new.append(tok)
            if tok in eos_ids:
                break
            step = torch.tensor([[tok]], dtype=inputs["input_ids"].dtype, device=inputs["input_ids"].device)
            inputs["input_ids"] = torch.cat([inputs["input_ids"], step], dim=1)
            if "attention_mask" in inputs:
                inputs["attention_mask"] = torch.cat(
                    [inputs["attention_mask"], torch.ones_like(step, dtype=inputs["attention_mask"].dtype)], dim=1)
            if "cross_attention_mask" in inputs:
                cam = inputs["cross_attention_mask"]
                inputs["cross_attention_mask"] = torch.cat([cam, cam[:, -1:]], dim=1)
    return new


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for cfg in (getattr(model, "generation_config", None), getattr(getattr(model, "config", None), "text_config", None),
                getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            ids += eos if isinstance(eos, list) else [eos]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))


class TransformersBackend:
    """A transformers mllama model (or a module with the same call signature) and its processor."""

    def __init__(self, model: Any, processor: Any, template: str = INSTRUCT_TEMPLATE) -> None:
        self.model = model
        self.processor = processor
        self.template = template
        self.eos_ids = _eos_ids(model, processor.tokenizer)

    @classmethod
    def from_pretrained(cls, path: Path | str, dtype: str = "auto", device: str = "cpu") -> "TransformersBackend":
        import torch
        from transformers import AutoProcessor, MllamaForConditionalGeneration

        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        model = MllamaForConditionalGeneration.from_pretrained(path, dtype=torch_dtype).to(device).eval()
        return cls(model, AutoProcessor.from_pretrained(path))

    @classmethod
    def from_qat_checkpoint(cls, path: Path | str, teacher: Path | str | None = None,
                            device: str = "cpu") -> "TransformersBackend":
        """The student of a ``qat.train`` checkpoint of an mllama teacher; ``teacher`` (the folder with the
        processor files) defaults to the one the checkpoint was trained from. Raises ``qat.errors.TrainError``."""
        from transformers import AutoProcessor

        from qat.checkpoint import load_checkpoint
        from qat.errors import TrainError
        from qat.training.models import student_from_checkpoint

        ck = load_checkpoint(Path(path))
        teacher_dir = Path(teacher or ck["teacher"])
        if not (teacher_dir / "config.json").is_file():
            raise TrainError(f"{path}: its teacher {teacher_dir} is not a checkpoint folder (give it with --teacher)")
        student = student_from_checkpoint(ck, teacher_dir).to(device).eval()
        del ck
        if type(student).__name__ != "MllamaForConditionalGeneration":
            raise TrainError(f"{path}: a {type(student).__name__} student, not Llama 3.2 Vision")
        return cls(student, AutoProcessor.from_pretrained(teacher_dir))

    def _device(self) -> Any:
        params = getattr(self.model, "parameters", None)
        return next(params()).device if params is not None else "cpu"

    def answer(self, image_path: Path, prompt: str, max_new_tokens: int) -> str:
        import torch

        image = load_rgb(Path(image_path))
        inputs = self.processor(images=[[image]], text=[self.template.format(prompt=prompt)], return_tensors="pt")
        inputs = {k: v.to(self._device()) for k, v in inputs.items()}
        with torch.no_grad(), meta_taps():
            if hasattr(self.model, "generate"):
                out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                          temperature=None, top_p=None, top_k=None)
                new = out[0, inputs["input_ids"].shape[1]:].tolist()
            else:
                new = greedy_generate(self.model, inputs, max_new_tokens, self.eos_ids)
        text = self.processor.decode(new, skip_special_tokens=False)
        pad = self.processor.tokenizer.pad_token
        return text.replace(pad, "") if pad else text


def image_data_url(path: Path) -> str:
    """A ``data:`` URL of the image (PNG/JPEG bytes as they are, other formats re-encoded as PNG)."""
    mime, data = image_base64(Path(path))
    return f"data:{mime};base64,{data}"


def chat_completions_url(url: str) -> str:
    """``http://host:port`` / ``…/v1`` / ``…/v1/chat/completions`` → the chat completions URL."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class OpenAIBackend:
    """An OpenAI-compatible chat completions server, e.g. ``llama-server -m text.gguf --mmproj mmproj.gguf``."""

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        import requests

        self.url = chat_completions_url(url)
        self.model = model
        self.timeout = timeout
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"

    def request_body(self, image_path: Path, prompt: str, max_new_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(image_path)}},
                {"type": "text", "text": prompt},
            ]}],
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "stream": False,
        }
        if self.model:
            body["model"] = self.model
        return body

    def answer(self, image_path: Path, prompt: str, max_new_tokens: int) -> str:
        r = self.session.post(self.url, json=self.request_body(image_path, prompt, max_new_tokens),
                              timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"{self.url}: HTTP {r.status_code}: {r.text[:1000]}")
        try:
            content = r.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise RuntimeError(f"{self.url}: unexpected response {r.text[:1000]!r}") from e
        return content or ""

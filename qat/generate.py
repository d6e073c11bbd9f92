"""Teacher generation of the QAT self-distillation data (reference-recipe section 5) into JSONL.

``python -m qat.generate --help`` explains the command line. For every sample index ``i`` in
``[--start, --start + --num-samples)``:

* the prompt is ``qat.prompts.sample_prompt(seed, i)`` (template chat / plain, wrapped user text);
* the image is ``images[i % len(images)]`` of the sorted image list (the recipe walks ImageNet in order);
  none in ``--text-only`` mode;
* the teacher samples a response (temperature 0.6, top-p 0.9, at most 512 new tokens by default) with its
  random seed set to ``qat.prompts.generation_seed(seed, i)`` (``torch.manual_seed`` for transformers, the
  request's ``seed`` for an endpoint);
* the sample is appended to the JSONL file (schema: ``qat.data``) and flushed to disk.

Backends:

* transformers (``--model DIR``): an HF ``MllamaForConditionalGeneration`` checkpoint with its processor
  (``AutoProcessor``; the processor's chat template renders the chat turn; vision features taken as llama.cpp
  does, :func:`qat.mllama_hf.meta_taps`), or in ``--text-only`` mode any
  causal LM (its tokenizer's chat template). One sample at a time (batch 1), so that every sample depends
  only on ``(seed, i)``, not on what else is in its batch. Without a chat template the recipe's Llama
  turn is used.
* OpenAI-compatible endpoint (``--endpoint http://host:port/v1``, e.g. our llama-server): ``chat``
  samples go to ``/chat/completions`` (the image as a base64 ``data:`` URL in an ``image_url`` part);
  ``plain`` samples go to ``/completions`` with the raw prompt (leading BOS text removed: the server adds
  it), and with an image in llama-server's extension form ``{"prompt_string": "<__media__>...",
  "multimodal_data": [base64]}``. ``--template chat`` sends everything as chat for servers without
  ``/completions``. ``prompt_text`` is rendered with ``--model DIR``'s tokenizer/processor when given, else
  with the recipe's Llama 3 turn. ``--workers`` requests run in parallel; samples are still written in
  index order.

Resume: the output file is scanned first; a truncated final line (a killed run) is cut off and only the
missing indices are generated, so an interrupted run continues without losing or duplicating samples
and, with deterministic generation, ends with the same file as an uninterrupted one. Existing samples
must have the same seed and teacher, otherwise the run stops (use another ``--out``).

Errors (missing model, no images, unreachable endpoint, mismatched output file) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import base64
import collections
import concurrent.futures as cf
import importlib.util
import io
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol, Sequence, TypeVar

from qat.data import FinishReason, Sample, SampleWriter, Template, recover
from qat.prompts import (CHAT_TEMPLATE, CHAT_TEMPLATE_TEXT, DEFAULT_SEED, PLAIN_TEMPLATE, PLAIN_TEMPLATE_TEXT,
                         generation_seed, sample_prompt)

__all__ = ["GenerateError", "GenConfig", "Teacher", "PromptRenderer", "TransformersTeacher", "EndpointTeacher",
           "DEFAULT_PHOTOS", "default_image_dir", "list_images", "run", "main"]

#: the colour photographs among scikit-image's bundled data (``skimage/data``), the default image set
DEFAULT_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg", "ihc.png",
                  "motorcycle_left.png", "retina.jpg", "rocket.jpg")
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"})
LLAMA_BOS = "<|begin_of_text|>"
MEDIA_MARKER = "<__media__>"  # llama-server's (mtmd's) default media marker


class GenerateError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits with status 2."""


@dataclass(frozen=True)
class GenConfig:
    """Sampling settings (the recipe's values by default)."""

    temperature: float = 0.6
    top_p: float = 0.9
    max_new_tokens: int = 512


@dataclass(frozen=True)
class Job:
    """Everything a teacher needs for one sample."""

    id: int
    gen_seed: int
    image: Path | None
    template: Template
    prompt: str
    prompt_text: str


class Teacher(Protocol):
    """A generation backend."""

    name: str
    renderer: "PromptRenderer"

    def generate(self, job: Job, cfg: GenConfig) -> tuple[str, FinishReason]:
        """(response without EOS, finish_reason "stop" | "length")."""
        ...


# ----------------------------------------------------------------------------------------------------
# images


def default_image_dir() -> Path:
    """scikit-image's ``skimage/data`` folder, found without importing scikit-image."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise GenerateError("scikit-image is not installed (pip install scikit-image==0.26.0); or pass --images DIR")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def list_images(folder: Path | None) -> list[Path]:
    """Image files of ``folder`` (recursively, sorted by relative path), or the default photos if None."""
    if folder is None:
        d = default_image_dir()
        paths = [d / n for n in DEFAULT_PHOTOS if (d / n).is_file()]
    else:
        if not folder.is_dir():
            raise GenerateError(f"image folder {folder} does not exist")
        paths = sorted((p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()),
                       key=lambda p: p.relative_to(folder).as_posix())
    if not paths:
        raise GenerateError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in {folder or 'scikit-image data'}")
    return [p.resolve() for p in paths]


def load_rgb(path: Path):
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def image_base64(path: Path) -> tuple[str, str]:
    """(mime type, base64 data); PNG and JPEG are sent as they are, anything else re-encoded as PNG."""
    suffix = path.suffix.lower()
    if suffix in (".png", ".jpg", ".jpeg"):
        mime, data = ("image/png" if suffix == ".png" else "image/jpeg"), path.read_bytes()
    else:
        buf = io.BytesIO()
        load_rgb(path).save(buf, format="PNG")
        mime, data = "image/png", buf.getvalue()
    return mime, base64.b64encode(data).decode("ascii")


# ----------------------------------------------------------------------------------------------------
# prompt rendering


class PromptRenderer:
    """Turns the wrapped user prompt into ``prompt_text`` (the exact model input before the response).

    ``tokenizer`` / ``processor`` (either may be None) supply the chat template and the BOS text that the
    tokenizer adds by itself; without them the recipe's Llama 3 turn with ``<|begin_of_text|>`` is used.
    """

    def __init__(self, tokenizer=None, processor=None, text_only: bool = False) -> None:
        self.text_only = text_only
        self._processor = processor
        self._tokenizer = tokenizer if tokenizer is not None else getattr(processor, "tokenizer", None)
        if self._tokenizer is None:
            self.bos_text = LLAMA_BOS
        else:  # what the tokenizer prepends on its own (e.g. Llama 3's BOS; nothing for SmolLM2)
            with_special = self._tokenizer("a").input_ids
            plain = self._tokenizer("a", add_special_tokens=False).input_ids
            n_prefix = len(with_special) - len(plain) if with_special[-len(plain):] == plain else 0
            self.bos_text = self._tokenizer.decode(with_special[:n_prefix]) if n_prefix > 0 else ""

    def _chat_owner(self):
        for owner in (self._processor, self._tokenizer):
            if owner is not None and getattr(owner, "chat_template", None):
                return owner
        return None

    def render(self, prompt: str, template: str) -> str:
        if template == "plain":
            return self.bos_text + (PLAIN_TEMPLATE_TEXT if self.text_only else PLAIN_TEMPLATE).format(prompt=prompt)
        owner = self._chat_owner()
        if owner is None:
            return LLAMA_BOS + (CHAT_TEMPLATE_TEXT if self.text_only else CHAT_TEMPLATE).format(prompt=prompt)
        content = prompt if self.text_only else [{"type": "image"}, {"type": "text", "text": prompt}]
        return owner.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


def _read_config(model_dir: Path) -> dict:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise GenerateError(f"model directory {model_dir} not found or has no config.json")
    return json.loads(cfg_path.read_text())


def load_renderer(model_dir: Path, text_only: bool) -> PromptRenderer:
    """A renderer from a model directory's processor (mllama) or tokenizer, without loading weights."""
    from transformers import AutoProcessor, AutoTokenizer

    if _read_config(model_dir).get("model_type") == "mllama":
        return PromptRenderer(processor=AutoProcessor.from_pretrained(model_dir), text_only=text_only)
    return PromptRenderer(tokenizer=AutoTokenizer.from_pretrained(model_dir), text_only=text_only)


# ----------------------------------------------------------------------------------------------------
# backends


class TransformersTeacher:
    """Generation with transformers, one sample at a time (see the module docstring)."""

    def __init__(self, model_dir: Path, text_only: bool, dtype: str = "bfloat16", device: str | None = None,
                 name: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoProcessor, AutoTokenizer, MllamaForConditionalGeneration

        cfg = _read_config(model_dir)
        self.is_mllama = cfg.get("model_type") == "mllama"
        if not text_only and not self.is_mllama:
            raise GenerateError(f"{model_dir} is not a Llama 3.2 Vision (mllama) model (model_type "
                                f"{cfg.get('model_type')!r}); use --text-only for a text LLM")
        self.text_only = text_only
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        torch_dtype = getattr(torch, dtype)
        if self.is_mllama:
            self.processor = AutoProcessor.from_pretrained(model_dir)
            self.tokenizer = self.processor.tokenizer
            self.model = MllamaForConditionalGeneration.from_pretrained(model_dir, dtype=torch_dtype)
            self.renderer = PromptRenderer(processor=self.processor, text_only=text_only)
        else:
            self.processor = None
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
            self.renderer = PromptRenderer(tokenizer=self.tokenizer, text_only=True)
        self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos)
        pad = self.model.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids)
        self.name = name or str(model_dir.resolve())

    def _inputs(self, job: Job):
        if self.processor is not None and job.image is not None:
            return self.processor(images=[[load_rgb(job.image)]], text=[job.prompt_text], add_special_tokens=False,
                                  return_tensors="pt")
        return self.tokenizer(job.prompt_text, add_special_tokens=False, return_tensors="pt")

    def generate(self, job: Job, cfg: GenConfig) -> tuple[str, FinishReason]:
        import torch

        inputs = self._inputs(job).to(self.device)
        n_in = inputs["input_ids"].shape[1]
        torch.manual_seed(job.gen_seed)
        from contextlib import nullcontext

        from qat.mllama_hf import meta_taps

        # mllama: the vision features as llama.cpp computes them (the GGUF the student is exported to)
        with torch.inference_mode(), (meta_taps() if self.is_mllama else nullcontext()):
            out = self.model.generate(**inputs, do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p,
                                      max_new_tokens=cfg.max_new_tokens, pad_token_id=self.pad_id)
        new = out[0, n_in:].tolist()
        finish: FinishReason = "length"
        if new and new[-1] in self.eos_ids:
            new, finish = new[:-1], "stop"
        return self.tokenizer.decode(new, skip_special_tokens=False), finish


class EndpointTeacher:
    """An OpenAI-compatible server (see the module docstring for the request shapes)."""

    def __init__(self, url: str, text_only: bool, renderer: PromptRenderer, model: str | None = None,
                 timeout: float = 600.0, retries: int = 3, name: str | None = None) -> None:
        import requests

        self.url = url.rstrip("/")
        self.text_only = text_only
        self.renderer = renderer
        self.timeout = timeout
        self.retries = retries
        self._local = threading.local()  # one requests.Session per worker thread
        try:
            r = self._session().get(f"{self.url}/models", timeout=min(timeout, 30.0))
        except requests.RequestException as e:
            raise GenerateError(f"cannot reach endpoint {self.url} ({type(e).__name__})") from None
        if model is None:
            try:
                model = r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                model = "default"
        self.model = model
        self.name = name or f"endpoint:{self.url}#{model}"

    def _session(self):
        import requests

        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def _post(self, path: str, body: dict) -> dict:
        import requests

        for attempt in range(self.retries + 1):
            try:
                r = self._session().post(f"{self.url}{path}", json=body, timeout=self.timeout)
                if r.status_code < 500:
                    if r.status_code != 200:
                        raise GenerateError(f"endpoint {self.url}{path} answered {r.status_code}: {r.text[:200]!r}")
                    return r.json()
                err = f"status {r.status_code}"
            except requests.RequestException as e:
                err = type(e).__name__
            if attempt < self.retries:
                time.sleep(2.0 ** attempt)
        raise GenerateError(f"endpoint {self.url}{path} failed {self.retries + 1} times (last: {err})")

    def _strip_bos(self, text: str) -> str:
        bos = self.renderer.bos_text
        return text[len(bos):] if bos and text.startswith(bos) else text

    def generate(self, job: Job, cfg: GenConfig) -> tuple[str, FinishReason]:
        common = {"model": self.model, "temperature": cfg.temperature, "top_p": cfg.top_p,
                  "max_tokens": cfg.max_new_tokens, "seed": job.gen_seed, "stream": False}
        if job.template == "chat":
            if job.image is None:
                content: str | list = job.prompt
            else:
                mime, b64 = image_base64(job.image)
                content = [{"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}},
                           {"type": "text", "text": job.prompt}]
            choice = self._post("/chat/completions", {**common, "messages": [{"role": "user", "content": content}]})
            choice = choice["choices"][0]
            text = choice["message"]["content"] or ""
        else:
            text_prompt = self._strip_bos(job.prompt_text)
            prompt: str | dict = text_prompt
            if job.image is not None:
                prompt = {"prompt_string": text_prompt.replace("<|image|>", MEDIA_MARKER, 1),
                          "multimodal_data": [image_base64(job.image)[1]]}
            choice = self._post("/completions", {**common, "prompt": prompt})["choices"][0]
            text = choice["text"]
        return text, "length" if choice.get("finish_reason") == "length" else "stop"


# ----------------------------------------------------------------------------------------------------
# the run

T = TypeVar("T")
R = TypeVar("R")


def _ordered(fn: Callable[[T], R], items: Sequence[T], workers: int) -> Iterator[R]:
    """``map(fn, items)`` with up to ``workers`` calls in flight, results in order."""
    if workers <= 1:
        yield from map(fn, items)
        return
    with cf.ThreadPoolExecutor(workers) as pool:
        window: collections.deque[cf.Future[R]] = collections.deque()
        it = iter(items)
        for item in it:
            window.append(pool.submit(fn, item))
            if len(window) >= 2 * workers:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()


def make_job(teacher: Teacher, seed: int, index: int, images: Sequence[Path] | None, template: str) -> Job:
    """The fully determined input of sample ``index`` (``template``: "recipe", "chat" or "plain")."""
    sp = sample_prompt(seed, index)
    if template not in ("recipe", "chat", "plain"):
        raise ValueError(f"template {template!r} (expected recipe, chat or plain)")
    tmpl: Template = sp.template if template == "recipe" else ("chat" if template == "chat" else "plain")
    image = images[index % len(images)] if images else None
    return Job(index, generation_seed(seed, index), image, tmpl, sp.prompt, teacher.renderer.render(sp.prompt, tmpl))


def run(teacher: Teacher, out: Path, ids: Iterable[int], seed: int = DEFAULT_SEED,
        images: Sequence[Path] | None = None, cfg: GenConfig = GenConfig(), template: str = "recipe",
        workers: int = 1, progress: bool = True) -> int:
    """Generate the samples ``ids`` missing from ``out`` (resuming it), append them; return how many."""
    from tqdm import tqdm

    wanted = list(dict.fromkeys(ids))
    existing = recover(out)
    for s in existing:
        if s.seed != seed or s.teacher != teacher.name:
            raise GenerateError(f"{out} holds samples of another run (seed {s.seed}, teacher {s.teacher!r}; "
                                f"this run: seed {seed}, teacher {teacher.name!r}); choose another --out")
    done = {s.id for s in existing}
    todo = [i for i in wanted if i not in done]

    def one(i: int) -> Sample:
        job = make_job(teacher, seed, i, images, template)
        response, finish = teacher.generate(job, cfg)
        return Sample(id=i, seed=seed, image=None if job.image is None else str(job.image), template=job.template,
                      prompt=job.prompt, prompt_text=job.prompt_text, response=response, finish_reason=finish,
                      teacher=teacher.name)

    with SampleWriter(out) as writer, tqdm(total=len(wanted), initial=len(wanted) - len(todo), unit="sample",
                                           disable=not progress, dynamic_ncols=True) as bar:
        for sample in _ordered(one, todo, workers):
            writer.append(sample)
            bar.update(1)
    return len(todo)


EPILOG = """examples:
  # Llama 3.2 Vision teacher on a GPU, the default images (scikit-image photos), 1000 samples
  python -m qat.generate --model path/to/Llama-3.2-11B-Vision-Instruct -n 1000 --out data/train.jsonl
  # a running llama-server (mllama), 8 requests in flight, an image folder
  python -m qat.generate --endpoint http://127.0.0.1:8080/v1 --workers 8 --images imgs/ -n 100000 --out d.jsonl
  # text-only teacher
  python -m qat.generate --model "$(python -c 'from fixtures.assets import smollm2_hf_dir as d; print(d())')" \\
      --text-only -n 100 --out smol.jsonl
Re-running an interrupted command resumes it. Output schema: qat/data.py."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m qat.generate",
        description="Generate QAT self-distillation data: prompts sampled as in the reference recipe (section 5), "
                    "answered by a teacher (transformers, or an OpenAI-compatible endpoint), appended to a JSONL "
                    "file. Sample i is determined by (--seed, i).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("teacher (--model and/or --endpoint)")
    src.add_argument("--model", type=Path, help="HF model directory: MllamaForConditionalGeneration, or any causal "
                     "LM with --text-only. With --endpoint: only used to render prompt_text with its chat template")
    src.add_argument("--endpoint", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8080/v1 (llama-server)")
    src.add_argument("--endpoint-model", help="'model' field of the requests (default: first id of GET /models)")
    src.add_argument("--workers", type=int, default=1,
                     help="endpoint requests in flight; samples are still written in index order (default: 1)")
    src.add_argument("--timeout", type=float, default=600.0, help="seconds per endpoint request (default: 600)")
    src.add_argument("--teacher-name",
                     help="'teacher' field (default: the resolved model path, or endpoint:<url>#<model>)")
    p.add_argument("--out", type=Path, required=True, help="output JSONL; appended to, resumed if it exists")
    p.add_argument("-n", "--num-samples", type=int, required=True, help="number of sample indices to generate")
    p.add_argument("--start", type=int, default=0,
                   help="first sample index; parallel shards use disjoint ranges (default: 0)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED,
                   help="master seed; sample i is a function of (seed, i) (default: %(default)s, the recipe's)")
    p.add_argument("--images", type=Path, help="image folder, searched recursively and sorted; sample i uses image "
                   "i mod N (default: scikit-image's bundled colour photos)")
    p.add_argument("--text-only", action="store_true",
                   help="no images; plain template '{prompt}', chat template from the tokenizer (text LLMs)")
    p.add_argument("--template", choices=("recipe", "chat", "plain"), default="recipe",
                   help="recipe: chat w.p. 0.75, else plain '<|image|>{prompt}'; chat / plain: always that one")
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=GenConfig.temperature, help="(default: %(default)s)")
    g.add_argument("--top-p", type=float, default=GenConfig.top_p, help="nucleus sampling (default: %(default)s)")
    g.add_argument("--max-new-tokens", type=int, default=GenConfig.max_new_tokens, help="(default: %(default)s)")
    t = p.add_argument_group("transformers backend")
    t.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="weights dtype (default: bfloat16, the recipe's teacher)")
    t.add_argument("--device", help="torch device (default: cuda if available, else cpu)")
    t.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.model is None and a.endpoint is None:
        p.error("give --model DIR or --endpoint URL")
    if a.text_only and a.images is not None:
        p.error("--images makes no sense with --text-only")
    if a.num_samples < 0 or a.start < 0 or a.seed < 0 or a.workers < 1 or a.max_new_tokens < 1:
        p.error("--num-samples, --start and --seed must be >= 0, --workers and --max-new-tokens >= 1")


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    _check_args(p, a)
    try:
        if a.model is not None and not (a.model / "config.json").is_file():
            raise GenerateError(f"model directory {a.model} not found or has no config.json")
        images = None if a.text_only else list_images(a.images)
        if a.threads:
            import torch

            torch.set_num_threads(a.threads)
        teacher: Teacher
        if a.endpoint is not None:
            renderer = load_renderer(a.model, a.text_only) if a.model is not None else PromptRenderer(text_only=a.text_only)
            teacher = EndpointTeacher(a.endpoint, a.text_only, renderer, model=a.endpoint_model, timeout=a.timeout,
                                      name=a.teacher_name)
        else:
            teacher = TransformersTeacher(a.model, a.text_only, dtype=a.dtype, device=a.device, name=a.teacher_name)
        cfg = GenConfig(a.temperature, a.top_p, a.max_new_tokens)
        n = run(teacher, a.out, range(a.start, a.start + a.num_samples), seed=a.seed, images=images, cfg=cfg,
                template=a.template, workers=a.workers, progress=not a.no_progress)
    except GenerateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    print(f"{a.out}: {n} new samples, indices {a.start}..{a.start + a.num_samples - 1} complete", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

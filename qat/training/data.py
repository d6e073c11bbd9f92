"""QAT training, data: the training examples of ``--data`` (``qat.generate`` JSONL samples or plain text), the
seeded batch order, and the batches (token ids, attention and loss masks; mllama: the images' tiles and the
cross-attention mask).

Imports :mod:`qat.training.models` (the teacher's model type) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from qat.data import read_samples
from qat.errors import TrainError
from qat.generate import load_rgb
from qat.mllama_hf import cross_attention_mask, image_batch
from qat.text_eval import token_windows
from qat.training.models import model_type


@dataclass(frozen=True)
class Example:
    """Token ids of prompt + response (truncated to the sequence length) and the positions the loss uses."""

    ids: list[int]
    first_loss_pos: int  # positions first_loss_pos .. len(ids) - 2 predict response tokens
    image: str | None = None  # path of the sample's image (mllama)


def tokenise_samples(samples: Sequence[Any], tokenizer: Any, seq_len: int,
                     image_token_id: int | None = None) -> list[Example]:
    """Training examples of ``qat.data.Sample`` s: ``prompt_text + response`` (+ EOS when the teacher stopped).

    Prompt and response are tokenised separately (``add_special_tokens=False``), so the boundary is exact; the
    loss positions are those whose next token is a response token. Samples whose prompt leaves no response
    token within ``seq_len`` are dropped. With ``image_token_id`` (mllama) every sample must have an image and
    exactly one image token in its prompt; without it (text models) no sample may have an image.
    """
    out: list[Example] = []
    for s in samples:
        if image_token_id is None and s.image is not None:
            raise TrainError(f"sample {s.id} has an image; a text model trains on text-only data")
        if image_token_id is not None and s.image is None:
            raise TrainError(f"sample {s.id} has no image; mllama training needs an image per sample")
        p = tokenizer(s.prompt_text, add_special_tokens=False)["input_ids"]
        if image_token_id is not None and p.count(image_token_id) != 1:
            raise TrainError(f"sample {s.id}: the prompt has {p.count(image_token_id)} image tokens, expected 1")
        r = tokenizer(s.response, add_special_tokens=False)["input_ids"]
        if s.finish_reason == "stop" and tokenizer.eos_token_id is not None:
            r = r + [tokenizer.eos_token_id]
        ids = (p + r)[:seq_len]
        if len(p) >= 1 and len(ids) > len(p):
            out.append(Example(ids, len(p) - 1, s.image))
    return out


def text_examples(path: Path, tokenizer: Any, seq_len: int) -> list[Example]:
    """Training examples of a plain-text file: the whole text tokenised once (``add_special_tokens=False``, as
    :func:`qat.text_eval.token_windows` does for the evaluation) and cut into consecutive windows of ``seq_len``
    tokens; every position but the last predicts the next token and is a loss position (distillation on text)."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TrainError(f"{path}: not UTF-8 text ({e}); --data takes a qat.generate JSONL or a .txt file") from e
    try:
        windows = token_windows(tokenizer, text, ctx=seq_len, max_tokens=None)
    except ValueError as e:
        raise TrainError(f"{path}: {e} (--seq-len {seq_len})") from e
    return [Example([int(t) for t in row], 0) for row in windows]


def load_examples(path: Path, tokenizer: Any, seq_len: int, image_token_id: int | None = None) -> list[Example]:
    """The training examples of ``--data``: a ``.txt`` file is plain text (:func:`text_examples`; text models
    only), anything else JSONL samples of ``qat.generate`` (:func:`tokenise_samples`)."""
    if not path.is_file():
        raise TrainError(f"{path}: no such data file")
    if path.suffix == ".txt":
        if image_token_id is not None:
            raise TrainError(f"{path}: plain-text data trains text models; mllama needs image samples (qat.generate)")
        return text_examples(path, tokenizer, seq_len)
    examples = tokenise_samples(read_samples(path), tokenizer, seq_len, image_token_id)
    if not examples:
        raise TrainError(f"{path}: no sample has a response token within --seq-len {seq_len}")
    return examples


def batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """Dataset indices of the global batch of ``step``: consecutive slots of seeded per-epoch permutations."""
    out = []
    for g in range(step * batch, (step + 1) * batch):
        epoch, i = divmod(g, n)
        out.append(int(np.random.default_rng([seed, epoch]).permutation(n)[i]))
    return out


def collate(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and the boolean loss mask (B, T)."""
    t = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), t), dtype=torch.long)
    mask = torch.zeros((len(examples), t), dtype=torch.bool)
    for b, e in enumerate(examples):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        attn[b, : len(e.ids)] = 1
        mask[b, e.first_loss_pos: len(e.ids) - 1] = True
    return ids, attn, mask


class Batcher:
    """Model inputs and loss mask of a list of examples: text only, or with the images of mllama samples."""

    def __init__(self, pad_id: int, processor: Any = None, image_token_id: int | None = None,
                 max_num_tiles: int = 4) -> None:
        self.pad_id, self.processor, self.image_token_id, self.max_num_tiles = pad_id, processor, image_token_id, max_num_tiles
        self._images: dict[str, Any] = {}

    def _image(self, path: str | None) -> Any:
        if path is None:
            raise TrainError("a sample without an image for a vision model (qat.generate writes one per sample)")
        if path not in self._images:
            try:
                self._images[path] = load_rgb(Path(path))
            except Exception as e:  # PIL raises assorted types for unreadable files
                raise TrainError(f"{path}: cannot read the sample's image ({e})") from e
        return self._images[path]

    def __call__(self, examples: Sequence[Example]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        ids, attn, mask = collate(examples, self.pad_id)
        inputs = {"input_ids": ids, "attention_mask": attn}
        if self.image_token_id is not None:
            img = image_batch(self.processor.image_processor, [self._image(e.image) for e in examples])
            cam = cross_attention_mask([e.ids for e in examples], self.image_token_id, img.pop("num_tiles"),
                                       self.max_num_tiles, ids.shape[1])
            inputs.update(img, cross_attention_mask=torch.from_numpy(cam))
        return inputs, mask


def sample_inputs(teacher: Path) -> tuple[Any, Batcher, int | None]:
    """The teacher's tokenizer, a :class:`Batcher` for its samples and its image token id (mllama; None for a text
    model, whose samples have no image)."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer  # heavy, optional: transformers

    if model_type(teacher) != "mllama":
        tokenizer = AutoTokenizer.from_pretrained(teacher)
        processor, image_token_id, max_num_tiles = None, None, 4
    else:
        processor = AutoProcessor.from_pretrained(teacher)
        tokenizer = processor.tokenizer
        cfg = AutoConfig.from_pretrained(teacher)
        image_token_id, max_num_tiles = int(cfg.image_token_index), int(cfg.vision_config.max_num_tiles)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return tokenizer, Batcher(pad_id, processor, image_token_id, max_num_tiles), image_token_id


def n_loss_tokens(examples: Sequence[Example]) -> int:
    return sum(len(e.ids) - 1 - e.first_loss_pos for e in examples)

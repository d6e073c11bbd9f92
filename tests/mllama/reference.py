"""transformers reference for the mllama parity tests.

transformers 5.23 takes the vision encoder's intermediate "taps" from the *output* of the listed layers;
Meta's reference (and transformers 4.46, ollama, and our llama.cpp port) take the *input* of those layers
(mllama.md section 3.4). :func:`qat.mllama_hf.meta_taps` (here ``patch_meta_taps``) switches transformers to
Meta's semantics; the tests always compare against the patched model.

Everything runs in float32 with eager attention, so masks are applied exactly as written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from qat.mllama_hf import meta_taps as patch_meta_taps


def load_model(model_dir: Path):
    import torch
    from transformers import MllamaForConditionalGeneration

    model = MllamaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                           attn_implementation="eager")
    return model.eval()


@dataclass
class ImageInputs:
    pixel_values: "np.ndarray"       # [1, n_img, 4, 3, H, W]
    aspect_ratio_ids: "np.ndarray"   # [1, n_img]
    aspect_ratio_mask: "np.ndarray"  # [1, n_img, 4]
    num_tiles: list[int]


def preprocess(images: Sequence["object"]) -> ImageInputs:
    """HF preprocessing (the PIL processor) of a list of PIL images forming one sample."""
    from .tiny_model import image_processor

    out = image_processor()(images=[list(images)], return_tensors="np")
    return ImageInputs(out["pixel_values"], out["aspect_ratio_ids"], out["aspect_ratio_mask"],
                       [int(n) for n in out["num_tiles"][0]])


def cross_attention_mask(input_ids: Sequence[int], image_token_id: int, num_tiles: list[int],
                         max_num_tiles: int = 4) -> np.ndarray:
    from qat.mllama_hf import cross_attention_mask as batch_mask

    return batch_mask([input_ids], image_token_id, [num_tiles], max_num_tiles, len(input_ids))


@dataclass
class Reference:
    prompt_logits: np.ndarray            # [n_prompt, n_vocab]
    tokens: list[int]                    # greedy continuation
    step_logits: np.ndarray              # [n_steps, n_vocab]: logits that produced tokens[1:]
    cross_states: np.ndarray | None      # [n_img * 4 * n_patches, n_embd] (projected)


def run(model, input_ids: Sequence[int], images: Sequence["object"] = (), n_steps: int = 0,
        image_token_id: int | None = None) -> Reference:
    """Prefill ``input_ids`` (with images), then ``n_steps`` greedy steps with the KV cache.

    Decode steps reuse HF's caches exactly as ``generate`` does: pixel values are dropped and the
    cross-attention mask is extended by repeating its last row.
    """
    import torch

    if image_token_id is None:
        image_token_id = model.config.image_token_index
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    kwargs = {}
    cross = None
    with torch.no_grad(), patch_meta_taps():
        if images:
            inp = preprocess(images)
            cam = cross_attention_mask(input_ids, image_token_id, inp.num_tiles)
            kwargs = dict(pixel_values=torch.from_numpy(inp.pixel_values),
                          aspect_ratio_ids=torch.from_numpy(inp.aspect_ratio_ids),
                          aspect_ratio_mask=torch.from_numpy(inp.aspect_ratio_mask),
                          cross_attention_mask=torch.from_numpy(cam))
            vis = model.model.vision_model(pixel_values=kwargs["pixel_values"],
                                           aspect_ratio_ids=kwargs["aspect_ratio_ids"],
                                           aspect_ratio_mask=kwargs["aspect_ratio_mask"])
            cs = model.model.multi_modal_projector(vis.last_hidden_state)
            cross = cs.reshape(-1, cs.shape[-1]).numpy().copy()
        out = model(input_ids=ids, use_cache=True, **kwargs)
        prompt_logits = out.logits[0].numpy().copy()
        past = out.past_key_values
        tokens = [int(np.argmax(prompt_logits[-1]))]
        step_logits = []
        cam_t = kwargs.get("cross_attention_mask")
        for i in range(n_steps):
            nxt = torch.tensor([[tokens[-1]]], dtype=torch.long)
            step_kwargs = {}
            if cam_t is not None:
                cam_t = torch.cat([cam_t, cam_t[:, -1:]], dim=1)
                step_kwargs["cross_attention_mask"] = cam_t
            pos = torch.tensor([[len(input_ids) + i]], dtype=torch.long)
            out = model(input_ids=nxt, past_key_values=past, use_cache=True, position_ids=pos,
                        cache_position=pos[0], **step_kwargs)
            past = out.past_key_values
            lg = out.logits[0, -1].numpy().copy()
            step_logits.append(lg)
            tokens.append(int(np.argmax(lg)))
    steps = np.array(step_logits) if step_logits else np.zeros((0, prompt_logits.shape[1]), np.float32)
    return Reference(prompt_logits, tokens, steps, cross)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| (normwise relative error of a against the reference b)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))

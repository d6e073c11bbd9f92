"""transformers reference for the mllama parity tests.

transformers 5.23 takes the vision encoder's intermediate "taps" from the *output* of the listed layers;
Meta's reference (and transformers 4.46, ollama, and our llama.cpp port) take the *input* of those layers
(mllama.md section 3.4). :func:`qat.mllama_hf.meta_taps` (here ``patch_meta_taps``) switches transformers to
Meta's semantics; the tests always compare against the patched model.

Everything runs in float32 with eager attention, so masks are applied exactly as written.

A cap on the tiles of an image (llama.cpp's ``--image-max-tiles N``, transformers' ``max_image_tiles=N`` of the
image processor) needs two things transformers does not do by itself with a model of 4-tile tables
(:func:`preprocess`, :func:`tile_slots`):

* the processor numbers the tile grids of at most N tiles (N = 2: 1x1, 1x2, 2x1 are ids 1, 2, 3) while the rows of
  the model's tile tables are those of the grids of ``max_num_tiles`` tiles (2x1 is id 5): the ids are converted to
  the tables' (the grid is the same);
* the encoder gets N tile slots, and the tile embeddings of the tables' first N tiles (each row holds the tiles of
  its grid, then zeros). transformers' embedding modules reshape to all ``max_num_tiles`` tiles and fail for
  N = 2, 3: :func:`tile_slots` takes the first N. With N = ``max_num_tiles`` nothing changes.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
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
    pixel_values: "np.ndarray"       # [1, n_img, max_tiles, 3, H, W]
    aspect_ratio_ids: "np.ndarray"   # [1, n_img]: rows of the model's tile tables (grids of TABLE_TILES tiles)
    aspect_ratio_mask: "np.ndarray"  # [1, n_img, max_tiles]
    num_tiles: list[int]
    processor_ids: "np.ndarray"      # [1, n_img]: the processor's own ids (grids of max_tiles tiles)


#: the tiles of a row of the tile tables (vision_config.max_num_tiles, 4 in Llama 3.2 Vision and the tiny models)
TABLE_TILES = 4


def table_aspect_ratio_ids(ids: np.ndarray, max_tiles: int, table_tiles: int = TABLE_TILES) -> np.ndarray:
    """The processor's aspect-ratio ids (1-based indices into the grids of at most ``max_tiles`` tiles; 0 = no image)
    as ids of the same grids among those of ``table_tiles`` tiles, the rows of the model's tile tables."""
    from transformers.models.mllama.image_processing_pil_mllama import get_all_supported_aspect_ratios

    grids = get_all_supported_aspect_ratios(max_tiles)
    table = get_all_supported_aspect_ratios(table_tiles)
    out = np.array(ids, copy=True)
    for idx in np.ndindex(out.shape):
        if out[idx] > 0:
            out[idx] = table.index(grids[int(out[idx]) - 1]) + 1
    return out


def preprocess(images: Sequence["object"], max_tiles: int = TABLE_TILES) -> ImageInputs:
    """HF preprocessing (the PIL processor, ``max_image_tiles=max_tiles``) of a list of PIL images forming one
    sample; the aspect-ratio ids are converted to the tables' (module docstring)."""
    from .tiny_model import image_processor

    out = image_processor(max_image_tiles=max_tiles)(images=[list(images)], return_tensors="np")
    ids = out["aspect_ratio_ids"]
    return ImageInputs(out["pixel_values"], table_aspect_ratio_ids(ids, max_tiles), out["aspect_ratio_mask"],
                       [int(n) for n in out["num_tiles"][0]], ids)


@contextmanager
def tile_slots():
    """transformers' tile embeddings for an encoder with fewer tile slots than the tables hold: the first slots of
    the table rows (module docstring). Equal to transformers' own code when the slots are all the tiles."""
    from transformers.models.mllama import modeling_mllama as mm

    def aspect_ratio_embedding(self, hidden_states, aspect_ratio_ids):
        n = hidden_states.shape[1]
        embeddings = self.embedding(aspect_ratio_ids).reshape(-1, self.max_num_tiles, 1, self.hidden_size)[:, :n]
        if self.is_gated:
            embeddings = embeddings * self.gate.tanh()
        return hidden_states + embeddings

    def position_embedding(self, hidden_states, aspect_ratio_ids):
        n = hidden_states.shape[1]
        gated_position_embedding = (1 - self.gate.tanh()) * self.embedding
        hidden_states = hidden_states + gated_position_embedding.view(1, 1, self.num_patches, self.hidden_size)
        tile = self.tile_embedding(aspect_ratio_ids).reshape(
            hidden_states.shape[0], self.max_num_tiles, self.num_patches, self.hidden_size)[:, :n]
        return hidden_states + self.gate.tanh() * tile

    saved = (mm.MllamaPrecomputedAspectRatioEmbedding.forward, mm.MllamaPrecomputedPositionEmbedding.forward)
    mm.MllamaPrecomputedAspectRatioEmbedding.forward = aspect_ratio_embedding
    mm.MllamaPrecomputedPositionEmbedding.forward = position_embedding
    try:
        yield
    finally:
        mm.MllamaPrecomputedAspectRatioEmbedding.forward, mm.MllamaPrecomputedPositionEmbedding.forward = saved


def cross_attention_mask(input_ids: Sequence[int], image_token_id: int, num_tiles: list[int],
                         max_num_tiles: int = 4) -> np.ndarray:
    from qat.mllama_hf import cross_attention_mask as batch_mask

    return batch_mask([input_ids], image_token_id, [num_tiles], max_num_tiles, len(input_ids))


@dataclass
class Reference:
    prompt_logits: np.ndarray            # [n_prompt, n_vocab]
    tokens: list[int]                    # greedy continuation
    step_logits: np.ndarray              # [n_steps, n_vocab]: logits that produced tokens[1:]
    cross_states: np.ndarray | None      # [n_img * max_tiles * n_patches, n_embd] (projected)


def run(model, input_ids: Sequence[int], images: Sequence["object"] = (), n_steps: int = 0,
        image_token_id: int | None = None, max_tiles: int = TABLE_TILES) -> Reference:
    """Prefill ``input_ids`` (with images), then ``n_steps`` greedy steps with the KV cache; ``max_tiles`` caps the
    tiles of an image (module docstring).

    Decode steps reuse HF's caches exactly as ``generate`` does: pixel values are dropped and the
    cross-attention mask is extended by repeating its last row.
    """
    import torch

    if image_token_id is None:
        image_token_id = model.config.image_token_index
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    kwargs = {}
    cross = None
    assert model.config.vision_config.max_num_tiles == TABLE_TILES
    slots = tile_slots() if max_tiles < TABLE_TILES else nullcontext()
    with torch.no_grad(), patch_meta_taps(), slots:
        if images:
            inp = preprocess(images, max_tiles)
            cam = cross_attention_mask(input_ids, image_token_id, inp.num_tiles, max_tiles)
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

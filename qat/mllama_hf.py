"""transformers' Llama 3.2 Vision (mllama) with llama.cpp's semantics, and its training inputs.

transformers 5 takes the vision encoder's intermediate features ("taps") from the *output* of the listed layers;
Meta's reference, our converter's GGUF (``clip.vision.feature_layer``) and llama.cpp's mtmd take the *input* of
those layers (docs/mllama.md). :func:`meta_taps` switches transformers to Meta's semantics, so that a teacher
generating data, a QAT student and the parity tests all compute what the exported GGUF computes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np

__all__ = ["meta_taps", "image_batch", "cross_attention_mask"]


@contextlib.contextmanager
def meta_taps() -> Iterator[None]:
    """Within the block, ``MllamaVisionEncoder`` records the state *before* each layer (Meta semantics)."""
    from transformers.modeling_outputs import BaseModelOutput
    from transformers.models.mllama import modeling_mllama as mm

    original = mm.MllamaVisionEncoder.forward

    def forward(self, hidden_states, attention_mask=None):
        states = ()
        for layer in self.layers:
            states = states + (hidden_states,)
            hidden_states = layer(hidden_states=hidden_states, attention_mask=attention_mask)
        return BaseModelOutput(last_hidden_state=hidden_states, hidden_states=states)

    mm.MllamaVisionEncoder.forward = forward
    try:
        yield
    finally:
        mm.MllamaVisionEncoder.forward = original


def image_batch(image_processor: Any, images: Sequence[Any]) -> dict[str, Any]:
    """Pixel values, aspect-ratio ids/mask (torch) and tile counts of one image per sample, padded to the most
    tiles of the batch (the processor's own padding)."""
    out = image_processor(images=[[img] for img in images], return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "aspect_ratio_ids": out["aspect_ratio_ids"],
            "aspect_ratio_mask": out["aspect_ratio_mask"],
            "num_tiles": [[int(n) for n in row] for row in out["num_tiles"]]}


def cross_attention_mask(batch_ids: Sequence[Sequence[int]], image_token_id: int, num_tiles: Sequence[Sequence[int]],
                         max_num_tiles: int, length: int) -> np.ndarray:
    """transformers' dense cross-attention mask (B, length, n_images, max_num_tiles) of token sequences."""
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)

    sparse = [get_cross_attention_token_mask(list(ids), image_token_id) for ids in batch_ids]
    return convert_sparse_cross_attention_mask_to_dense(sparse, [list(n) for n in num_tiles], max_num_tiles, length)

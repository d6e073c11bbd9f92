"""QAT training, loss: the logits at the loss positions only, and KL(teacher || student) over the full
vocabulary; the recipe's learning rate. Imports no other training module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class SelectedLogits(nn.Module):
    """Logits of a causal LM at the masked positions only (the LM head is the costly part at 49k vocab)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm: Any = lm  # an HF causal LM (.model, .lm_head)

    def forward(self, mask: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.lm.model(**inputs).last_hidden_state
        return self.lm.lm_head(hidden[mask])


def kl_sum(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Sum over rows of KL(p_T || p_S) = sum_v p_T (log p_T - log p_S), full vocabulary, fp32."""
    lt = F.log_softmax(teacher_logits.float(), dim=-1)
    ls = F.log_softmax(student_logits.float(), dim=-1)
    return (lt.exp() * (lt - ls)).sum()


def default_lr(bits: float) -> float:
    """The recipe's learning rate for a b-bit format: 2^-(b + 14) (S3D8, b = 3: 2^-17)."""
    return 2.0 ** -(bits + 14)

"""The train specs' loss: TorchTitan's summed cross-entropy, or the fused head's for ``fused_ce``."""

from __future__ import annotations

import torch
from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss, cross_entropy_loss

from titan_upipe.transforms.model_forward import FinalHiddenStates

__all__ = ["IGNORE_INDEX", "build_loss_fn", "cross_entropy_loss"]
"""``IGNORE_INDEX`` and ``cross_entropy_loss`` are TorchTitan's, for the tools (which import no TorchTitan)."""


def build_loss_fn(job_config, **kwargs):
    """Sum over non-ignored tokens either way; the trainer divides by the global token count."""
    stock = build_cross_entropy_loss(job_config, **kwargs)

    def loss_fn(pred, labels: torch.Tensor) -> torch.Tensor:
        if isinstance(pred, FinalHiddenStates):
            return pred.loss_sum(labels)
        return stock(pred, labels)

    return loss_fn

"""TorchTitan 0.2.2's Llama3 and Qwen3, described for the core (``titan_upipe.attention.model_protocol``).

:func:`register_model_classes` registers :data:`LLAMA3` and :data:`QWEN3` with the core's
``MODEL_CLASSES`` (``registry.register_plugin()`` calls it; idempotent): from then on the core
converts their attention, tiles their feed-forwards, splits their blocks for offloaded
checkpointing and swaps their models for the fused-forward subclasses below.

The fused subclasses keep the model class's attributes, so FQNs, state dicts and
``init_weights`` stay TorchTitan's; ``init_weights`` builds the RoPE buffer through the
``_precompute_*`` method each overrides, which returns the compact table under ``fused_rope``.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.models.llama3.model import model as llama3
from torchtitan.models.qwen3.model import model as qwen3

from titan_upipe.attention.model_protocol import MODEL_CLASSES, ModelClasses, ModelFamily
from titan_upipe.attention.projection import RotaryKind
from titan_upipe.transforms.model_forward import TransformedForward
from titan_upipe.transforms.rope import inverse_frequencies

Tensor = torch.Tensor


class FusedLlama3Transformer(TransformedForward, llama3.Transformer):
    """Llama3's ``Transformer`` with the transformed forward (``fused_rope``, ``fused_ce``)."""

    ROPE_BUFFER = "freqs_cis"

    def _compact_rope(self) -> Tensor:
        args = self.model_args
        return inverse_frequencies(RotaryKind.COMPLEX, args.dim // args.n_heads, args.rope_theta,
                                   args.rope_scaling_args)

    def _precompute_freqs_cis(self) -> Tensor:  # called by init_weights
        return self._rope_table(super()._precompute_freqs_cis)


class FusedQwen3Model(TransformedForward, qwen3.Qwen3Model):
    """``Qwen3Model`` with the transformed forward (``fused_rope``, ``fused_ce``)."""

    ROPE_BUFFER = "rope_cache"

    def _compact_rope(self) -> Tensor:
        return inverse_frequencies(RotaryKind.COS_SIN, self.model_args.head_dim, self.model_args.rope_theta)

    def _precompute_rope_cache(self) -> Tensor:  # called by init_weights
        return self._rope_table(super()._precompute_rope_cache)


def _llama3_scale(attention: nn.Module) -> float:
    # Llama3 leaves the scale to F.scaled_dot_product_attention, whose default is 1/sqrt(D).
    return attention.head_dim**-0.5


def _qwen3_scale(attention: nn.Module) -> float:
    return attention.scaling


LLAMA3 = ModelFamily(name="Llama3", model=llama3.Transformer, block=llama3.TransformerBlock,
                     attention=llama3.Attention, feed_forward=llama3.FeedForward, rotary=RotaryKind.COMPLEX,
                     attention_scale=_llama3_scale, fused_model=FusedLlama3Transformer)
QWEN3 = ModelFamily(name="Qwen3", model=qwen3.Qwen3Model, block=qwen3.TransformerBlock, attention=qwen3.Attention,
                    feed_forward=qwen3.FeedForward, rotary=RotaryKind.COS_SIN, attention_scale=_qwen3_scale,
                    fused_model=FusedQwen3Model)
FAMILIES = (LLAMA3, QWEN3)


def register_model_classes(classes: ModelClasses = MODEL_CLASSES) -> None:
    """Register TorchTitan's Llama3 and Qwen3 with the core (again: nothing changes)."""
    for family in FAMILIES:
        classes.register(family)

"""The model-level forward the ``fused_rope`` and ``fused_ce`` converters need.

TorchTitan's ``Transformer.forward`` passes its full-length RoPE buffer to every block and
ends with the output projection. A converter swaps the model's class for a subclass that
differs in exactly those two places (the class swap is how FSDP wraps modules too; parameters,
buffers' names, FQNs and ``init_weights`` stay the model's):

* ``fused_rope``: the RoPE buffer holds the ``D/2`` inverse frequencies; each forward builds
  the rows of the positions in the batch (``rope.local_rope_inputs``) and passes those.
* ``fused_ce``: the forward stops after the final norm and returns :class:`FinalHiddenStates`;
  the loss function (``loss.build_loss_fn``) calls the output head with the labels.

Both flags live on the instance, so the converters compose in any order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torchtitan.models.llama3.model.model import Transformer as Llama3Transformer
from torchtitan.models.qwen3.model.model import Qwen3Model

from titan_upipe.attention.module import ContextParallelAttention
from titan_upipe.attention.projection import RotaryKind
from titan_upipe.errors import ConfigError
from titan_upipe.transforms.rope import inverse_frequencies, local_rope_inputs

Tensor = torch.Tensor


@dataclass
class FinalHiddenStates:
    """What a ``fused_ce`` model returns instead of logits: the final-normed hidden states and
    the head that turns them (with labels) into the summed loss. FSDP2 finds ``hidden`` (it
    traverses dataclasses) and hooks its gradient like any model output."""

    hidden: Tensor
    head: nn.Module

    def loss_sum(self, labels: Tensor) -> Tensor:
        return self.head(self.hidden, labels)


class _TransformedForward:
    """Mixin placed before a TorchTitan model class."""

    fused_rope_kind: RotaryKind | None = None
    fused_cross_entropy: bool = False

    @property
    def _rope_buffer(self) -> Tensor:
        return getattr(self, self.ROPE_BUFFER)

    def _compact_rope(self) -> Tensor:
        raise NotImplementedError

    def forward(self, tokens: Tensor, attention_masks=None, positions: Tensor | None = None):
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        table, layer_positions = self._rope_buffer, positions
        if self.fused_rope_kind is not None:
            table, layer_positions = local_rope_inputs(table, self.fused_rope_kind, tokens, positions)
        for layer in self.layers.values():
            h = layer(h, table, attention_masks, layer_positions)
        h = self.norm(h) if self.norm is not None else h
        if self.fused_cross_entropy:
            return FinalHiddenStates(h, self.output)
        return self.output(h) if self.output is not None else h


class FusedLlama3Transformer(_TransformedForward, Llama3Transformer):
    ROPE_BUFFER = "freqs_cis"

    def _compact_rope(self) -> Tensor:
        args = self.model_args
        return inverse_frequencies(RotaryKind.COMPLEX, args.dim // args.n_heads, args.rope_theta,
                                   args.rope_scaling_args)

    def _precompute_freqs_cis(self) -> Tensor:  # called by init_weights
        return self._compact_rope() if self.fused_rope_kind is not None else super()._precompute_freqs_cis()


class FusedQwen3Model(_TransformedForward, Qwen3Model):
    ROPE_BUFFER = "rope_cache"

    def _compact_rope(self) -> Tensor:
        return inverse_frequencies(RotaryKind.COS_SIN, self.model_args.head_dim, self.model_args.rope_theta)

    def _precompute_rope_cache(self) -> Tensor:  # called by init_weights
        return self._compact_rope() if self.fused_rope_kind is not None else super()._precompute_rope_cache()


_FUSED_CLASSES = {Llama3Transformer: FusedLlama3Transformer, Qwen3Model: FusedQwen3Model}


def transformed(model: nn.Module) -> _TransformedForward:
    """``model`` with the transformed forward (idempotent); Llama3 and Qwen3 only."""
    if isinstance(model, _TransformedForward):
        return model
    fused = _FUSED_CLASSES.get(type(model))
    if fused is None:
        raise ConfigError(f"fused_rope and fused_ce support TorchTitan's Llama3 Transformer and Qwen3Model, "
                          f"got {type(model).__name__}")
    model.__class__ = fused
    return model


def enable_fused_rope(model: nn.Module) -> None:
    """Replace the full-length RoPE buffer by the inverse frequencies (on the model's device),
    and rotate in place in context-parallel attention converted before or after this."""
    model = transformed(model)
    for module in model.modules():
        if isinstance(module, ContextParallelAttention):
            module.in_place_rope = True
    model.fused_rope_kind = (RotaryKind.COMPLEX if isinstance(model, FusedLlama3Transformer)
                             else RotaryKind.COS_SIN)
    device = model._rope_buffer.device
    with torch.device(device):
        compact = model._compact_rope()
    model.register_buffer(model.ROPE_BUFFER, compact, persistent=False)


def enable_fused_cross_entropy(model: nn.Module) -> None:
    transformed(model).fused_cross_entropy = True

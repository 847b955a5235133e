"""The model-level forward the ``fused_rope`` and ``fused_ce`` converters need.

A registered family's model (``attention.model_protocol``: TorchTitan's Llama3 ``Transformer``,
``Qwen3Model``) passes its full-length RoPE buffer to every block and ends with the output
projection. A converter swaps the model's class for the family's ``fused_model``: the model class
with :class:`TransformedForward` in front, which differs in exactly those two places (the class
swap is how FSDP wraps modules too; parameters, buffers' names, FQNs and ``init_weights`` stay the
model's). The adapter that registers the family defines that subclass (TorchTitan's:
``titan_upipe.torchtitan_0_2.model_classes``):

* ``fused_rope``: the RoPE buffer holds the ``D/2`` inverse frequencies; each forward builds
  the rows of the positions in the batch (``rope.local_rope_inputs``) and passes those.
* ``fused_ce``: the forward stops after the final norm and returns :class:`FinalHiddenStates`;
  the loss function (``loss.build_loss_fn``) calls the output head with the labels.

Both flags live on the instance, so the converters compose in any order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from titan_upipe.attention.model_protocol import MODEL_CLASSES, UNREGISTERED_HINT, ModelClasses, ModelFamily
from titan_upipe.attention.module import ContextParallelAttention
from titan_upipe.attention.projection import RotaryKind
from titan_upipe.errors import ConfigError
from titan_upipe.transforms.rope import local_rope_inputs

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


class TransformedForward:
    """Mixin placed before a model class (``ModelFamily.fused_model``). A subclass names its RoPE
    buffer (``ROPE_BUFFER``), returns the compact table (:meth:`_compact_rope`, the ``D/2``
    inverse frequencies: ``rope.inverse_frequencies``) and routes the method ``init_weights``
    builds the buffer with through :meth:`_rope_table`."""

    ROPE_BUFFER: str
    fused_rope_kind: RotaryKind | None = None
    fused_cross_entropy: bool = False

    @property
    def _rope_buffer(self) -> Tensor:
        return getattr(self, self.ROPE_BUFFER)

    def _compact_rope(self) -> Tensor:
        raise NotImplementedError

    def _rope_table(self, full_table: Callable[[], Tensor]) -> Tensor:
        """What ``init_weights`` puts in the RoPE buffer: the compact table under ``fused_rope``,
        else the model's own full one (``full_table()``)."""
        return self._compact_rope() if self.fused_rope_kind is not None else full_table()

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


def model_family(model: nn.Module, classes: ModelClasses = MODEL_CLASSES) -> ModelFamily:
    """The registered family of ``model`` (its class, or its ``fused_model``), one with a fused model."""
    family = classes.model_family(model)
    if family is None or family.fused_model is None:
        supported = (f"the registered {classes.names()} models" if classes.families else
                     f"the models of registered model families, and none is: {UNREGISTERED_HINT}")
        raise ConfigError(f"fused_rope and fused_ce support {supported}; got {type(model).__name__}")
    return family


def transformed(model: nn.Module) -> TransformedForward:
    """``model`` with the transformed forward (idempotent); registered families only."""
    if isinstance(model, TransformedForward):
        return model
    model.__class__ = model_family(model).fused_model
    return model


def enable_fused_rope(model: nn.Module) -> None:
    """Replace the full-length RoPE buffer by the inverse frequencies (on the model's device),
    and rotate in place in context-parallel attention converted before or after this."""
    model = transformed(model)
    for module in model.modules():
        if isinstance(module, ContextParallelAttention):
            module.in_place_rope = True
    model.fused_rope_kind = model_family(model).rotary
    device = model._rope_buffer.device
    with torch.device(device):
        compact = model._compact_rope()
    model.register_buffer(model.ROPE_BUFFER, compact, persistent=False)


def enable_fused_cross_entropy(model: nn.Module) -> None:
    transformed(model).fused_cross_entropy = True

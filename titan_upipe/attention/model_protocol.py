"""What the core needs to know about a model family: the protocol its modules follow, and a registry.

The core converts a family's modules without importing the family: an adapter describes the
family's classes in a :class:`ModelFamily` record and registers it with :data:`MODEL_CLASSES`
(``titan_upipe.torchtitan_0_2.model_classes`` registers TorchTitan 0.2.2's Llama3 and Qwen3, from
``register_plugin()``). The structural facts are read from the modules (the protocols below); a
record adds what no attribute tells: the RoPE table's kind and the softmax scale.

* attention (:class:`AttentionModule`): ``wq`` ``[H·D, d]``, ``wk``/``wv`` ``[KV·D, d]``, ``wo``
  ``[d, H·D]`` without bias (where the family keeps them: ``ModelFamily.projection_paths``); optional per-head RMSNorms ``q_norm``/``k_norm`` ``[D]`` applied
  before RoPE; ``softmax(scale · q kᵀ) v`` per head, with the RoPE table given at call time:
  ``COMPLEX`` (Llama3 ``freqs_cis``, complex ``[S, D/2]``) or ``COS_SIN`` (Qwen3 ``rope_cache``,
  real ``cos‖sin`` ``[S, 2D]``);
* feed-forward (:class:`FeedForwardModule`): SwiGLU ``w2(silu(w1 x) · w3 x)``;
* block (:class:`BlockModule`): ``h = x + attention(attention_norm(x), rope, masks, positions)``,
  ``out = h + feed_forward(ffn_norm(h))`` (``moe`` in place of ``feed_forward`` when
  ``moe_enabled``);
* model (:class:`ModelModule`): ``tok_embeddings``, ``layers``, ``norm``, ``output`` and the RoPE
  buffer; ``fused_model`` is its subclass with the transformed forward
  (``titan_upipe.transforms.model_forward.TransformedForward``), which the adapter builds.

Lookups follow ``isinstance`` (a subclass of a registered class belongs to its family), except
the model's, which is by exact class (the class swap must not skip a subclass's own forward).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import nn

from titan_upipe.attention.projection import RotaryKind
from titan_upipe.errors import ConfigError

PROJECTIONS = ("wq", "wk", "wv", "wo")
"""The attention's projection submodules (``nn.Linear`` without bias)."""
QK_NORMS = ("q_norm", "k_norm")
"""Its optional per-head RMSNorms (Qwen3's qk-norm)."""


class AttentionModule(Protocol):
    n_heads: int
    n_kv_heads: int
    head_dim: int
    wq: nn.Linear
    wk: nn.Linear
    wv: nn.Linear
    wo: nn.Linear

    def init_weights(self, init_std: float) -> None: ...


class FeedForwardModule(Protocol):
    w1: nn.Linear
    w2: nn.Linear
    w3: nn.Linear

    def init_weights(self, init_std: float) -> None: ...


class BlockModule(Protocol):
    attention_norm: nn.Module
    attention: nn.Module
    ffn_norm: nn.Module


class ModelModule(Protocol):
    tok_embeddings: nn.Module | None
    layers: nn.ModuleDict
    norm: nn.Module | None
    output: nn.Module | None

    def forward(self, tokens: torch.Tensor, attention_masks=None, positions: torch.Tensor | None = None): ...


@dataclass(frozen=True)
class ModelFamily:
    """One model family's classes, as an adapter registers them."""

    name: str
    """How messages name the family (``"Llama3"``)."""
    model: type[nn.Module]
    block: type[nn.Module]
    attention: type[nn.Module]
    feed_forward: type[nn.Module]
    """Its dense SwiGLU feed-forward (an MoE is not one)."""
    rotary: RotaryKind | Callable[[nn.Module], RotaryKind]
    """The RoPE table the attention reads: one kind for the family, or read off each attention module
    (a family whose attention class serves models of both kinds)."""
    attention_scale: Callable[[nn.Module], float]
    """The softmax scale an attention module of the family applies."""
    fused_model: type[nn.Module] | None = None
    """``model`` with the transformed forward (``fused_rope``, ``fused_ce``); None: not supported."""
    projection_paths: tuple[str, str, str, str] = PROJECTIONS
    """Where ``wq``, ``wk``, ``wv``, ``wo`` sit in the attention module (dotted attribute paths:
    TorchTitan 0.3 keeps the first three in ``qkv_linear``)."""
    kept_children: tuple[str, ...] = ()
    """Further children of the attention the converted module keeps as its own (0.3's ``rope``, whose
    table it reads), besides the projections' and the QK norms."""
    converted_attention: type[nn.Module] | None = None
    """The class the family's attention converts to (a subclass of the core's
    ``ContextParallelAttention`` with the family's forward signature); None: the core's class."""
    converted_tsp_attention: type[nn.Module] | None = None
    """The same under TSP (a subclass of ``tsp.modules.TSPAttention``); None: the core's class."""

    def classes(self) -> tuple[type[nn.Module], ...]:
        return tuple(value for f in fields(self) if isinstance(value := getattr(self, f.name), type))

    def rotary_of(self, attention: nn.Module) -> RotaryKind:
        """The RoPE kind ``attention`` (a module of this family) applies."""
        return self.rotary if isinstance(self.rotary, RotaryKind) else self.rotary(attention)


def projection(attention: nn.Module, path: str) -> nn.Linear:
    """The projection at the dotted ``path`` of ``attention`` (``ModelFamily.projection_paths``)."""
    return operator.attrgetter(path)(attention)


class ModelClasses:
    """The registered model families, looked up by a module's class."""

    def __init__(self) -> None:
        self._families: dict[str, ModelFamily] = {}

    def register(self, family: ModelFamily) -> None:
        """Add ``family``; registering the same record again does nothing. A different record
        under a registered name, or a class another family claims, is refused."""
        known = self._families.get(family.name)
        if known == family:
            return
        if known is not None:
            raise ValueError(f"model family {family.name!r} is registered already, with other classes")
        claimed = {cls: other.name for other in self._families.values() for cls in other.classes()}
        clashes = [f"{cls.__name__} ({claimed[cls]})" for cls in family.classes() if cls in claimed]
        if clashes:
            raise ValueError(f"model family {family.name!r} names classes of other families: {', '.join(clashes)}")
        self._families[family.name] = family

    @property
    def families(self) -> tuple[ModelFamily, ...]:
        return tuple(self._families.values())

    def require(self, what: str) -> ModelClasses:
        """Self, or ConfigError when no family is registered: a lookup in an empty registry answers
        "not a known module" for every module, which would turn a transform off without a word."""
        if not self._families:
            raise ConfigError(f"{what} needs the model classes registered, and none is: {UNREGISTERED_HINT}")
        return self

    def names(self) -> str:
        """``"Llama3 and Qwen3"``: the families, for messages."""
        names = [family.name for family in self._families.values()]
        return " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names) or "no model family"

    def _of(self, module: object, role: str) -> ModelFamily | None:
        for cls in type(module).__mro__:  # isinstance, with the family of the nearest class
            for family in self._families.values():
                if getattr(family, role) is cls:
                    return family
        return None

    def attention_family(self, module: object) -> ModelFamily | None:
        return self._of(module, "attention")

    def block_family(self, module: object) -> ModelFamily | None:
        return self._of(module, "block")

    def feed_forward_family(self, module: object) -> ModelFamily | None:
        return self._of(module, "feed_forward")

    def model_family(self, model: object) -> ModelFamily | None:
        """The family whose ``model`` or ``fused_model`` is exactly ``model``'s class."""
        return next((family for family in self._families.values()
                     if type(model) in (family.model, family.fused_model)), None)


MODEL_CLASSES = ModelClasses()
"""The families the core converts: empty until an adapter registers its own (explicitly, by its
plugin registration: importing a module registers nothing)."""

UNREGISTERED_HINT = ("titan_upipe.torchtitan_0_2.registry.register_plugin() registers TorchTitan's Llama3 and Qwen3 "
                     "(model_classes.register_model_classes() alone)")
"""What a message says when a module's class is not registered."""

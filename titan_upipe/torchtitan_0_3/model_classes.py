"""TorchTitan 0.3's decoders, described for the core (``titan_upipe.attention.model_protocol``).

0.3's Llama3 and Qwen3 share one attention class, ``GQAttention``, and one feed-forward,
``FeedForward``; what tells them apart for the core is the RoPE each attention owns. So 0.3 is
one family record, :data:`DECODERS`, whose RoPE kind is read off each attention:

=========================== ============================================= =========================
the core needs              0.2.2 (``torchtitan_0_2.model_classes``)      0.3 (here)
=========================== ============================================= =========================
``wq``, ``wk``, ``wv``      on the attention                              in ``qkv_linear`` (the
                                                                          unfused ``QKVLinear``)
the RoPE table              the model's ``freqs_cis`` / ``rope_cache``,   each attention's
                            passed to every block                         ``rope.cache``
RoPE kind                   per family                                    ``ComplexRoPE`` -> Llama3's
                                                                          complex table, ``CosSinRoPE``
                                                                          -> Qwen3's cos||sin one
forward                     ``(x, freqs_cis, masks, positions)``          ``(x, masks, positions)``
=========================== ============================================= =========================

The converted attention (:class:`ContextParallelGQAttention`) keeps ``qkv_linear``, ``wo``, the QK
norms and ``rope`` as its own children, in the source's order, and is a 0.3 ``Module`` itself: parameter
names, state dicts, FSDP units and 0.3's ``init_states`` (its order of draws, and ``rope.cache``
recomputed after ``to_empty``) are the unconverted model's.
"""

from __future__ import annotations

import torch
from torch import nn
from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Decoder, FeedForward, TransformerBlock
from torchtitan.models.common.attention import GQAttention
from torchtitan.protocols.module import Module

from titan_upipe.attention.keep import KeptAttention
from titan_upipe.attention.model_protocol import MODEL_CLASSES, ModelClasses, ModelFamily
from titan_upipe.attention.module import ContextParallelAttention
from titan_upipe.attention.projection import RotaryKind
from titan_upipe.errors import ConfigError
from titan_upipe.transforms.rope import inverse_frequencies, local_rope_inputs
from titan_upipe.tsp.modules import TSPAttention

Tensor = torch.Tensor

ROPE_KINDS = {ComplexRoPE: RotaryKind.COMPLEX, CosSinRoPE: RotaryKind.COS_SIN}


class CompactRoPE:
    """A 0.3 RoPE whose ``cache`` holds the fp32 inverse frequencies ``[D/2]`` only (``fused_rope``): the
    attention builds the rows of its batch's positions each forward (``transforms.rope``), never a
    full-length table per layer. Mixed into 0.3's RoPE classes, so that 0.3's init (``init_states``
    recomputes ``cache`` through ``_precompute_cache``) builds the compact form."""

    def _precompute_cache(self) -> Tensor:
        cfg = self.config
        if cfg.scaling not in ("none", "llama"):
            raise ConfigError(f"fused_rope computes RoPE rows with no scaling or Llama 3.1's; this RoPE's scaling is "
                              f"{cfg.scaling!r}: drop fused_rope")
        scaling = cfg if cfg.scaling == "llama" else None  # its fields are Llama 3.1's scaling arguments
        return inverse_frequencies(self.kind, cfg.dim, cfg.theta, scaling)


class CompactComplexRoPE(CompactRoPE, ComplexRoPE):
    kind = RotaryKind.COMPLEX


class CompactCosSinRoPE(CompactRoPE, CosSinRoPE):
    kind = RotaryKind.COS_SIN


COMPACT_ROPE = {ComplexRoPE: CompactComplexRoPE, CosSinRoPE: CompactCosSinRoPE}


def compact_rope(rope: nn.Module) -> nn.Module:
    """``rope`` switched to its compact class (its config and FQN unchanged; the buffer is rebuilt at init)."""
    rope.__class__ = COMPACT_ROPE[type(rope)]
    return rope


class GQASignature:
    """0.3's attention forward signature over the core's: the RoPE table is the module's own
    ``rope.cache`` (``[S, D/2]`` complex or ``[S, 2D]`` cos||sin, for the global positions), or, with
    a compact RoPE, the rows of this call's positions built from its inverse frequencies. Mixed in
    before a core attention class (``ContextParallelAttention``, ``TSPAttention``)."""

    def forward(self, x: Tensor, attention_masks: object, positions: Tensor | None = None,
                kept: KeptAttention | None = None) -> Tensor:
        if isinstance(self.rope, CompactRoPE):
            positions = positions if positions is not None else self._local_positions(x, None)
            table, rows = local_rope_inputs(self.rope.cache, self.spec.rotary, x[..., 0], positions)  # [B, L]
            return super().forward(x, table, attention_masks, rows, kept)
        return super().forward(x, self.rope.cache, attention_masks, positions, kept)


class ContextParallelGQAttention(GQASignature, ContextParallelAttention, Module):
    """The core's CP attention (Ulysses, UPipe, ring, USP) with 0.3's forward signature (``GQASignature``)."""


class TSPGQAttention(GQASignature, TSPAttention, Module):
    """The core's TSP attention with 0.3's forward signature (``GQASignature``); its projections are
    DTensors sharded over the TSP ranks, found at ``qkv_linear.wq``, ... (``DECODERS.projection_paths``)."""


def rotary_of(attention: nn.Module) -> RotaryKind:
    rope = type(attention.rope)
    kind = next((kind for cls, kind in ROPE_KINDS.items() if issubclass(rope, cls)), None)
    if kind is None:
        raise ConfigError(f"context-parallel attention runs RoPE of kinds {', '.join(c.__name__ for c in ROPE_KINDS)}; "
                          f"this attention's is {rope.__name__}")
    return kind


def attention_scale(attention: nn.Module) -> float:
    # ``scaling`` is None where the head dim is dim / heads: SDPA's default, 1/sqrt(D).
    return attention.scaling if attention.scaling is not None else attention.head_dim**-0.5


DECODERS = ModelFamily(
    name="Llama3 and Qwen3 (TorchTitan 0.3)", model=Decoder, block=TransformerBlock, attention=GQAttention,
    feed_forward=FeedForward, rotary=rotary_of, attention_scale=attention_scale,
    projection_paths=("qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv", "wo"), kept_children=("rope",),
    converted_attention=ContextParallelGQAttention, converted_tsp_attention=TSPGQAttention)


def register_model_classes(classes: ModelClasses = MODEL_CLASSES) -> None:
    """Register 0.3's decoders with the core (again: nothing changes)."""
    classes.register(DECODERS)

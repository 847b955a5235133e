"""The model surgery behind the ``tiled_mlp``, ``tiled_rmsnorm`` and ``fused_ce`` converters.

Each function swaps modules of a TorchTitan Llama3/Qwen3 model in place and keeps the
parameters it touches (same objects, names and init), so checkpoints and FSDP grouping are
unchanged; they compose with each other and with the context-parallel attention in any
order. The TorchTitan converter classes that call them live in ``titan_upipe.torchtitan_0_2.converters``.
"""

from __future__ import annotations

from torch import nn

from titan_upipe.errors import ConfigError
from titan_upipe.transforms.fused_ce import FusedCrossEntropyHead, resolve_backend
from titan_upipe.transforms.model_forward import enable_fused_cross_entropy
from titan_upipe.transforms.tiled_mlp import TiledFeedForward, is_swiglu_feed_forward
from titan_upipe.transforms.tiled_rmsnorm import TiledRMSNorm


def tile_feed_forwards(model: nn.Module, tile_tokens: int) -> int:
    count = 0
    for block in model.layers.values():
        if is_swiglu_feed_forward(getattr(block, "feed_forward", None)):
            block.feed_forward = TiledFeedForward(block.feed_forward, tile_tokens)
            count += 1
    if count == 0:
        raise ConfigError("tiled_mlp found no Llama3/Qwen3 SwiGLU feed_forward in model.layers "
                          "(MoE blocks are not tiled): remove tiled_mlp from model.converters")
    return count


def tile_rms_norms(model: nn.Module, tile_tokens: int, norm_class: type[nn.RMSNorm] = nn.RMSNorm,
                   tiled=TiledRMSNorm) -> int:
    """The d_model-wide norms: each block's ``attention_norm``/``ffn_norm`` and the final ``norm``
    (per-head q/k norms stay inside the attention), those of class ``norm_class`` exactly, each replaced
    by ``tiled(norm, tile_tokens)`` (TorchTitan 0.3's norm, a subclass that its init reaches, has its own:
    ``torchtitan_0_3.transforms``)."""
    owners = [(block, name) for block in model.layers.values() for name in ("attention_norm", "ffn_norm")]
    owners.append((model, "norm"))
    count = 0
    for owner, name in owners:
        norm = getattr(owner, name, None)
        if type(norm) is norm_class:
            setattr(owner, name, tiled(norm, tile_tokens))
            count += 1
    if count == 0:
        raise ConfigError("tiled_rmsnorm found no nn.RMSNorm to tile: remove it from model.converters")
    return count


def fuse_cross_entropy(model: nn.Module, chunk_tokens: int, backend: str) -> None:
    if model.output is None:
        raise ConfigError("fused_ce needs the model's output projection")
    model.output = FusedCrossEntropyHead(model.output, chunk_tokens, resolve_backend(backend))
    enable_fused_cross_entropy(model)

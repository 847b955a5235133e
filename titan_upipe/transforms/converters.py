"""Model converters ``tiled_mlp``, ``tiled_rmsnorm``, ``fused_rope``, ``fused_ce``.

TorchTitan applies converters in ``model.converters`` order on the meta device, before
``parallelize_fn`` and ``init_weights``. Each converter keeps the parameters it touches (same
objects, names and init), so checkpoints and FSDP grouping are unchanged, and composes with
the others and with the context-parallel attention converters in any order.
"""

from __future__ import annotations

from torch import nn
from torchtitan.tools.logging import logger

from titan_upipe.config import ConfigError, Transforms
from titan_upipe.transforms.fused_ce import FusedCrossEntropyHead, resolve_backend
from titan_upipe.transforms.model_forward import enable_fused_cross_entropy, enable_fused_rope
from titan_upipe.transforms.tiled_mlp import TiledFeedForward, is_swiglu_feed_forward
from titan_upipe.transforms.tiled_rmsnorm import TiledRMSNorm


def _settings(job_config) -> Transforms:
    return getattr(job_config, "transforms", None) or Transforms()


class _Converter:
    def __init__(self, job_config, parallel_dims) -> None:
        self.settings = _settings(job_config)

    def post_optimizer_hook(self, model) -> None:
        pass


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


def tile_rms_norms(model: nn.Module, tile_tokens: int) -> int:
    """The d_model-wide norms: each block's ``attention_norm``/``ffn_norm`` and the final ``norm``
    (per-head q/k norms stay inside the attention)."""
    owners = [(block, name) for block in model.layers.values() for name in ("attention_norm", "ffn_norm")]
    owners.append((model, "norm"))
    count = 0
    for owner, name in owners:
        norm = getattr(owner, name, None)
        if type(norm) is nn.RMSNorm:
            setattr(owner, name, TiledRMSNorm(norm, tile_tokens))
            count += 1
    if count == 0:
        raise ConfigError("tiled_rmsnorm found no nn.RMSNorm to tile: remove it from model.converters")
    return count


class TiledMLPConverter(_Converter):
    def convert(self, model: nn.Module) -> None:
        n = tile_feed_forwards(model, self.settings.mlp_tile_tokens)
        logger.info("tiled_mlp: %d feed-forwards, tile %s tokens", n, self.settings.mlp_tile_tokens or "d_model")


class TiledRMSNormConverter(_Converter):
    def convert(self, model: nn.Module) -> None:
        n = tile_rms_norms(model, self.settings.rmsnorm_tile_tokens)
        logger.info("tiled_rmsnorm: %d norms, tile %s tokens", n, self.settings.rmsnorm_tile_tokens or "d_model")


class FusedRoPEConverter(_Converter):
    def convert(self, model: nn.Module) -> None:
        enable_fused_rope(model)
        logger.info("fused_rope: RoPE rows computed per batch for its positions; no full-length table")


def fuse_cross_entropy(model: nn.Module, chunk_tokens: int, backend: str) -> None:
    if model.output is None:
        raise ConfigError("fused_ce needs the model's output projection")
    model.output = FusedCrossEntropyHead(model.output, chunk_tokens, resolve_backend(backend))
    enable_fused_cross_entropy(model)


class FusedCrossEntropyConverter(_Converter):
    def convert(self, model: nn.Module) -> None:
        fuse_cross_entropy(model, self.settings.ce_chunk_tokens, self.settings.ce_backend)
        logger.info("fused_ce: %s backend, no [S, vocab] logits", model.output.backend)


CONVERTERS = {
    "tiled_mlp": TiledMLPConverter,
    "tiled_rmsnorm": TiledRMSNormConverter,
    "fused_rope": FusedRoPEConverter,
    "fused_ce": FusedCrossEntropyConverter,
}

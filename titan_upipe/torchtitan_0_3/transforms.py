"""The memory transforms and offloaded checkpointing on TorchTitan 0.3 (``model.converters`` and
``[activation_checkpoint]``), applied by ``parallelize`` on the meta-device model, before 0.3's
``init_states``:

================== ===========================================================================
setting            on 0.3
================== ===========================================================================
``tiled_mlp``      the core's ``TiledFeedForward`` (it keeps 0.3's ``w1``/``w2``/``w3`` modules,
                   whose init 0.3 runs)
``tiled_rmsnorm``  0.3's ``RMSNorm`` with the tiled forward (:class:`TiledTitanRMSNorm`: a subclass,
                   so 0.3's init still reaches its weight)
``fused_rope``     in-place RoPE in the CP attention (no fp32 copy of Q/K), and each attention's
                   ``rope`` compact (``model_classes.CompactRoPE``: its inverse frequencies, the
                   rows of the batch's positions built per forward), where 0.3 holds a
                   full-length table per layer
``fused_ce``       0.3's ``ChunkedLossWrapper`` (``lm_head`` and the loss one chunk of tokens at a
                   time: no ``[S, vocab]`` logits), chunks of ``ce_chunk_tokens`` (0: the core's
                   default size); its cross-entropy is torch's (``ce_backend = "liger"`` refused)
``cpu_offload``    the core's offloaded checkpointing of every block (``transforms.offload``), in
                   place of 0.3's AC wrapper; ``keep_attention`` where the recipe states the blocks
================== ===========================================================================
"""

from __future__ import annotations

import logging
import math

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.models.common import RMSNorm

from titan_upipe.errors import ConfigError
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.spec.keep_attention import NO_KEEP
from titan_upipe.torchtitan_0_3.model_classes import compact_rope
from titan_upipe.transforms.fused_ce import default_chunk_tokens
from titan_upipe.transforms.offload import apply_offloaded_ac
from titan_upipe.transforms.surgery import tile_feed_forwards, tile_rms_norms
from titan_upipe.transforms.tiled_rmsnorm import TiledRMSNormFunction

logger = logging.getLogger()


class TiledTitanRMSNorm(RMSNorm):
    """0.3's ``RMSNorm`` computed over tiles of ``tile_tokens`` tokens (0: d_model); the class a
    norm is switched to, so its parameter, state dict and 0.3 init are the norm's own."""

    tile_tokens: int = 0

    def forward(self, x):
        return TiledRMSNormFunction.apply(x, self.weight, self.eps, self.tile_tokens or x.shape[-1])


def tiled_titan_norm(norm: RMSNorm, tile_tokens: int) -> RMSNorm:
    norm.__class__ = TiledTitanRMSNorm
    norm.tile_tokens = tile_tokens
    return norm


def apply_transforms(model, spec: JobSpec) -> None:
    """``tiled_mlp``, ``tiled_rmsnorm`` and ``fused_rope`` of ``spec`` on ``model`` (0.3's decoder)."""
    if spec.tiled_mlp:
        n = tile_feed_forwards(model, spec.mlp_tile_tokens)
        logger.info("tiled_mlp: %d feed-forwards, tile %s tokens", n, spec.mlp_tile_tokens or "d_model")
    if spec.tiled_rmsnorm:
        n = tile_rms_norms(model, spec.rmsnorm_tile_tokens, RMSNorm, tiled_titan_norm)
        logger.info("tiled_rmsnorm: %d norms, tile %s tokens", n, spec.rmsnorm_tile_tokens or "d_model")
    if spec.fused_rope:  # a CP attention in every block (job.check_hosted)
        for block in model.layers.values():
            block.attention.in_place_rope = True
            compact_rope(block.attention.rope)
        logger.info("fused_rope: Q/K rotated in place, RoPE rows built per batch for its positions (no full-length "
                    "table) in %d attentions", len(model.layers))


def apply_checkpointing(model, spec: JobSpec, ac_config, dump_folder: str) -> None:
    """Offloaded checkpointing of every block where ``cpu_offload`` is set, else 0.3's AC policy."""
    if spec.cpu_offload:  # with full AC (job.check_hosted)
        keep = spec.keep_plan or NO_KEEP
        apply_offloaded_ac(model, spec.pin_memory, spec.prefetch_after_attention, spec.resident_blocks, keep)
        logger.info("offloaded checkpointing: %d blocks, inputs to host memory (pinned: %s), %s", len(model.layers),
                    spec.pin_memory, keep.describe(len(model.layers)))
    elif ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)


def loss_config(spec: JobSpec, validation_seq_len: int = 0):
    """The loss of the job: 0.3's cross-entropy over the whole logits, or chunked under ``fused_ce``.

    0.3's ``ChunkedLossWrapper`` splits each row's ``S/C`` tokens into ``num_chunks`` equal parts: the
    count is the smallest that divides the training's and the validation's ``S/C`` with chunks of at
    most ``ce_chunk_tokens`` tokens (0: the core's default size)."""
    if not spec.fused_ce:
        return CrossEntropyLoss.Config()
    if spec.ce_backend == "liger":
        raise ConfigError("transforms.ce_backend = 'liger' is not run on TorchTitan 0.3 (fused_ce there is its chunked "
                          "loss, with torch's cross-entropy): valid values on 0.3 are auto, torch")
    cp = max(spec.layout.cp_degree, 1)
    row = spec.seq_len // cp
    rows = math.gcd(row, (validation_seq_len or spec.seq_len) // cp)
    chunk = spec.ce_chunk_tokens or default_chunk_tokens(spec.local_batch * row, spec.model.dim, spec.model.vocab)
    least = max(1, math.ceil(spec.local_batch * row / chunk))
    chunks = next(n for n in range(least, rows + 1) if rows % n == 0) if least <= rows else rows
    logger.info("fused_ce: TorchTitan 0.3's chunked loss, %d chunks of %d tokens (no [S, vocab] logits)", chunks,
                spec.local_batch * row // chunks)
    return ChunkedLossWrapper.Config(num_chunks=chunks)

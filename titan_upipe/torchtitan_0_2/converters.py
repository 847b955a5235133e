"""The plugin's TorchTitan model converters (``model.converters``).

* ``ulysses``, ``upipe``, ``ring``, ``usp``: context-parallel attention in every block; ``tsp``:
  attention and feed-forward of every block with their weights sharded over the CP ranks. The mesh
  and the layout come from the launch's one ``LaunchedJob`` (``launched_job``: the spec's ``CPLayout``
  and the CP mesh built from it once, which the trainer and the validation loss read too); U and the
  kernel come from ``[upipe]`` (``attention_backend = "auto"`` is resolved here, once, and
  logged with the reasons faster kernels were passed over).
* ``tiled_mlp``, ``tiled_rmsnorm``, ``fused_rope``, ``fused_ce``: the memory transforms
  (``titan_upipe.transforms``), sized by ``[transforms]``.

TorchTitan applies converters in ``model.converters`` order on the meta device, before
``parallelize_fn`` and ``init_weights``. Every converter keeps the parameters it touches (same
objects, names and init), so FSDP, checkpoints and weight initialisation see the unconverted
parameter names, and they compose in any order.
"""

from __future__ import annotations

import torch.nn as nn
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger

from titan_upipe.attention.module import convert_attention_of_blocks
from titan_upipe.parallel.inputs import LayoutCheck
from titan_upipe.spec.cp_layout import CPMode
from titan_upipe.torchtitan_0_2.checks import attention_backend_choice, compute_dtype
from titan_upipe.torchtitan_0_2.config import (
    Transforms,
    plugin_fields,
)
from titan_upipe.torchtitan_0_2.launched_job import launched_job
from titan_upipe.transforms import TRANSFORM_NAMES
from titan_upipe.transforms.model_forward import enable_fused_rope
from titan_upipe.transforms.surgery import fuse_cross_entropy, tile_feed_forwards, tile_rms_norms
from titan_upipe.tsp.modules import convert_block


class _ContextParallelAttentionConverter:
    mode: CPMode

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
        # The launch's one job (TorchTitan hands a converter nothing but these two): its spec's
        # layout (mesh shape and U, never re-derived) and the CP mesh, built once for the whole launch.
        job = launched_job(job_config, parallel_dims)
        self.spec, self.layout = job.spec, job.spec.layout
        self.cp_mesh = job.required_cp_mesh()
        # Resolved once here (auto included): every block gets the same kernel.
        self.compute_dtype = compute_dtype(job_config)
        self.backend_choice = attention_backend_choice(job_config, layout=self.layout)

    def convert(self, model: nn.Module) -> None:
        # fused_rope may have run first (converters apply in model.converters order).
        in_place_rope = getattr(model, "fused_rope_kind", None) is not None
        blocks = list(model.layers.values())
        converted = convert_attention_of_blocks(
            [block.attention for block in blocks], self.mode, self.cp_mesh, self.layout.heads_per_stage,
            self.backend_choice.name, in_place_rope=in_place_rope, compute_dtype=self.compute_dtype)
        for block, attention in zip(blocks, converted, strict=True):
            block.attention = attention
        model.register_forward_pre_hook(LayoutCheck(self.cp_mesh), with_kwargs=True)
        logger.info("Converted attention to %s over a CP mesh of %d ranks (%s), %s", self.mode, self.cp_mesh.size(),
                    dict(zip(self.cp_mesh.mesh_dim_names or (), self.cp_mesh.shape, strict=True)),
                    self.backend_choice.describe())

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        pass


class UlyssesConverter(_ContextParallelAttentionConverter):
    mode = CPMode.ULYSSES


class UPipeConverter(_ContextParallelAttentionConverter):
    mode = CPMode.UPIPE


class RingConverter(_ContextParallelAttentionConverter):
    mode = CPMode.RING


class USPConverter(_ContextParallelAttentionConverter):
    mode = CPMode.USP


class TSPConverter(_ContextParallelAttentionConverter):
    """``tsp``: every block's attention and feed-forward become TSP modules over the CP ranks,
    their weights DTensors sharded over them (``titan_upipe.tsp.modules``); the rest of the model
    stays for FSDP (``parallelize`` leaves the sharded weights out of it)."""

    mode = CPMode.TSP

    def convert(self, model: nn.Module) -> None:
        spec = self.spec
        for block in model.layers.values():
            convert_block(block, self.cp_mesh, self.backend_choice.name, spec.tsp_kv_heads_per_bucket,
                          self.compute_dtype, spec.tsp_overlap, spec.tsp_mlp_recompute)
        model.register_forward_pre_hook(LayoutCheck(self.cp_mesh), with_kwargs=True)
        logger.info("Converted attention and feed-forward to TSP over %d ranks (weights sharded over them; K/V "
                    "all-gathers of %s KV heads; overlap %s), %s", self.cp_mesh.size(),
                    spec.tsp_kv_heads_per_bucket or "all local", "on" if spec.tsp_overlap else "off",
                    self.backend_choice.describe())


class _TransformConverter:
    def __init__(self, job_config, parallel_dims) -> None:
        self.settings = plugin_fields(getattr(job_config, "transforms", None), Transforms)

    def post_optimizer_hook(self, model) -> None:
        pass


class TiledMLPConverter(_TransformConverter):
    def convert(self, model: nn.Module) -> None:
        n = tile_feed_forwards(model, self.settings.mlp_tile_tokens)
        logger.info("tiled_mlp: %d feed-forwards, tile %s tokens", n, self.settings.mlp_tile_tokens or "d_model")


class TiledRMSNormConverter(_TransformConverter):
    def convert(self, model: nn.Module) -> None:
        n = tile_rms_norms(model, self.settings.rmsnorm_tile_tokens)
        logger.info("tiled_rmsnorm: %d norms, tile %s tokens", n, self.settings.rmsnorm_tile_tokens or "d_model")


class FusedRoPEConverter(_TransformConverter):
    def convert(self, model: nn.Module) -> None:
        enable_fused_rope(model)
        logger.info("fused_rope: RoPE rows computed per batch for its positions; no full-length table")


class FusedCrossEntropyConverter(_TransformConverter):
    def convert(self, model: nn.Module) -> None:
        fuse_cross_entropy(model, self.settings.ce_chunk_tokens, self.settings.ce_backend)
        logger.info("fused_ce: %s backend, no [S, vocab] logits", model.output.backend)


CP_CONVERTERS = {cls.mode.value: cls for cls in (UlyssesConverter, UPipeConverter, RingConverter, USPConverter,
                                                 TSPConverter)}
TRANSFORM_CONVERTERS = dict(zip(TRANSFORM_NAMES, (TiledMLPConverter, TiledRMSNormConverter, FusedRoPEConverter,
                                                  FusedCrossEntropyConverter), strict=True))
CONVERTERS = {**CP_CONVERTERS, **TRANSFORM_CONVERTERS}
"""Every converter this plugin registers with TorchTitan, by name."""

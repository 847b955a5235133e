"""The plugin's ``parallelize_fn`` on TorchTitan 0.3: context-parallel attention, then 0.3's own AC and FSDP.

0.3 calls ``ModelSpec.parallelize_fn(model, *, parallel_dims, training, parallelism,
compile_config, ac_config, dump_folder)`` on the meta-device model, after its Module-protocol
check and before ``init_states``; the launch binds ``launch`` (the job's spec and CP mesh,
``trainer.Launch``) with a ``partial``. Order:

1. **CP attention** (``ulysses``, ``upipe``, ``ring``, ``usp``): every block's ``GQAttention``
   becomes ``model_classes.ContextParallelGQAttention`` over the launch's CP mesh (the same
   parameters and names), and a forward pre-hook checks the inputs arrive in its layout
   (``parallel.inputs.LayoutCheck``). Unlike 0.3's own CP (a K/V all-gather around the inner
   attention), nothing of TorchTitan's CP runs. **TSP** (``tsp``): every block's attention and
   feed-forward become TSP modules (``model_classes.TSPGQAttention``, ``tsp.modules.TSPFeedForward``),
   their weights DTensors sharded over the CP ranks.
2. **Transforms** (``transforms``): tiled MLP / RMSNorm, in-place RoPE.
3. **AC**: the core's offloaded checkpointing under ``cpu_offload``, else ``ac_config`` (0.3's FullAC /
   per-op SelectiveAC) wraps every block.
4. **FSDP** over ``dp_shard x cp`` (``fsdp``; with ``dp_replicate`` when set), 0.3's
   ``apply_fsdp_to_decoder``, which sums gradients (the loss is already divided by the global
   valid-token count). It has no way to leave parameters out, so a TSP job's model is wrapped by
   ``torchtitan_common.fsdp.shard_decoder`` instead, the TSP-sharded weights left out (their
   gradients are complete at their owners).
"""

from __future__ import annotations

import logging

from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

from titan_upipe.attention.module import convert_attention_of_blocks
from titan_upipe.parallel.inputs import LayoutCheck
from titan_upipe.spec.cp_layout import CPMode
from titan_upipe.torchtitan_0_3.transforms import apply_checkpointing, apply_transforms
from titan_upipe.torchtitan_common import cpu_runtime
from titan_upipe.torchtitan_common.fsdp import shard_decoder
from titan_upipe.tsp.modules import convert_block, tsp_sharded_parameters

logger = logging.getLogger()


def convert_cp_attention(model, launch) -> None:
    """Every block's attention as the launch's CP attention (``launch.spec.layout``: mode, U)."""
    layout = launch.spec.layout
    blocks = list(model.layers.values())
    converted = convert_attention_of_blocks([block.attention for block in blocks], layout.mode.value, launch.cp_mesh,
                                            layout.heads_per_stage, launch.spec.attention_backend,
                                            compute_dtype=launch.compute_dtype)
    for block, attention in zip(blocks, converted, strict=True):
        block.attention = attention
    model.register_forward_pre_hook(LayoutCheck(launch.cp_mesh), with_kwargs=True)
    logger.info("Converted attention to %s over a CP mesh of %d ranks (%s), backend %s", layout.mode.value,
                launch.cp_mesh.size(), dict(zip(launch.cp_mesh.mesh_dim_names or (), launch.cp_mesh.shape,
                                                strict=True)), converted[0].backend.name)


def convert_tsp_blocks(model, launch) -> None:
    """Every block's attention and feed-forward as TSP modules over the launch's 1-D ``ring`` mesh, their
    weights DTensors sharded over it (``tsp.modules.convert_block``)."""
    spec = launch.spec
    for block in model.layers.values():
        convert_block(block, launch.cp_mesh, spec.attention_backend, spec.tsp_kv_heads_per_bucket,
                      launch.compute_dtype, spec.tsp_overlap, spec.tsp_mlp_recompute)
    model.register_forward_pre_hook(LayoutCheck(launch.cp_mesh), with_kwargs=True)
    attention = next(iter(model.layers.values())).attention
    logger.info("Converted attention and feed-forward to TSP over %d ranks (weights sharded over them; K/V all-gathers "
                "of %s KV heads; overlap %s), backend %s", launch.cp_mesh.size(),
                spec.tsp_kv_heads_per_bucket or "all local", "on" if spec.tsp_overlap else "off", attention.backend.name)


def parallelize(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder, launch):
    """0.3's ``parallelize_fn`` for the plugin's jobs (module docstring)."""
    del compile_config  # compile.enable is refused before launch (job.check_torchtitan_settings)
    if launch.spec.mode is CPMode.TSP:
        convert_tsp_blocks(model, launch)
    elif launch.cp_mesh is not None:
        convert_cp_attention(model, launch)
    apply_transforms(model, launch.spec)
    apply_checkpointing(model, launch.spec, ac_config, dump_folder)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    mesh = parallel_dims.get_mesh(names)
    dtypes = {"param_dtype": TORCH_DTYPE_MAP[training.mixed_precision_param],
              "reduce_dtype": TORCH_DTYPE_MAP[training.mixed_precision_reduce]}
    tsp_weights = set(tsp_sharded_parameters(model))
    if tsp_weights:  # 0.3's apply_fsdp_to_decoder shards every parameter: TSP's are sharded already
        shard_decoder(model, mesh, [model.norm, model.lm_head], **dtypes, policy=parallelism.fsdp_reshard_after_forward,
                      ignored_params=tsp_weights)
        logger.info("Applied FSDP over %s (the CP ranks), every parameter but the %d TSP-sharded weights", names,
                    len(tsp_weights))
    else:
        apply_fsdp_to_decoder(model, mesh, **dtypes, pp_enabled=parallel_dims.pp_enabled,
                              cpu_offload=training.enable_cpu_offload,
                              reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward)
    if cpu_runtime.is_active():
        cpu_runtime.force_sum_reductions(model)  # gloo has no PREMUL_SUM: the same sums
    return model

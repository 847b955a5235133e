"""``parallelize_fn`` of the plugin's train specs: activation checkpointing (TorchTitan's, or full
checkpointing with host-offloaded block inputs), compile, FSDP.

Compile: TorchTitan's whole-block ``fullgraph`` compile for plain models; for models with
context-parallel attention or tiled transforms, each block's norms and feed-forward
(``compile_parts``), the attention and tiled modules eager.

Context parallelism is not applied here: the CP attention converters
(``model.converters``) have already replaced each block's attention before this
runs (TorchTitan converts on the meta device, then parallelizes). TorchTitan's
own CP hooks dispatch only CUDA SDPA kernels, so a CP degree without one of our
converters is rejected (``validation.check_job``) with the settings to use instead.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import (
    apply_compile,
    apply_fsdp,
    disable_fsdp_gradient_division,
)
from torchtitan.tools.logging import logger

from titan_upipe.torchtitan_0_2 import cpu_runtime
from titan_upipe.torchtitan_0_2.checks import check_job
from titan_upipe.torchtitan_0_2.compile_parts import compile_parts, needs_part_compile
from titan_upipe.torchtitan_0_2.config import (
    ActivationCheckpointOffload,
    ConfigError,
    plugin_fields,
)
from titan_upipe.transforms.offload import apply_offloaded_ac
from titan_upipe.tsp.modules import tsp_sharded_parameters


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    check_job(job_config, parallel_dims.world_size)

    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    ac_config = job_config.activation_checkpoint
    offload = plugin_fields(ac_config, ActivationCheckpointOffload)
    if offload.cpu_offload:  # mode "full", checked by check_job
        apply_offloaded_ac(model, pin_memory=ac_config.pin_memory,
                           prefetch_after_attention=offload.prefetch_after_attention,
                           resident_blocks=offload.resident_blocks)
        logger.info("Applied full activation checkpointing with block inputs offloaded to host memory")
    elif ac_config.mode != "none":
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model,
                 base_folder=job_config.job.dump_folder)
    if compile_model and needs_part_compile(model):  # CP attention or tiled transforms: no whole-block graph
        parts = compile_parts(model, job_config.compile.backend)
        logger.info("Compiled %d norms and feed-forwards with torch.compile; attention and tiled modules stay eager",
                    len(parts))
    elif compile_model:
        apply_compile(model, job_config.compile)

    tsp_weights = tsp_sharded_parameters(model)
    if parallel_dims.fsdp_enabled:
        if tsp_weights:
            apply_fsdp_beside_tsp(model, parallel_dims.get_mesh("fsdp"), job_config, set(tsp_weights))
            applied = f"the CP ranks, every parameter but the {len(tsp_weights)} TSP-sharded weights"
        else:
            names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
            apply_fsdp(
                model,
                parallel_dims.get_mesh(names),
                param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
                reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
                pp_enabled=False,
                cpu_offload=job_config.training.enable_cpu_offload,
                reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
            )
            applied = str(names)
        if cpu_runtime.is_active():
            cpu_runtime.force_sum_reductions(model)
        logger.info("Applied FSDP over %s", applied)
    elif parallel_dims.dp_replicate_enabled:
        raise ConfigError(
            "parallelism.data_parallel_replicate_degree > 1 without sharding (DDP) is not supported "
            "by titan_upipe: use parallelism.data_parallel_shard_degree (FSDP) instead"
        )
    return model


def apply_fsdp_beside_tsp(model: nn.Module, mesh, job_config: JobConfig, tsp_weights: set[nn.Parameter]) -> None:
    """FSDP as TorchTitan's ``apply_fsdp`` wraps a Llama3/Qwen3 model (embedding, each block, final
    norm + output, the root), over ``mesh``, with ``tsp_weights`` ignored at every level: they
    are already sharded over the CP ranks (DTensors on the TSP mesh) and their gradients are
    complete at their owners. The rest (embedding, norms, qk-norms, output), replicated over the
    CP ranks, is sharded and its gradients summed by FSDP as in every other mode. The TSP
    modules cast their fp32 weights to the activations' dtype themselves (FSDP's mixed precision
    does not see them) and return fp32 gradients."""
    policy = job_config.parallelism.fsdp_reshard_after_forward
    if policy not in ("default", "always", "never"):
        raise ConfigError(f"parallelism.fsdp_reshard_after_forward = {policy!r}: valid values are default, always, "
                          "never")
    reshard = policy != "never"
    config = {"mesh": mesh, "ignored_params": tsp_weights,
              "mp_policy": MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
                                                reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce])}
    fully_shard(model.tok_embeddings, **config, reshard_after_forward=reshard)
    for block in model.layers.values():
        fully_shard(block, **config, reshard_after_forward=reshard)
    fully_shard([model.norm, model.output], **config, reshard_after_forward=policy == "always")
    fully_shard(model, **config)
    disable_fsdp_gradient_division(model)

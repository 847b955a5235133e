"""``parallelize_fn`` of the plugin's train specs: activation checkpointing (TorchTitan's, or full
checkpointing with host-offloaded block inputs), compile, FSDP.

Compile: TorchTitan's whole-block ``fullgraph`` compile for plain models; for models with
context-parallel attention or tiled transforms, each block's norms and feed-forward
(``compile_parts``), the attention and tiled modules eager.

Context parallelism is not applied here: the CP attention converters
(``model.converters``) have already replaced each block's attention before this
runs (TorchTitan converts on the meta device, then parallelizes). TorchTitan's
own CP hooks dispatch only CUDA SDPA kernels, so a CP degree without one of our
converters is rejected by the job checks (``checks.check_job``: at launch, and again
here for ``-m torchtitan.train`` launches) with the settings to use instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torchtitan.config import TORCH_DTYPE_MAP, JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3.infra.parallelize import apply_compile
from torchtitan.tools.logging import logger

from titan_upipe.spec.keep_attention import KeepAttentionPlan
from titan_upipe.torchtitan_0_2.checks import check_job
from titan_upipe.torchtitan_0_2.checks.keep_attention import (
    keep_attention_plan,
    needs_planner,
    set_keep_attention_plan,
)
from titan_upipe.torchtitan_0_2.compile_parts import compile_parts, needs_part_compile
from titan_upipe.torchtitan_0_2.config import (
    ActivationCheckpointOffload,
    ConfigError,
    plugin_fields,
)
from titan_upipe.torchtitan_common import cpu_runtime
from titan_upipe.torchtitan_common.fsdp import shard_decoder
from titan_upipe.transforms.offload import apply_offloaded_ac
from titan_upipe.tsp.modules import tsp_sharded_parameters


def parallelize(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    check_job(job_config, parallel_dims.world_size)

    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    ac_config = job_config.activation_checkpoint
    offload = plugin_fields(ac_config, ActivationCheckpointOffload)
    if offload.cpu_offload:  # mode "full", checked by check_job
        keep = agreed_keep_plan(job_config)
        apply_offloaded_ac(model, pin_memory=ac_config.pin_memory,
                           prefetch_after_attention=offload.prefetch_after_attention,
                           resident_blocks=offload.resident_blocks, keep=keep)
        logger.info("Applied full activation checkpointing with block inputs offloaded to host memory; %s",
                    keep.describe(len(model.layers)))
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
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(model, parallel_dims.get_mesh(names), job_config, ignored_params=set(tsp_weights) or None)
        applied = str(names)
        if tsp_weights:
            applied += f" (the CP ranks), every parameter but the {len(tsp_weights)} TSP-sharded weights"
        if cpu_runtime.is_active():
            cpu_runtime.force_sum_reductions(model)
        logger.info("Applied FSDP over %s", applied)
    elif parallel_dims.dp_replicate_enabled:
        raise ConfigError(
            "parallelism.data_parallel_replicate_degree > 1 without sharding (DDP) is not supported "
            "by titan_upipe: use parallelism.data_parallel_shard_degree (FSDP) instead"
        )
    return model


def agreed_keep_plan(job_config) -> KeepAttentionPlan:
    """The job's kept-attention plan, the same on every rank. A planner-sized (``auto``) plan follows
    from each machine's memory, which nodes may report a few MB apart; a block that keeps skips
    communication its recomputation would run, so every rank must keep the same blocks: the
    smallest counts of all ranks (one all-reduce before any training)."""
    plan = keep_attention_plan(job_config)
    if not needs_planner(job_config) or not dist.is_initialized() or dist.get_world_size() == 1:
        return plan
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    counts = torch.tensor([plan.device_blocks, plan.host_blocks], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MIN)
    agreed = KeepAttentionPlan(int(counts[0]), int(counts[1]))
    if agreed != plan:
        logger.warning("keep_attention: this rank's memory fits %s; every rank keeps %s (the smallest plan)",
                       plan, agreed)
        set_keep_attention_plan(job_config, agreed)  # what TensorBoard's upipe/keep_attention then says
    return agreed


def apply_fsdp(model: nn.Module, mesh, job_config: JobConfig,
               ignored_params: set[nn.Parameter] | None = None) -> None:
    """FSDP2 over ``mesh`` as TorchTitan's ``apply_fsdp`` wraps a Llama3/Qwen3 model
    (``torchtitan_common.fsdp.shard_decoder``): the embedding,
    each block, the final norm with the output (resharded after forward only with policy
    ``always``), the root; ``training.mixed_precision_*`` dtypes, ``training.enable_cpu_offload``,
    ``parallelism.fsdp_reshard_after_forward`` (no pipeline parallelism: ``default`` reshards).

    Two differences. ``ignored_params`` (TSP's weights) are left out at every level: they are
    already sharded over the CP ranks (DTensors on the TSP mesh), their gradients complete at
    their owners; the TSP modules cast them to the activations' dtype themselves and return fp32
    gradients. And the blocks do not cast their forward inputs to the parameter dtype
    (``cast_forward_inputs=False``): their floating-point inputs are the residual stream, already
    in that dtype (the embedding ran with cast parameters), and the RoPE table, which FSDP would
    copy per block: Qwen3's fp32 ``cos||sin`` ``[S, 2D]`` (with ``fused_rope`` this rank's rows
    ``[T, 2D]``), every copy kept to the block's backward under offloaded full AC (``L T 4D``
    bytes, ~10 GiB per rank for Qwen3-32B at 2.5M tokens on 8 ranks). Every RoPE consumer rounds
    cos/sin to the activations' dtype itself (TorchTitan's ``apply_rotary_emb``,
    ``projection.rotate``/``rotate_``) and rounding commutes with selecting rows, so the result is
    bit for bit the cast's. Llama3's complex64 ``freqs_cis`` is never cast (not floating point)."""
    policy = job_config.parallelism.fsdp_reshard_after_forward
    if policy not in ("default", "always", "never"):
        raise ConfigError(f"parallelism.fsdp_reshard_after_forward = {policy!r}: valid values are default, always, "
                          "never")
    shard_decoder(model, mesh, [model.norm, model.output],
                  param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
                  reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce], policy=policy,
                  cpu_offload=job_config.training.enable_cpu_offload, ignored_params=ignored_params)

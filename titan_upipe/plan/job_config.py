"""A parsed TorchTitan JobConfig as a PlanInput: the flavor's dimensions and mask type (packed
documents with ``attn_mask_type = "block_causal"``), the CP converter and degrees, the memory
transforms, activation checkpointing and the dtypes."""

from __future__ import annotations

from titan_upipe.parallel.cp_layout import cp_mode
from titan_upipe.plan.dims import model_dims_from_args
from titan_upipe.plan.job import PlanInput
from titan_upipe.plan.result import MemoryPlan
from titan_upipe.plan.step import plan
from titan_upipe.torchtitan_0_2.config import (
    ActivationCheckpointOffload,
    OptimizerHostState,
    plugin_fields,
)
from titan_upipe.torchtitan_0_2.flavors import flavor_args, packs_documents

PLAN_AUTO_BACKEND = "flash_attn4"
"""What ``attention_backend = "auto"`` resolves to on the GPUs the recipes target (Hopper with
the ``[gpu]`` extra, which installs flash-attn-4); the planner predicts another machine, so it
cannot probe what is installed there."""


def _dtype_bytes(name: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[name]


def plan_input_from_job_config(job_config, world_size: int | None = None, device: str | None = None) -> PlanInput:
    """PlanInput of a parsed TorchTitan JobConfig (``titan_upipe.torchtitan_0_2.config_parse.parse_config``)."""
    model_args = flavor_args(job_config, update=False)
    dims = model_dims_from_args(f"{job_config.model.name}:{job_config.model.flavor}", model_args)
    converters = list(job_config.model.converters)
    par = job_config.parallelism
    cp = par.context_parallel_degree
    mode = cp_mode(converters) or "none"
    upipe = job_config.upipe
    if world_size is None:
        shard = par.data_parallel_shard_degree
        world_size = (shard if shard > 0 else 1) * cp * par.data_parallel_replicate_degree
    param_dtype = job_config.training.mixed_precision_param
    if device is None:
        device = "cpu" if param_dtype == "float32" else "cuda"
    transforms = job_config.transforms
    ac = job_config.activation_checkpoint
    offload = plugin_fields(ac, ActivationCheckpointOffload)
    tsp = job_config.tsp
    backend = transforms.ce_backend
    if backend == "auto":
        backend = "liger" if device == "cuda" else "torch"
    ac_mode = ac.mode
    option = str(ac.selective_ac_option).strip()
    if ac_mode == "selective" and (option == "op" or option.isdigit() and int(option) <= 1):
        # op-level AC without a save list (the plugin's parallelize passes none) or every block
        # checkpointed: full AC, measured to the byte (docs/benchmarks/selective_ac.md)
        ac_mode = "full"
    if ac_mode not in ("none", "full"):
        raise ValueError(f"activation_checkpoint.mode = {ac.mode!r} (selective_ac_option = {option!r}): the planner "
                         "models 'none', 'full' and the selective settings that are full AC ('op', '1'); for "
                         "selective layer AC see docs/benchmarks/selective_ac.md")
    return PlanInput(
        model=dims, seq_len=job_config.training.seq_len, batch=job_config.training.local_batch_size, cp=cp,
        ulysses=upipe.ulysses_degree, mode=mode, heads_per_stage=upipe.heads_per_stage or None,
        world_size=world_size, param_bytes=_dtype_bytes(param_dtype),
        reduce_bytes=_dtype_bytes(job_config.training.mixed_precision_reduce),
        tiled_mlp="tiled_mlp" in converters, tiled_rmsnorm="tiled_rmsnorm" in converters,
        fused_rope="fused_rope" in converters, fused_ce="fused_ce" in converters,
        mlp_tile_tokens=transforms.mlp_tile_tokens, rmsnorm_tile_tokens=transforms.rmsnorm_tile_tokens,
        ce_chunk_tokens=transforms.ce_chunk_tokens, ce_backend=backend, ac_mode=ac_mode,
        attention_backend=PLAN_AUTO_BACKEND if upipe.attention_backend == "auto" else upipe.attention_backend,
        cpu_offload=bool(offload.cpu_offload), pin_memory=bool(offload.pin_memory),
        prefetch_after_attention=bool(offload.prefetch_after_attention), resident_blocks=int(offload.resident_blocks),
        device=device, documents=packs_documents(model_args), document_balance=upipe.document_balance,
        optimizer_state_on_host=bool(plugin_fields(job_config.optimizer, OptimizerHostState).state_on_host),
        tsp_kv_heads_per_bucket=tsp.kv_heads_per_bucket, tsp_overlap=tsp.overlap, tsp_mlp_recompute=tsp.mlp_recompute,
    )


def plan_from_job_config(job_config, world_size: int | None = None, device: str | None = None) -> MemoryPlan:
    return plan(plan_input_from_job_config(job_config, world_size, device))

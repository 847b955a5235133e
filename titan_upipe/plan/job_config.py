"""A parsed TorchTitan JobConfig as a PlanInput: the flavor's dimensions and mask type (packed
documents with ``attn_mask_type = "block_causal"``), the CP converter and degrees, the memory
transforms, activation checkpointing and the dtypes."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from titan_upipe.attention.keep import NO_KEEP, KeepAttentionPlan
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.cp_layout import cp_mode
from titan_upipe.plan.dims import model_dims_from_args
from titan_upipe.plan.job import PlanInput
from titan_upipe.plan.result import MemoryPlan
from titan_upipe.plan.search import size_keep_attention
from titan_upipe.plan.step import plan
from titan_upipe.torchtitan_0_2.checks.keep_attention import (
    keep_attention_plan,
    keep_setting,
    known_keep_attention_plan,
    needs_planner,
    set_keep_attention_plan,
)
from titan_upipe.torchtitan_0_2.config import (
    ActivationCheckpointOffload,
    OptimizerHostState,
    plugin_fields,
)
from titan_upipe.torchtitan_0_2.flavors import flavor_args, packs_documents
from titan_upipe.torchtitan_0_2.job_assets.model_state import CHECKPOINT_BYTES_PER_PARAMETER

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
    keep = known_keep_attention_plan(job_config) or NO_KEEP  # an unsized auto: planned without, sized by the caller
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
        keep_device_blocks=keep.device_blocks, keep_host_blocks=keep.host_blocks,
    )


def plan_from_job_config(job_config, world_size: int | None = None, device: str | None = None) -> MemoryPlan:
    return plan(plan_input_from_job_config(job_config, world_size, device))


def async_checkpoint_staging_bytes(job_config, job: PlanInput) -> int:
    """Host bytes one node's async checkpoint stages: each rank's shard of what a checkpoint holds
    (fp32 parameters and both AdamW moments, ``CHECKPOINT_BYTES_PER_PARAMETER``); 0 without one."""
    checkpoint = job_config.checkpoint
    if not checkpoint.enable or checkpoint.async_mode == "disabled":
        return 0
    shard = CHECKPOINT_BYTES_PER_PARAMETER * job.model.total_params // job.fsdp
    return shard * min(job.ranks, job.gpus_per_node)


HOST_RESERVE_FRACTION = 0.1
"""Of a node's host memory, what sizing ``keep_attention = "auto"`` leaves to everything the planner
does not count (the processes, the data loader, the page cache)."""


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
"""Where a container's memory limit is (cgroup v2, v1): a job may use no more of the node than that."""


def cgroup_memory_limit() -> float:
    """This process's container memory limit in bytes (``inf`` where there is none)."""
    for path in CGROUP_LIMITS:
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit():
            return float(text)
    return float("inf")


def keep_host_budget(host_mem_bytes: float | None, staging_bytes: int = 0) -> float | None:
    """The host memory of a node that kept attention may fill with the offloaded inputs: all of it
    less ``HOST_RESERVE_FRACTION`` and an async checkpoint's staging (None: not limited)."""
    return None if host_mem_bytes is None else host_mem_bytes * (1 - HOST_RESERVE_FRACTION) - staging_bytes


@dataclass(frozen=True)
class MachineMemory:
    """What the job's ranks have: device memory per rank, host memory per node, ranks per node."""

    gpu_bytes: float
    host_bytes: float
    ranks_per_node: int
    device: str
    """``cuda``, or ``cpu`` (then the "device" is host memory shared by the node's ranks)."""

    @classmethod
    def here(cls, world_size: int) -> MachineMemory:
        """This machine's: the CUDA device of ``LOCAL_RANK`` (its total memory: every GPU of a job is
        taken to be alike) or, without one, the host's memory split over the node's ranks."""
        host = float(min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), cgroup_memory_limit()))
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        if torch.cuda.is_available():
            index = int(os.environ.get("LOCAL_RANK", "0"))
            return cls(float(torch.cuda.get_device_properties(index).total_memory), host, ranks, "cuda")
        return cls(host / max(ranks, 1), host, ranks, "cpu")


def size_keep_attention_of_job(job_config, world_size: int, machine: MachineMemory | None = None
                               ) -> KeepAttentionPlan:
    """The job's kept-attention plan: the config's own, or ``auto`` sized by the planner for
    ``machine`` (default: this one) and left on the job config for ``parallelize``
    (``checks.keep_attention``). The tools' entry points call it before any process group."""
    if not needs_planner(job_config):
        return keep_attention_plan(job_config)
    machine = machine or MachineMemory.here(world_size)
    where, blocks = keep_setting(job_config)
    try:
        job = replace(plan_input_from_job_config(job_config, world_size, machine.device),
                      gpus_per_node=machine.ranks_per_node)
        host = keep_host_budget(machine.host_bytes, async_checkpoint_staging_bytes(job_config, job))
        sized = size_keep_attention(job, where, blocks, machine.gpu_bytes, host)
    except ValueError as err:  # a setting the planner does not model
        raise ConfigError(
            f"activation_checkpoint.keep_attention = {where!r} with keep_attention_blocks = "
            f"{'auto' if blocks is None else blocks} is sized by the memory planner, which cannot plan this job "
            f"({err}): give keep_attention = \"device\" or \"host\" with keep_attention_blocks = N, or "
            "keep_attention = \"off\"") from None
    set_keep_attention_plan(job_config, sized)
    return sized

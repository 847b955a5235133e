"""A parsed TorchTitan JobConfig planned: through its ``JobSpec`` (``torchtitan_0_2.job_spec``), the
machine's memory, and the sizing of ``keep_attention = "auto"`` left on the job config for the trainer."""

from __future__ import annotations

from dataclasses import replace

from titan_upipe.errors import ConfigError
from titan_upipe.plan.job import PlanInput
from titan_upipe.plan.machine import (
    MachineMemory,
    checkpoint_staging_bytes,
    keep_host_budget,
)
from titan_upipe.plan.result import MemoryPlan
from titan_upipe.plan.search import size_keep_attention
from titan_upipe.plan.spec_input import plan_input_from_spec
from titan_upipe.plan.step import plan
from titan_upipe.spec.keep_attention import KeepAttentionPlan
from titan_upipe.torchtitan_0_2.checks.keep_attention import (
    keep_attention_plan,
    keep_setting,
    needs_planner,
    set_keep_attention_plan,
)
from titan_upipe.torchtitan_0_2.job_spec import job_spec, writes_async_checkpoints
from titan_upipe.torchtitan_common.machine import machine_memory_here, this_gpu_bytes

__all__ = ["machine_memory_here", "this_gpu_bytes"]  # where the tools have read them


def plan_input_from_job_config(job_config, world_size: int | None = None, device: str | None = None) -> PlanInput:
    """PlanInput of a parsed TorchTitan JobConfig (``titan_upipe.torchtitan_0_2.config_parse.parse_config``):
    its ``JobSpec`` (``torchtitan_0_2.job_spec``) as the planner reads one (``plan.spec_input``)."""
    return plan_input_from_spec(job_spec(job_config, world_size), device)


def plan_from_job_config(job_config, world_size: int | None = None, device: str | None = None) -> MemoryPlan:
    return plan(plan_input_from_job_config(job_config, world_size, device))


def async_checkpoint_staging_bytes(job_config, job: PlanInput) -> int:
    """Host bytes one node's async checkpoint stages (``plan.machine.checkpoint_staging_bytes``)."""
    return checkpoint_staging_bytes(writes_async_checkpoints(job_config), job)


def size_keep_attention_of_job(job_config, world_size: int, machine: MachineMemory | None = None
                               ) -> KeepAttentionPlan:
    """The job's kept-attention plan: the config's own, or ``auto`` sized by the planner for
    ``machine`` (default: this one) and left on the job config for ``parallelize``
    (``checks.keep_attention``). The tools' entry points call it before any process group."""
    if not needs_planner(job_config):
        return keep_attention_plan(job_config)
    machine = machine or machine_memory_here(world_size)
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

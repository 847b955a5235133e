"""What the 0.3 launch decides before any process group, from the ``JobSpec`` and this machine's memory
(``torchtitan_common.machine``), as 0.2's ``memory_guard.prepare_launch`` does for a JobConfig:

1. ``keep_attention = "auto"`` (or ``keep_attention_blocks = "auto"``) sized by the planner for this
   machine's device and host memory (``plan.search.size_keep_attention``), left on the spec;
2. the memory guard: a job the planner predicts will not fit is refused, with the longest
   ``training.seq_len`` that fits (``plan.fit``). A job the planner cannot plan is not judged.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from titan_upipe.errors import ConfigError
from titan_upipe.plan.fit import fit_problem
from titan_upipe.plan.machine import MachineMemory, checkpoint_staging_bytes, keep_host_budget
from titan_upipe.plan.search import size_keep_attention
from titan_upipe.plan.spec_input import plan_input_from_spec
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.torchtitan_common.machine import machine_memory_here

logger = logging.getLogger()


def prepare_job(spec: JobSpec, machine: MachineMemory | None = None) -> JobSpec:
    """``spec`` with its kept-attention plan sized for ``machine`` (default: this one); ConfigError
    when the planner predicts the job does not fit it."""
    machine = machine or machine_memory_here(spec.world_size)
    job = replace(plan_input_from_spec(spec, machine.device), gpus_per_node=machine.ranks_per_node)
    staging = checkpoint_staging_bytes(spec.async_checkpoint, job)
    if spec.keep_attention != "off" and spec.keep_plan is None:
        try:
            keep = size_keep_attention(job, spec.keep_attention, spec.keep_attention_blocks, machine.gpu_bytes,
                                       keep_host_budget(machine.host_bytes, staging))
        except ValueError as err:
            raise ConfigError(f"activation_checkpoint.keep_attention = {spec.keep_attention!r} is sized by the memory "
                              f"planner, which cannot plan this job ({err}): give keep_attention = \"device\" or "
                              "\"host\" with keep_attention_blocks = N, or keep_attention = \"off\"") from None
        spec = replace(spec, keep_plan=keep)
        job = replace(job, keep_device_blocks=keep.device_blocks, keep_host_blocks=keep.host_blocks)
    try:
        problem = fit_problem(job, machine, staging)
    except ValueError as err:  # a setting the planner does not model: the guard never stops what it cannot judge
        logger.info(f"memory guard skipped: the planner cannot plan this job ({err})")
        return spec
    if problem:
        raise ConfigError(problem)
    return spec

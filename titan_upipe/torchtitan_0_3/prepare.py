"""What the 0.3 launch decides before any process group, from the ``JobSpec`` and this machine's memory
(``torchtitan_common.machine``), as 0.2's ``memory_guard.prepare_launch`` does for a JobConfig
(``plan.fit.prepare_spec``): ``keep_attention = "auto"`` sized for this machine, and the memory guard (a
job the planner predicts will not fit is refused, with the longest ``training.seq_len`` that fits).
"""

from __future__ import annotations

from titan_upipe.errors import ConfigError
from titan_upipe.plan.fit import prepare_spec
from titan_upipe.plan.machine import MachineMemory
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.torchtitan_common.machine import machine_memory_here


def prepare_job(spec: JobSpec, machine: MachineMemory | None = None) -> JobSpec:
    """``spec`` with its kept-attention plan sized for ``machine`` (default: this one); ConfigError
    when the planner predicts the job does not fit it."""
    spec, problem = prepare_spec(spec, machine or machine_memory_here(spec.world_size))
    if problem:
        raise ConfigError(problem)
    return spec

"""Whether a planned job fits a machine, and the fix when it does not: the memory guard's verdict
(``torchtitan_0_2.memory_guard``, ``validate`` on every adapter), pure arithmetic on a ``PlanInput``.

What a rank has:

- on CUDA, the GPU's total memory less the planner's runtime reserve (``PlanInput.reserve``);
- on the CPU, where activations, state and offloaded inputs share one memory, the node's host
  memory divided among its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_upipe.errors import ConfigError
from titan_upipe.plan.job import PlanInput
from titan_upipe.plan.machine import MachineMemory, checkpoint_staging_bytes, keep_host_budget
from titan_upipe.plan.search import longest_multiple, size_keep_attention
from titan_upipe.plan.spec_input import plan_input_from_spec
from titan_upipe.plan.step import plan
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.spec.units import GIB


@dataclass(frozen=True)
class MemoryFit:
    """What a rank of a planned job needs, beside what it has."""

    rank_bytes: float
    """The planner's peak of one step per rank; on the CPU with the rank's offloaded inputs, host
    optimizer state and async checkpoint staging, which share its memory."""
    rank_limit: float
    """What a rank may use: GPU memory less the runtime reserve, or its share of the free host memory."""

    @property
    def fits(self) -> bool:
        return self.rank_bytes <= self.rank_limit


def memory_fit(job: PlanInput, machine: MachineMemory, staging_bytes: int) -> MemoryFit:
    """The plan of ``job`` against ``machine`` (``staging_bytes``: a node's async checkpoint staging)."""
    result = plan(job, machine.host_bytes)
    if machine.device == "cuda":
        return MemoryFit(result.peak_gpu_bytes, machine.gpu_bytes - job.reserve)
    ranks = machine.ranks_per_node
    return MemoryFit(result.peak_gpu_bytes + result.host_bytes_per_rank + staging_bytes / ranks,
                     machine.host_bytes / ranks)


def longest_fitting_length(job: PlanInput, machine: MachineMemory, staging_bytes: int) -> int | None:
    """The longest multiple of the job's sequence unit below its ``seq_len`` that fits (0: none
    does; None: the planner cannot plan a shorter length)."""
    unit = job.seq_unit
    try:
        return unit * longest_multiple(
            lambda k: memory_fit(replace(job, seq_len=k * unit), machine, staging_bytes).fits,
            start=1, limit=max(job.seq_len // unit - 1, 1))
    except ValueError:
        return None


def gib_text(n: float) -> str:
    return f"{n / GIB:,.1f} GiB"


def _shortfall(job: PlanInput, fit: MemoryFit, machine: MachineMemory) -> str:
    """What does not fit, in numbers."""
    blocks = f"{job.model.n_layers} blocks, {job.tokens:,} tokens per rank"
    if machine.device == "cuda":
        return (f"the memory planner predicts {gib_text(fit.rank_bytes)} per rank at the step's peak ({blocks}), and "
                f"the GPU has {gib_text(machine.gpu_bytes)}, {gib_text(fit.rank_limit)} after the planner's "
                f"{gib_text(job.reserve)} runtime reserve")
    return (f"the memory planner predicts {gib_text(fit.rank_bytes)} per rank ({blocks}; on the CPU activations, state "
            f"and offloaded inputs share the host memory), and {gib_text(machine.host_bytes)} of host memory is free, "
            f"{gib_text(fit.rank_limit)} for {_each_of(machine.ranks_per_node)}")


def _each_of(ranks: int) -> str:
    return "its one rank" if ranks == 1 else f"each of its {ranks} ranks"


def _fix(job: PlanInput, longest: int | None) -> str:
    if longest is None:
        return "lower training.seq_len"
    if longest:
        unit = f", a multiple of {job.seq_unit}" if job.seq_unit > 1 else ""
        return f"set training.seq_len to {longest:,} or less (the longest that fits{unit})"
    return (f"no training.seq_len fits (the model's state alone does not, even at {job.seq_unit} tokens): use more "
            "ranks (FSDP shards the state) or a machine with more memory")




def fit_problem(job: PlanInput, machine: MachineMemory, staging_bytes: int = 0) -> str | None:
    """Why ``job`` does not fit ``machine`` (what it needs against what it has, and the longest
    ``training.seq_len`` that fits), or None when it fits. Raises the planner's ValueError for a job it
    does not model."""
    fit = memory_fit(job, machine, staging_bytes)
    if fit.fits:
        return None
    longest = longest_fitting_length(job, machine, staging_bytes)
    return (f"training.seq_len = {job.seq_len:,} does not fit: {_shortfall(job, fit, machine)}; "
            f"{_fix(job, longest)}")


def prepare_spec(spec: JobSpec, machine: MachineMemory) -> tuple[JobSpec, str | None]:
    """(``spec`` with ``keep_attention = "auto"`` sized for ``machine``, why it does not fit ``machine``
    or None). What a launch decides before any process group, and what ``validate`` judges for the
    target machine: the kept blocks and the async checkpoint staging are both in the verdict. A job the
    planner cannot judge is not refused (None); an ``auto`` keep plan it cannot size is (ConfigError)."""
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
        return spec, fit_problem(job, machine, staging)
    except ValueError:  # a setting the planner does not model: the guard never stops what it cannot judge
        return spec, None

"""What a node offers a job's ranks (``MachineMemory``), and what of its host memory kept attention
may fill: plain values, read by the planner's sizing; detecting them on this machine (torch's CUDA
queries, ``/proc``) is the adapters' (``torchtitan_common.machine.machine_memory_here``)."""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.plan.job import PlanInput

PLAN_GPU_GIB = 80.0
"""The GPU an ``auto`` keep plan is sized for when no GPU memory is given (``plan --gpu-mem``)."""

CHECKPOINT_BYTES_PER_PARAMETER = 12
"""A full checkpoint: fp32 weights and AdamW's two fp32 moments."""

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


def checkpoint_staging_bytes(async_checkpoint: bool, job: PlanInput) -> int:
    """Host bytes one node's async checkpoint stages: each rank's shard of what a checkpoint holds
    (``CHECKPOINT_BYTES_PER_PARAMETER``) for the node's ranks; 0 without async checkpoints."""
    if not async_checkpoint:
        return 0
    shard = CHECKPOINT_BYTES_PER_PARAMETER * job.model.total_params // job.fsdp
    return shard * min(job.ranks, job.gpus_per_node)

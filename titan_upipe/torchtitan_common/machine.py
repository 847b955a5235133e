"""This machine's memory as the planner reads it (``plan.machine.MachineMemory``): what both adapters'
launches judge a job against before any process group (torch's CUDA queries, ``/proc``, the cgroup)."""

from __future__ import annotations

import os

import torch

from titan_upipe.plan.machine import MachineMemory, cgroup_memory_limit


def this_gpu_bytes() -> float:
    """Total memory of this rank's GPU (``LOCAL_RANK``)."""
    return float(torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", "0"))).total_memory)


def machine_memory_here(world_size: int) -> MachineMemory:
    """This machine's: the CUDA device of ``LOCAL_RANK`` (its total memory: every GPU of a job is
    taken to be alike) or, without one, the host's memory split over the node's ranks."""
    host = float(min(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), cgroup_memory_limit()))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if torch.cuda.is_available():
        return MachineMemory(this_gpu_bytes(), host, ranks, "cuda")
    return MachineMemory(host / max(ranks, 1), host, ranks, "cpu")

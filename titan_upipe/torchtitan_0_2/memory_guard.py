"""The memory guard: a job the memory planner predicts will not fit is refused before anything is
allocated, with the longest ``training.seq_len`` that fits as the fix.

Without it a ``seq_len`` of ``2**40`` reaches the allocator: a 70 TB request after the model is
built, the OOM killer on a CPU machine without a memory cap. The planner (``plan.step.plan``) is
pure arithmetic and takes milliseconds, so every entry point that allocates runs the guard
first: the trainer (:func:`prepare_launch`, passed by ``titan_upipe.train``), the rank emulator
(``emulate``, with the blocks it builds) and the parity check (``check``: its two unsharded
models and their gradients hold about the training step's sharded state and moments or more, and
its activations are not checkpointed, so the training step's plan does not overstate it);
``validate`` judges the job for its target machine (:func:`target_machine`).

What a rank has:

- on CUDA, the GPU's total memory less the planner's runtime reserve (``PlanInput.reserve``)
  (a node's host memory for offloaded activations is ``validate``'s check, against the compute
  node's memory);
- on the CPU, where activations, state and offloaded inputs share one memory, the host memory
  free now (``MemAvailable``, within a container's limit), divided among the node's ranks.

Selective layer AC and ``activation_checkpoint.mode = "memory_budget"``, which the planner does
not model, are planned as full AC: they keep more, so the plan is a lower bound. A job the
planner cannot plan at all (its ValueError) is not guarded: the guard never stops a launch it
cannot judge.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import replace

import torch

from titan_upipe.errors import ConfigError
from titan_upipe.plan.fit import fit_problem
from titan_upipe.plan.job import PlanInput
from titan_upipe.plan.machine import PLAN_GPU_GIB, MachineMemory, cgroup_memory_limit
from titan_upipe.spec.keep_attention import KeepAttentionPlan
from titan_upipe.spec.units import GIB
from titan_upipe.torchtitan_0_2.job_plan import (
    async_checkpoint_staging_bytes,
    plan_input_from_job_config,
    size_keep_attention_of_job,
    this_gpu_bytes,
)
from titan_upipe.torchtitan_common import cpu_runtime

logger = logging.getLogger(__name__)

CGROUP_USAGE = ("/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory/memory.usage_in_bytes")
"""A container's memory in use (cgroup v2, v1), beside its limit (``plan.machine.CGROUP_LIMITS``)."""

CHECKPOINTED_MODES = ("none", "full")
"""``activation_checkpoint.mode`` values the planner models as they are; the others keep more
than full AC and are planned as full AC, a lower bound."""


def _read_int(path: str) -> int | None:
    try:
        text = open(path).read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def available_host_bytes() -> float:
    """Host memory free now: ``MemAvailable`` of ``/proc/meminfo`` (the free pages of the machine
    where there is none), no more than a container's limit less its usage."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        free = float(int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        free = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    limit = cgroup_memory_limit()
    usage = next((used for path in CGROUP_USAGE if (used := _read_int(path)) is not None), None)
    if limit != float("inf") and usage is not None:
        free = min(free, max(limit - usage, 0.0))
    return free


def local_ranks(world_size: int) -> int:
    """Ranks of the job on this node (torchrun's ``LOCAL_WORLD_SIZE``; the whole job without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))


def free_machine_memory(ranks_on_node: int, device: str | None = None) -> MachineMemory:
    """What each of ``ranks_on_node`` ranks has here (``device``: ``cuda`` or ``cpu``; None: the
    device TorchTitan trains on, the CPU where the plugin's CPU runtime is active): the GPU's total
    memory, or the free host memory divided among the ranks; the node's free host memory."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() and not cpu_runtime.is_active() else "cpu"
    host = available_host_bytes()
    ranks = max(ranks_on_node, 1)
    if device == "cuda":
        return MachineMemory(this_gpu_bytes(), host, ranks, "cuda")
    return MachineMemory(host / ranks, host, ranks, "cpu")


def target_machine(job_config, world_size: int, host_bytes: float | None = None,
                   gpu_bytes: float = PLAN_GPU_GIB * GIB, device: str | None = None) -> MachineMemory:
    """The machine ``validate`` judges a job for, away from it: ``device`` (``cuda``, ``cpu``; None:
    a job with half-precision parameters on a GPU, a float32 job on a CPU machine, the planner's
    reading of ``training.mixed_precision_param``); a GPU is this machine's, else one of
    ``gpu_bytes``; ``host_bytes`` of host memory (default: free here) shared by up to 8 ranks."""
    ranks = min(world_size, 8)
    host = available_host_bytes() if host_bytes is None else float(host_bytes)
    if device is None:
        device = "cpu" if job_config.training.mixed_precision_param == "float32" else "cuda"
    if device == "cpu":
        return MachineMemory(host / ranks, host, ranks, "cpu")
    return MachineMemory(this_gpu_bytes() if torch.cuda.is_available() else gpu_bytes, host, ranks, "cuda")


def _as_planned(job_config):
    """``job_config``, or a copy with ``activation_checkpoint.mode = "full"`` where its mode is one
    the planner does not model (selective layer AC, a memory budget: both keep more than full AC)."""
    ac = job_config.activation_checkpoint
    if ac.mode in CHECKPOINTED_MODES or (ac.mode == "selective" and str(ac.selective_ac_option).strip() in ("op", "1")):
        return job_config
    planned = copy.copy(job_config)
    planned.activation_checkpoint = replace(ac, mode="full")
    return planned


def planned_job(job_config, world_size: int, machine: MachineMemory, n_layers: int | None = None,
                batch: int | None = None) -> PlanInput:
    """The job as the planner sees it on ``machine`` (its device, its ranks per node); ``n_layers``:
    that many blocks built (the emulator's ``--n-layers``), the kept and resident blocks capped to
    them; ``batch``: sequences per step instead of ``training.local_batch_size`` (the parity
    check's ``--batch``). Raises the planner's ValueError for a job it does not model."""
    job = replace(plan_input_from_job_config(_as_planned(job_config), world_size, machine.device),
                  gpus_per_node=machine.ranks_per_node)
    if batch is not None:
        job = replace(job, batch=batch)
    if n_layers is None:
        return job
    keep = KeepAttentionPlan(min(job.keep_device_blocks, n_layers),
                             min(job.keep_host_blocks, max(n_layers - job.keep_device_blocks, 0)))
    return replace(job, model=replace(job.model, n_layers=n_layers), resident_blocks=min(job.resident_blocks, n_layers),
                   keep_device_blocks=keep.device_blocks, keep_host_blocks=keep.host_blocks)


class MemoryDoesNotFit(ConfigError):
    """The planner predicts the job does not fit the machine (the tools that record OOMs, such as
    the emulator's ``--json``, record this refusal as one)."""


def memory_problem(job_config, world_size: int, machine: MachineMemory, n_layers: int | None = None,
                   batch: int | None = None) -> str | None:
    """Why the job does not fit ``machine`` (``n_layers``, ``batch``: :func:`planned_job`), with the
    fix; None when it fits or the planner cannot plan it (logged)."""
    try:
        job = planned_job(job_config, world_size, machine, n_layers, batch)
        staging = async_checkpoint_staging_bytes(job_config, job)
        return fit_problem(job, machine, staging)
    except ValueError as err:  # ConfigError too: a setting the planner refuses
        logger.info(f"memory guard skipped: the planner cannot plan this job ({err})")
        return None


def check_memory_fits(job_config, world_size: int, machine: MachineMemory | None = None, *,
                      n_layers: int | None = None, batch: int | None = None) -> None:
    """Raise :class:`MemoryDoesNotFit` (a ConfigError) when the planner predicts the job does not
    fit ``machine`` (default: this one, its free memory now, shared by the node's ranks);
    ``n_layers``, ``batch``: what is built and run instead of the config's (:func:`planned_job`)."""
    machine = machine or free_machine_memory(local_ranks(world_size))
    if problem := memory_problem(job_config, world_size, machine, n_layers, batch):
        raise MemoryDoesNotFit(problem)


def prepare_launch(job_config, world_size: int) -> KeepAttentionPlan:
    """What ``titan_upipe.train`` decides before any process group starts: the memory guard, then
    ``keep_attention = "auto"`` sized for this machine (``size_keep_attention_of_job``)."""
    check_memory_fits(job_config, world_size)
    return size_keep_attention_of_job(job_config, world_size)

"""Run functions on N gloo ranks in forked processes and collect every rank's result.

Starting ranks is the expensive part on a 2-core machine (each rank imports torch and
TorchTitan, ~11 s: ~45 s for 8 ranks spawned), so the ranks are forked from one forkserver
that imported them once (``PRELOADED``), and one pool of ranks per world size is started on
first use and kept for the whole pytest session (the ranks share the forkserver's hash
seed; the trainer's launches, ``forked_ranks``, give each rank its own). Every
``run_distributed`` call is a job sent to all ranks of that pool. A failure on any rank
fails the caller with that rank's traceback; the pool is then torn down (other ranks may be
stuck in a collective with the failed one) and the next call starts a fresh one. A rank
that dies without reporting fails the caller at once instead of waiting for the timeout.
"""

from __future__ import annotations

import atexit
import itertools
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from forked_ranks import free_port

from titan_upipe.adapter import adapter_module


def _worker(rank: int, world_size: int, port: int, jobs: Any, results: Any) -> None:
    try:
        os.environ.setdefault("TITAN_UPIPE_DEVICE", "cpu")
        torch.set_num_threads(1)
        # the core's model families, as the installed TorchTitan's adapter registers them
        adapter_module("model_classes").register_model_classes()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((None, rank, "error", traceback.format_exc()))
        return
    try:
        while (job := jobs.get()) is not None:
            job_id, fn, args = job
            try:
                results.put((job_id, rank, "ok", fn(rank, world_size, mesh, *args)))
            except BaseException:  # noqa: BLE001
                results.put((job_id, rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


PRELOADED = ["torch", "torch.distributed", "torchtitan.models.llama3", "torchtitan.models.qwen3", "titan_upipe.attention",
             "titan_upipe.parallel", "titan_upipe.transforms", "dist_utils"]
"""What the forkserver imports before it forks a rank (the rest each job's module imports)."""


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOADED)  # read when the forkserver starts: the first pool's
    return ctx


class _RankPool:
    def __init__(self, world_size: int) -> None:
        ctx = _context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.jobs[r], self.results), daemon=True)
                      for r in range(world_size)]
        for proc in self.procs:
            proc.start()
        self.job_ids = itertools.count()

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> list[Any]:
        job_id = next(self.job_ids)
        for jobs in self.jobs:
            jobs.put((job_id, fn, args))
        values: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(values) < self.world_size:
            try:
                done_id, rank, status, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(self.procs)
                        if p.exitcode is not None]
                if dead:
                    raise AssertionError("; ".join(dead) + " without reporting a result") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"distributed job timed out after {timeout}s") from None
                continue
            if status != "ok":
                raise AssertionError(f"distributed job failed on rank {rank}:\n{value}")
            if done_id == job_id:
                values[rank] = value
        return [values[r] for r in range(self.world_size)]

    def close(self, graceful: bool) -> None:
        if graceful:
            for jobs in self.jobs:
                jobs.put(None)
        for proc in self.procs:
            proc.join(timeout=10 if graceful else 0.1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)


_POOLS: dict[int, _RankPool] = {}


def run_distributed(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
    """``fn(rank, world_size, cp_mesh, *args)`` on ``world_size`` gloo ranks (cp_mesh: a 1-D
    ``DeviceMesh`` over all of them); returns the per-rank values (picklable), rank order.
    ``fn`` must be a module-level function."""
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _RankPool(world_size)
    try:
        return pool.run(fn, args, timeout)
    except BaseException:
        _POOLS.pop(world_size).close(graceful=False)
        raise


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close(graceful=True)

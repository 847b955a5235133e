"""The GPU suite's emulator runs (memory, speed and tsp stages): what one run is, its command, and
running a stage's runs in order within a deadline, each in a process of its own.

A run's time estimate comes from its caller (``gpu_suite.run_estimate_s``: the start-up and one
step); a timed run of ``steps`` steps (the speed and tsp stages: ``TIMED_STEPS``, the first
``WARMUP_STEPS`` untimed, issue 41) multiplies the step part of it (``estimate_with_steps``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from titan_upipe.toolkit.cli_args import parse_length
from titan_upipe.tools.compile_caches import compile_cache_env
from titan_upipe.tools.gpu_context import REPO, add_memory_context, add_speed_context
from titan_upipe.tools.gpu_queue import FULL_RECOMPUTE

MEMORY_LAYERS = 2
"""Blocks the emulator runs build (the emulator extrapolates to the flavor's depth; it needs >= 2)."""
TIMED_STEPS = 3
WARMUP_STEPS = 1
"""The speed and tsp runs: 3 steps, the first untimed (first uses), the median of the other 2
reported; no tokens/s from a single cold step (``gpu_context.add_speed_context``)."""
COMPILE_PASS_STEPS = 0.5
"""The emulator's compile pass before step 1, in steps: each distinct kernel call once, forward
and backward, at most one block's attention of the 2 blocks' (Ulysses; UPipe a stage's)."""


def estimate_with_steps(one_step_s: float, startup_s: float, steps: int) -> float:
    """The estimate of a run of ``steps`` steps and its compile pass from that of one step
    (``one_step_s``, ``startup_s`` of it the start-up, which counts once)."""
    return startup_s + (one_step_s - startup_s) * (steps + COMPILE_PASS_STEPS)


@dataclass(frozen=True)
class Run:
    """One measurement of a stage: a name, the command (emulator runs) and its time estimate."""

    stage: str
    name: str
    argv: tuple[str, ...] = ()
    estimate_s: float = 0.0
    method: str = ""
    length: str = ""
    stop_group: str = ""
    """Runs of one group stop at the first OOM (the "upward until it no longer fits" series)."""

    def result(self, **fields) -> dict:
        """A result record of this run: what identifies it, then ``fields``."""
        return {"name": self.name, "method": self.method, "length": self.length, "model": self.name.split()[0],
                "command": " ".join(self.argv[1:]), "argv": list(self.argv[1:]), **fields}


def emulator_argv(config: str, cp_world: int, *extra: str) -> tuple[str, ...]:
    """The command of one emulator run of ``MEMORY_LAYERS`` blocks that prints its JSON record;
    full recomputation (``gpu_queue.FULL_RECOMPUTE``) unless ``extra`` sets keep_attention."""
    keep = () if FULL_RECOMPUTE[0] in extra else FULL_RECOMPUTE
    return (sys.executable, "-m", "titan_upipe.emulate", "--job.config_file", config, "--cp-world", str(cp_world),
            "--n-layers", str(MEMORY_LAYERS), "--json", *keep, *extra)


def llama_run(stage: str, method: str, length: str, estimate_s: float, stop_group: str = "", steps: int = 1,
              startup_s: float = 0.0) -> Run:
    """Llama3-8B over 8 GPUs with ``method``'s recipe of ``length``; ``estimate_s``: the wall time
    of a run of one step, ``startup_s`` of it its start-up. ``steps > 1``: a timed run, the first
    ``WARMUP_STEPS`` untimed, its estimate ``estimate_with_steps``."""
    # a shipped recipe of this length where there is one (128K-5M; UPipe's 6M and 7M recipes add
    # the issue-18 levers), else the 5M recipe with a longer seq_len
    longest = "2M" if method == "tsp" else "5M"
    recipe = length if (REPO / f"configs/llama3_8b/{method}_{length.lower()}.toml").exists() else longest
    extra = () if length == recipe else ("--training.seq_len", str(parse_length(length)))
    if steps > 1:
        extra += ("--steps", str(steps), "--warmup-steps", str(WARMUP_STEPS))
        estimate_s = estimate_with_steps(estimate_s, startup_s, steps)
    return Run(stage, f"llama3_8b {method} {length}",
               emulator_argv(f"configs/llama3_8b/{method}_{recipe.lower()}.toml", 8, *extra),
               estimate_s, method, length, stop_group)


def schedule_within(runs: list[Run], budget_s: float) -> tuple[list[Run], list[Run]]:
    """Runs that fit the budget in order (stopping at the first that does not), and the rest."""
    spent = 0.0
    for i, run in enumerate(runs):
        if spent + run.estimate_s > budget_s:
            return runs[:i], runs[i:]
        spent += run.estimate_s
    return runs, []


def child_env() -> dict[str, str]:
    """The environment of the suite's child processes: this checkout importable from anywhere."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, **compile_cache_env(), "PYTHONPATH": str(REPO) + (os.pathsep + path if path else ""),
            "PYTHONUNBUFFERED": "1"}  # compile caches: kernels compiled once per machine (compile_caches.py)


def run_emulator(run: Run, timeout_s: float | None = None) -> dict:
    """One emulator process (a fresh CUDA context and fake process group per run), killed after
    ``timeout_s`` (the call's deadline)."""
    started = time.perf_counter()
    try:
        proc = subprocess.run(run.argv, cwd=REPO, capture_output=True, text=True, env=child_env(),
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return run.result(oom=False, measurement=None, ok=False, wall_s=time.perf_counter() - started,
                          error=f"killed after {timeout_s:.0f} s: the call's deadline (estimate {run.estimate_s:.0f} s)")
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.strip().startswith("{")]
    record = records[-1] if records else None
    result = run.result(wall_s=time.perf_counter() - started, oom=bool(record and record.get("oom")),
                        measurement=None if record is None or record.get("oom") else record, ok=record is not None)
    if record is None:
        result["error"] = (proc.stderr or proc.stdout)[-2000:]
    return result


def run_emulator_stage(stage: str, runs: list[Run], deadline: float | None = None,
                       on_result: Callable[[list[dict], list[Run]], None] | None = None) -> list[dict]:
    """Run ``runs`` in order while the next one's estimate fits before ``deadline``
    (``time.monotonic()``); ``on_result(results, not_started)`` after each, so a report is on
    disk even if the call is killed."""
    results, stopped = [], set()
    for i, run in enumerate(runs):
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and run.estimate_s > remaining:
            if on_result:
                on_result(results, runs[i:])
            return results
        if run.stop_group and run.stop_group in stopped:
            results.append(run.result(skipped=True, ok=True, oom=True,
                                      detail="a shorter length of this series did not fit"))
            continue
        result = run_emulator(run, remaining)
        if result["oom"] and run.stop_group:
            stopped.add(run.stop_group)
        if stage == "memory":
            add_memory_context(result)
        results.append(result)
        print(f"[{stage}] {run.name}: {'OOM' if result['oom'] else ('ok' if result['ok'] else 'FAILED')} "
              f"({result.get('wall_s', 0):.0f} s)", flush=True)
        if stage == "speed":
            add_speed_context(results)
        if on_result:
            on_result(results, runs[i + 1:])
    return results

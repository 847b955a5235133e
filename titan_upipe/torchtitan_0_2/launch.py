"""Training entry point: ``torchrun ... -m titan_upipe.train --job.config_file X.toml [--sec.key v ...]``.

It differs from ``python -m torchtitan.train`` in three ways: the plugin's config
sections (``[upipe]`` …) are always part of the schema, even when neither the
TOML nor the CLI names ``job.custom_config_module``; the job is validated before
any process group starts (``checks.check_job``, and its files: ``job_assets.check_assets``); and context-parallel inputs
are sharded in the plugin's layout (``trainer.ContextParallelTrainer``, otherwise
TorchTitan's ``Trainer`` unchanged).

A job that cannot run (a :class:`~titan_upipe.errors.ConfigError`: a missing file, an unknown key
or flag, a bad value, degrees that do not fit the launch) stops every rank with exit status 2
before any process group starts; rank 0 prints the one-line message with its fix, and no
traceback (the other ranks stay until torchrun stops them, so that no rank's early exit cuts rank 0
off before it prints). ``--check-only --world-size N`` runs the same checks in one process and
launches nothing: the launch scripts (``make run``, ``scripts/run_train.sh``, the SLURM script) run
it before torchrun, so that a job that cannot run never spawns workers.

Once started, the ranks meet on the launch's store (``launch_store``: a rendezvous that is missing
ranks says so every 30 s); an error after that is printed by one rank (``worker_exit``) and written
to torch-elastic's error file for torchrun's summary; Ctrl-C and SIGTERM end the run with one line
from rank 0 and no traceback (``interrupts``). After a successful run rank 0 logs the TensorBoard
command for the run's logs.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchtitan.tools.logging import init_logger, logger

from titan_upipe.errors import ConfigError, TrainingStopped, is_rank_zero, write_line
from titan_upipe.torchtitan_0_2 import launch_store
from titan_upipe.torchtitan_0_2.checks import config_warnings
from titan_upipe.torchtitan_0_2.config import MetricsConsole, plugin_fields
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.interrupts import Interrupted, InterruptWatch, interrupted_line
from titan_upipe.torchtitan_0_2.job_assets import check_assets, checkpoint_folder, saved_steps
from titan_upipe.torchtitan_0_2.load_job import JobPreparation, checked_job_of
from titan_upipe.torchtitan_0_2.memory_guard import prepare_launch
from titan_upipe.torchtitan_0_2.registry import register_plugin
from titan_upipe.torchtitan_0_2.trainer import ContextParallelTrainer
from titan_upipe.torchtitan_0_2.worker_exit import error_line, exit_after_start, exit_before_start
from titan_upipe.torchtitan_common import console

CHECK_ONLY_FLAG = "--check-only"
WORLD_SIZE_FLAG = "--world-size"
TRAINING_STOPPED_STATUS = 3
"""The exit status of a run that training health stopped (:class:`~titan_upipe.errors.TrainingStopped`)."""


def launch_options(args: list[str]) -> tuple[bool, int | None, list[str]]:
    """(``--check-only`` given, ``--world-size N`` or None, the other arguments: TorchTitan's)."""
    check_only, world_size, rest = False, None, []
    words = iter(args)
    for word in words:
        if word == CHECK_ONLY_FLAG:
            check_only = True
        elif word == WORLD_SIZE_FLAG or word.startswith(WORLD_SIZE_FLAG + "="):
            value = word.partition("=")[2] or next(words, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"{WORLD_SIZE_FLAG} {value!r}: valid values are 1 or more (the ranks to launch)")
            world_size = int(value)
        else:
            rest.append(word)
    return check_only, world_size, rest


def log_on_rank_zero_only(config=None) -> None:
    """Rank 0 alone logs INFO and WARNING lines unless ``metrics.log_all_ranks``
    (``torchtitan_common.console``). Called before the config is parsed (None: parsing logs
    too) and again with it."""
    console.log_on_rank_zero_only(config is not None and plugin_fields(config.metrics, MetricsConsole).log_all_ranks)


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def checked_config(args: list[str], prepare: JobPreparation | None = None, world_size: int | None = None,
                   quiet: bool = False):
    """The parsed job after every check that needs no process group (layout, training counts, files)
    and ``prepare``, for ``world_size`` ranks (default: the launch's); rank 0 logs the settings that
    have no effect in this job (``checks.config_warnings``)."""
    config = checked_job_of(parse_config(args, quiet=quiet), world_size or launched_world_size(), prepare).config
    check_assets(config)
    for warning in config_warnings(config):  # (rank 0 alone logs warnings: log_on_rank_zero_only)
        logger.warning(warning)
    return config


def check_before_launch(args: list[str], prepare: JobPreparation | None, world_size: int | None) -> None:
    """``python -m titan_upipe.train --check-only --world-size N …``: every check the launch of ``N``
    ranks would run before its process group, in this one process; a problem is the launch's one
    line and exit status 2, success is silent (exit 0). Warnings are left to the launch's rank 0."""
    logging.getLogger().setLevel(logging.ERROR)
    try:
        checked_config(args, prepare, world_size or launched_world_size(), quiet=True)
    except ConfigError as err:
        write_line(error_line(str(err)))
        raise SystemExit(2) from None


def tensorboard_command(config) -> str | None:
    """The command that shows this run's TensorBoard logs (``<dump_folder>/<save_tb_folder>``)."""
    if not config.metrics.enable_tensorboard:
        return None
    installed = Path(sys.executable).with_name("tensorboard")
    binary = str(installed) if installed.exists() else "tensorboard"
    return f"{binary} --logdir {os.path.join(config.job.dump_folder, config.metrics.save_tb_folder)}"


@dataclass
class RunState:
    """What this rank knows of its run, for the line of an interruption: the job, its trainer (the
    step) and the launch's store (a peer's failure)."""

    config: Any = None
    trainer: ContextParallelTrainer | None = None
    launch: launch_store.LaunchStore | None = None

    def interrupted_line(self, signum: int) -> str | None:
        """Rank 0's line for ``signum``; None on the other ranks, and for a SIGTERM that torchrun sent
        because a peer failed (that peer printed why)."""
        if not is_rank_zero():
            return None
        if signum == signal.SIGTERM and self.launch is not None and self.launch.failures():
            return None
        if self.config is None:
            return f"titan_upipe.train: interrupted by {signal.Signals(signum).name} while reading the job"
        checkpoint = self.config.checkpoint
        folder = checkpoint_folder(self.config)
        step = self.trainer.step if self.trainer is not None else 0
        return interrupted_line(signum, step, self.config.training.steps, checkpoint.enable, folder,
                                saved_steps(folder) if checkpoint.enable else [], checkpoint.interval)


def meet_the_other_ranks(state: RunState) -> None:
    """Every rank on the launch's store before TorchTitan's process group waits for them silently
    (``launch_store.join``); a single process has nothing to wait for."""
    world_size = launched_world_size()
    if world_size == 1:
        return
    timeout_s = state.config.comm.init_timeout_seconds
    state.launch = launch_store.connect(int(os.environ.get("RANK", "0")), world_size, timeout_s)
    launch_store.join(state.launch, timeout_s)


def run(config, state: RunState | None = None) -> None:
    """Train ``config`` (or write its seed checkpoint) in a process group torn down at the end;
    rank 0 logs the TensorBoard command of the run's logs."""
    state = state or RunState(config)
    completed = False
    try:
        state.trainer = ContextParallelTrainer(config)
        if config.checkpoint.create_seed_checkpoint:
            if launched_world_size() != 1:
                raise ValueError("checkpoint.create_seed_checkpoint needs a single process")
            state.trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            state.trainer.train()
        completed = True
    finally:
        if state.trainer is not None:
            state.trainer.close()
        if torch.distributed.is_initialized():
            if completed:
                # Tear down together (TorchTitan's rank 0 sleeps after the last step while the
                # others go on): a gloo rank that destroyed its groups early aborted at exit
                # under load. Only after success: a failed rank's peers may never arrive.
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    if is_rank_zero() and not config.checkpoint.create_seed_checkpoint and (command := tensorboard_command(config)):
        logger.info(f"TensorBoard: {command}")


def _check_and_run(args: list[str], prepare: JobPreparation | None, state: RunState) -> None:
    try:
        state.config = checked_config(args, prepare)
        log_on_rank_zero_only(state.config)
        meet_the_other_ranks(state)
    except ConfigError as err:  # before any process group: every rank fails alike
        raise exit_before_start(str(err)) from None
    try:
        run(state.config, state)
    except ConfigError as err:
        raise exit_after_start(str(err), state.launch) from None
    except TrainingStopped as err:  # a non-finite loss or gradient norm (torchtitan_0_2/health.py)
        raise exit_after_start(str(err), state.launch, TRAINING_STOPPED_STATUS) from None


def main(args: list[str] | None = None, prepare: JobPreparation | None = None) -> None:
    register_plugin()
    init_logger()
    try:
        check_only, world_size, args = launch_options(sys.argv[1:] if args is None else args)
    except ConfigError as err:
        raise exit_before_start(str(err)) from None
    if check_only:
        return check_before_launch(args, prepare, world_size)
    log_on_rank_zero_only()
    state = RunState()
    watch = InterruptWatch(state.interrupted_line)
    try:
        with watch.installed():
            _check_and_run(args, prepare, state)
    except Interrupted as interrupted:
        watch.wait_reported()
        raise SystemExit(interrupted.status) from None


if __name__ == "__main__":
    main()


def train_main() -> None:
    """``python -m titan_upipe.train`` (``titan_upipe.train`` calls each adapter's ``launch.train_main``):
    :func:`main` with the memory planner's launch preparation."""
    main(prepare=prepare_launch)

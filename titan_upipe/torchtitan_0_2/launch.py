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
off before it prints). After a successful run rank 0 logs the TensorBoard command for the run's logs.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torchtitan.tools.logging import init_logger, logger

from titan_upipe.errors import ConfigError, exit_once, is_rank_zero
from titan_upipe.torchtitan_0_2.checks import check_job, config_warnings
from titan_upipe.torchtitan_0_2.config import MetricsConsole, plugin_fields
from titan_upipe.torchtitan_0_2.config_parse import parse_config
from titan_upipe.torchtitan_0_2.job_assets import check_assets
from titan_upipe.torchtitan_0_2.registry import register_plugin
from titan_upipe.torchtitan_0_2.trainer import ContextParallelTrainer


def discard_recorded_traceback() -> None:
    """Remove the traceback torchrun's ``@record`` wrote for this rank, if any.

    TorchTitan's ``Trainer.__init__`` and ``train`` are wrapped in ``@record``: an exception
    passing through them is written, traceback and all, to ``TORCHELASTIC_ERROR_FILE``, and
    torchrun's failure summary prints that file. For a ConfigError that this module prints as
    one line the recorded traceback is the wall of text the line replaces, so it goes."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and os.path.isfile(path):
        os.remove(path)


def exit_on_config_error(err: ConfigError, every_rank: bool) -> SystemExit:
    """The exit of a rank whose job cannot run: status 2, ``err`` printed without a traceback.

    Before any process group (``every_rank`` false) every rank checks the same config and fails
    alike: rank 0 prints the line and the others outwait it (:func:`titan_upipe.errors.exit_once`).
    After a process group started a rank may fail alone, so each failing rank prints its own
    line."""
    if not every_rank:
        return exit_once("titan_upipe.train", str(err))
    discard_recorded_traceback()
    print(f"titan_upipe.train: error on rank {os.environ.get('RANK', '0')}: {err}", file=sys.stderr, flush=True)
    return SystemExit(2)


def log_on_rank_zero_only(config=None) -> None:
    """Rank 0 alone logs INFO and WARNING lines unless ``metrics.log_all_ranks``: TorchTitan logs
    the model arguments, its start-up warnings and every step line from each rank (N copies under
    torchrun, the same on every rank). The other ranks keep their errors, which may be theirs alone.
    Called before the config is parsed (None: parsing logs too) and again with it."""
    if is_rank_zero():
        return
    every_rank = config is not None and plugin_fields(config.metrics, MetricsConsole).log_all_ranks
    logging.getLogger().setLevel(logging.INFO if every_rank else logging.ERROR)


JobPreparation = Callable[[Any, int], object]
"""``prepare(job_config, world_size)``: what a tools-layer entry point decides for the job before any
process group starts, left on the job config (``titan_upipe.train``: the planner sizes
``keep_attention = "auto"``, ``plan.job_config.size_keep_attention_of_job``)."""


def checked_config(args: list[str], prepare: JobPreparation | None = None):
    """The parsed job after every check that needs no process group (layout, training counts, files)
    and ``prepare``; rank 0 logs the settings that have no effect in this job (``checks.config_warnings``)."""
    config = parse_config(args)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_job(config, world_size)
    if prepare is not None:
        prepare(config, world_size)
    check_assets(config)
    for warning in config_warnings(config):  # (rank 0 alone logs warnings: log_on_rank_zero_only)
        logger.warning(warning)
    return config


def tensorboard_command(config) -> str | None:
    """The command that shows this run's TensorBoard logs (``<dump_folder>/<save_tb_folder>``)."""
    if not config.metrics.enable_tensorboard:
        return None
    installed = Path(sys.executable).with_name("tensorboard")
    binary = str(installed) if installed.exists() else "tensorboard"
    return f"{binary} --logdir {os.path.join(config.job.dump_folder, config.metrics.save_tb_folder)}"


def run(config) -> None:
    """Train ``config`` (or write its seed checkpoint) in a process group torn down at the end;
    rank 0 logs the TensorBoard command of the run's logs."""
    trainer = None
    completed = False
    try:
        trainer = ContextParallelTrainer(config)
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise ValueError("checkpoint.create_seed_checkpoint needs a single process")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
        completed = True
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            if completed:
                # Tear down together (TorchTitan's rank 0 sleeps after the last step while the
                # others go on): a gloo rank that destroyed its groups early aborted at exit
                # under load. Only after success: a failed rank's peers may never arrive.
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    if is_rank_zero() and not config.checkpoint.create_seed_checkpoint and (command := tensorboard_command(config)):
        logger.info(f"TensorBoard: {command}")


def main(args: list[str] | None = None, prepare: JobPreparation | None = None) -> None:
    register_plugin()
    init_logger()
    log_on_rank_zero_only()
    try:
        config = checked_config(sys.argv[1:] if args is None else args, prepare)
    except ConfigError as err:
        raise exit_on_config_error(err, every_rank=False) from None
    log_on_rank_zero_only(config)
    try:
        run(config)
    except ConfigError as err:
        raise exit_on_config_error(err, every_rank=True) from None


if __name__ == "__main__":
    main()

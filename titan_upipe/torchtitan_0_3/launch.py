"""``python -m titan_upipe.train`` on TorchTitan 0.3: a TOML recipe and its flags to a running trainer.

The recipe becomes a ``Trainer.Config`` and the plugin's sections (``recipe.load_recipe``), then the
plugin trainer's config (``trainer.plugin_config``), whose ``build()`` checks the job before any
process group (``job.launch_of``) and builds ``trainer.ContextParallelTrainer``. A refused setting is
one line and status 2; TorchTitan's own entry point runs the same config through the registered config
functions (``config_registry``).
"""

from __future__ import annotations

import sys

import torch
from torchtitan.tools.logging import init_logger

from titan_upipe.errors import ConfigError, TrainingStopped, exit_once
from titan_upipe.torchtitan_0_3.recipe import load_recipe
from titan_upipe.torchtitan_0_3.trainer import ContextParallelTrainer, plugin_config
from titan_upipe.torchtitan_common.console import log_on_rank_zero_only

TRAINING_STOPPED_STATUS = 3
"""The exit status of a run that ``training.on_nonfinite = "stop"`` ended (as on 0.2)."""


def build_trainer(argv: list[str]) -> ContextParallelTrainer:
    """The trainer of a recipe's job on this launch's ranks (``WORLD_SIZE``): ConfigError, before any
    process group, for a setting the job's checks refuse (``job.launch_of``)."""
    return plugin_config(load_recipe(argv)).build()


def train_main(argv: list[str] | None = None) -> None:
    """``python -m titan_upipe.train`` on 0.3: a wrong setting exits with one line (status 2)."""
    argv = sys.argv[1:] if argv is None else argv
    init_logger()
    log_on_rank_zero_only()  # reading the recipe logs too; the trainer applies metrics.log_all_ranks
    try:
        trainer = build_trainer(argv)
    except ConfigError as error:
        raise exit_once("titan_upipe.train", str(error)) from None
    try:
        if trainer.config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    except TrainingStopped as stopped:  # a non-finite step under training.on_nonfinite = "stop": one line
        raise exit_once("titan_upipe.train", str(stopped), TRAINING_STOPPED_STATUS) from None
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

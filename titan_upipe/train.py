"""Training entry point: ``torchrun ... -m titan_upipe.train --job.config_file X.toml [--sec.key v ...]``.

It differs from ``python -m torchtitan.train`` in three ways: the plugin's config
sections (``[upipe]`` …) are always part of the schema, even when neither the
TOML nor the CLI names ``job.custom_config_module``; the job is validated before
any process group starts (``validation.check_job``, and its files: ``job_assets.check_assets``); and context-parallel inputs
are sharded in the plugin's layout (``trainer.ContextParallelTrainer``, otherwise
TorchTitan's ``Trainer`` unchanged).
"""

from __future__ import annotations

import os
import sys
import tomllib

import torch
from torchtitan.config import ConfigManager
from torchtitan.tools.logging import init_logger, logger

from titan_upipe.job_assets import check_assets
from titan_upipe.registry import CONFIG_MODULE, register_plugin
from titan_upipe.trainer import ContextParallelTrainer
from titan_upipe.validation import check_job


def with_plugin_config(args: list[str]) -> list[str]:
    """``args`` plus ``--job.custom_config_module titan_upipe.config`` unless already chosen.

    A TOML that names another module keeps it (that module must then extend ours).
    """
    flags = ("--job.custom_config_module", "--job.custom-config-module")
    if any(a.split("=", 1)[0] in flags for a in args):
        return args
    toml_path = _flag_value(args, ("--job.config_file", "--job.config-file"))
    if toml_path and _toml_job_section(toml_path).get("custom_config_module"):
        return args
    return [*args, f"--job.custom_config_module={CONFIG_MODULE}"]


def _flag_value(args: list[str], flags: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        if key in flags:
            return value if value else (args[i + 1] if i + 1 < len(args) else None)
    return None


def _toml_job_section(path: str) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f).get("job", {})


def parse_config(args: list[str]):
    return ConfigManager().parse_args(with_plugin_config(args))


def main(args: list[str] | None = None) -> None:
    register_plugin()
    init_logger()
    config = parse_config(sys.argv[1:] if args is None else args)
    check_job(config, int(os.environ.get("WORLD_SIZE", "1")))
    check_assets(config)
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


if __name__ == "__main__":
    main()

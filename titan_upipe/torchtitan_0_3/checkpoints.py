"""The checkpoint a 0.3 job would load, checked before any process group for the version that wrote it.

As on 0.2.2, TorchTitan 0.3 resumes from ``<dump_folder>/<checkpoint.folder>`` when that folder holds a
``step-N`` with a ``.metadata`` (``checkpoint.load_step``, else the newest), and only otherwise loads
``checkpoint.initial_load_path``. A DCP checkpoint written by TorchTitan 0.2.2 names two model keys
otherwise (``spec.checkpoint_keys``): 0.3 would stop inside the load with a key error after the process
groups started, so the launch refuses it here with the conversion that moves its weights.
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint import FileSystemReader

from titan_upipe.errors import ConfigError
from titan_upipe.spec.checkpoint_keys import written_by
from titan_upipe.torchtitan_common.checkpoint_folders import saved_steps


def checkpoint_to_load(trainer) -> str | None:
    """The DCP checkpoint folder a ``Trainer.Config`` would load (None: none, or Hugging Face weights)."""
    ckpt = trainer.checkpoint
    if not ckpt.enable:
        return None
    folder = os.path.join(trainer.dump_folder, ckpt.folder)
    steps = saved_steps(folder)
    if steps:
        return os.path.join(folder, f"step-{ckpt.load_step if ckpt.load_step in steps else steps[-1]}")
    if ckpt.initial_load_path and not ckpt.initial_load_in_hf:
        return ckpt.initial_load_path
    return None


def check_checkpoint_version(trainer) -> None:
    """ConfigError when the checkpoint the job would load was written by TorchTitan 0.2.2."""
    path = checkpoint_to_load(trainer)
    if path is None or not os.path.exists(os.path.join(path, ".metadata")):
        return
    if written_by(FileSystemReader(path).read_metadata().state_dict_metadata) == "0.2":
        raise ConfigError(f"{path} was written by TorchTitan 0.2.2, which names model keys otherwise (attention.wq, "
                          "output): convert its weights with `python -m titan_upipe.tools.checkpoint_convert "
                          f"{path} NEW_FOLDER --to 0.3` and start from NEW_FOLDER (checkpoint.initial_load_path; the "
                          "optimizer starts afresh), or resume it on TorchTitan 0.2.2")

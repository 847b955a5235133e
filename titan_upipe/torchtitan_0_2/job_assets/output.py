"""Where a job writes: every folder under ``job.dump_folder`` that a setting writes to is (or can
be created) writable, and the checkpoint folder's disk holds one checkpoint of this model.

A checkpoint's size is estimated from the model built on the meta device
(``plan.machine.CHECKPOINT_BYTES_PER_PARAMETER`` per parameter for a full one: fp32 weights and
AdamW's two moments; the export dtype's bytes for a model-only final save).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from titan_upipe.errors import ConfigError
from titan_upipe.plan.machine import CHECKPOINT_BYTES_PER_PARAMETER
from titan_upipe.spec.settings import DTYPE_BYTES
from titan_upipe.torchtitan_0_2.job_assets.checkpoints import checkpoint_folder
from titan_upipe.torchtitan_0_2.job_assets.model_state import job_model_state


def byte_size(count: float) -> str:
    """``6.1 MB``, ``96.4 GB``: decimal units, as disks are sold and ``df -H`` prints."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if count < 1000 or unit == "TB":
            return f"{count:.1f} {unit}"
        count /= 1000
    return ""


def written_folders(job_config) -> list[tuple[str, str]]:
    """(setting, folder) for each folder under ``job.dump_folder`` that the job writes to."""
    dump, ckpt, profiling = job_config.job.dump_folder, job_config.checkpoint, job_config.profiling
    written = [("checkpoint.enable", checkpoint_folder(job_config))] if ckpt.enable and not ckpt.load_only else []
    if job_config.metrics.enable_tensorboard:
        written.append(("metrics.enable_tensorboard", os.path.join(dump, job_config.metrics.save_tb_folder)))
    if profiling.enable_profiling:
        written.append(("profiling.enable_profiling", os.path.join(dump, profiling.save_traces_folder)))
    if profiling.enable_memory_snapshot:
        written.append(("profiling.enable_memory_snapshot", os.path.join(dump, profiling.save_memory_snapshot_folder)))
    return written


def existing_ancestor(folder: str) -> str:
    """``folder`` or its nearest ancestor that exists (where the job's ``makedirs`` starts)."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def write_problem(folder: str) -> str | None:
    """Why nothing can be created in ``folder``, or None: a file in the way, or a test file that
    cannot be created in its nearest existing ancestor (permissions, a read-only mount)."""
    existing = existing_ancestor(folder)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        return f"{existing} is not writable ({err.strerror or err})"
    return None


def checkpoint_bytes(job_config, parameters: int) -> tuple[int, str]:
    """(bytes, what they hold) of the job's largest single save: a full checkpoint, unless every
    save is the model-only final one (``last_save_model_only`` and no save before the last step)."""
    ckpt = job_config.checkpoint
    # TorchTitan's last step is a model-only save even where it falls on the interval
    only_final = ckpt.last_save_model_only and ckpt.interval >= job_config.training.steps \
        and not ckpt.enable_first_step_checkpoint
    if only_final:
        per_parameter = DTYPE_BYTES.get(ckpt.export_dtype, 4)
        return parameters * per_parameter, f"{per_parameter} bytes: {ckpt.export_dtype} weights"
    return parameters * CHECKPOINT_BYTES_PER_PARAMETER, \
        f"{CHECKPOINT_BYTES_PER_PARAMETER} bytes: fp32 weights + 2 AdamW moments"


def space_problem(job_config, folder: str) -> str | None:
    """Why the disk of ``folder`` cannot hold the job's largest save (both sizes named), or None."""
    model = job_model_state(job_config)
    if model is None:
        return None
    needed, what = checkpoint_bytes(job_config, model.parameters)
    free = shutil.disk_usage(existing_ancestor(folder)).free
    if free >= needed:
        return None
    return (f"checkpoints go to {os.path.abspath(folder)}, whose disk has {byte_size(free)} free, but one checkpoint "
            f"of {model.label} takes about {byte_size(needed)} ({model.parameters:,} parameters x {what}): free space "
            "there or set job.dump_folder on a larger disk")


def check_output_folder(job_config) -> None:
    """Each written folder can be created and written; the checkpoint's disk holds a checkpoint."""
    for setting, folder in written_folders(job_config):
        problem = write_problem(folder)
        if problem:
            raise ConfigError(f"{setting} writes to {os.path.abspath(folder)} but {problem}: set job.dump_folder to "
                              f"a folder this job may write, or turn {setting} off")
        if setting == "checkpoint.enable" and (problem := space_problem(job_config, folder)):
            raise ConfigError(problem)

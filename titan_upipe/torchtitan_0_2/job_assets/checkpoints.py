"""The checkpoint a job resumes from or starts from, and TorchTitan's own ``[checkpoint]`` rules.

TorchTitan 0.2.2 (``CheckpointManager.load``) resumes from ``<dump_folder>/<checkpoint.folder>``
whenever that folder exists: from ``checkpoint.load_step``, else from the newest ``step-N`` with a
``.metadata`` (a save cut short has none and is skipped). Only when the folder does not exist
does it load ``checkpoint.initial_load_path`` (DCP) or, with ``initial_load_in_hf``, the
``*.safetensors`` in that path or ``model.hf_assets_path``. Each checkpoint it would open is
checked here as far as its metadata tells: readable, complete shards, this model's tensors.
"""

from __future__ import annotations

import glob
import os

from titan_upipe.data.local_text import LOCAL_TEXT_DATASET, expand_paths
from titan_upipe.errors import ConfigError, with_suggestion
from titan_upipe.spec.checkpoint_keys import written_by
from titan_upipe.torchtitan_0_2.data_builders import PLUGIN_DATASETS, loader_state_keys
from titan_upipe.torchtitan_0_2.job_assets.checkpoint_files import (
    check_shards,
    model_shapes,
    read_metadata,
    read_values,
    safetensors_shapes,
)
from titan_upipe.torchtitan_0_2.job_assets.inputs import download_hint
from titan_upipe.torchtitan_0_2.job_assets.model_state import (
    NON_MODEL_STATES,
    describe_mismatch,
    job_model_state,
)
from titan_upipe.torchtitan_common.checkpoint_folders import saved_steps, step_folders

FULL_CHECKPOINT_KEYS = ("optimizer", "train_state", "dataloader")
LOADABLE_STATES = ("model", *NON_MODEL_STATES)
"""What ``checkpoint.exclude_from_loading`` may name (TorchTitan's ``CheckpointManager.states``)."""
HF_INDEX = "model.safetensors.index.json"
"""A final save in Hugging Face format (``last_save_in_hf``) has this instead of ``.metadata``."""


def checkpoint_folder(job_config) -> str:
    return os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder)


def partial_steps(folder: str) -> list[int]:
    """``step-N`` folders TorchTitan skips: neither ``.metadata`` nor a Hugging Face index (a save
    cut short)."""
    return sorted(step for step, path in step_folders(folder).items()
                  if not any(os.path.isfile(os.path.join(path, f)) for f in (".metadata", HF_INDEX)))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_checkpoint_settings(job_config) -> None:
    """The ``[checkpoint]`` values TorchTitan's CheckpointManager refuses (ValueError, assert or a
    division by zero) only after the process groups started (``async_mode`` is a Literal, which
    the config parser checks)."""
    ckpt = job_config.checkpoint
    if not ckpt.enable:
        return
    _require(ckpt.keep_latest_k != 1,
             f"checkpoint.keep_latest_k = {ckpt.keep_latest_k} is invalid: TorchTitan keeps at least 2 checkpoints "
             "(the newest may still be being written); valid values are 0 or less (keep all) or 2 or more")
    _require(isinstance(ckpt.interval, int) and ckpt.interval >= 1,
             f"checkpoint.interval = {ckpt.interval!r} is invalid (steps between saves): valid values are 1 or more")
    for key in ckpt.exclude_from_loading:
        _require(key in LOADABLE_STATES, with_suggestion(
            f"checkpoint.exclude_from_loading names {key!r}: valid values are {', '.join(LOADABLE_STATES)}",
            key, LOADABLE_STATES))
    _require(not ckpt.initial_load_in_hf or ckpt.initial_load_model_only,
             "checkpoint.initial_load_in_hf = true loads the model only (safetensors hold no optimizer state): set "
             "checkpoint.initial_load_model_only = true")
    _require(not ckpt.last_save_in_hf or ckpt.last_save_model_only,
             "checkpoint.last_save_in_hf = true saves the model only (safetensors hold no optimizer state): set "
             "checkpoint.last_save_model_only = true, or last_save_in_hf = false for a resumable final save")
    _require(not ckpt.initial_load_in_hf_quantized or ckpt.initial_load_in_hf,
             "checkpoint.initial_load_in_hf_quantized = true needs checkpoint.initial_load_in_hf = true")


def _model_problem(job_config, path: str, found: dict, hf: bool, fix: str) -> None:
    if not hf and written_by(found) == "0.3":
        raise ConfigError(f"{path} was written by TorchTitan 0.3, which names model keys otherwise "
                          "(attention.qkv_linear.wq, lm_head): convert its weights with `python -m "
                          f"titan_upipe.tools.checkpoint_convert {path} NEW_FOLDER --to 0.2` and start from NEW_FOLDER "
                          "(checkpoint.initial_load_path; the optimizer starts afresh), or resume it on TorchTitan 0.3")
    state = job_model_state(job_config)
    problem = state and describe_mismatch(state, found, hf, (job_config.model.name,))
    if problem:
        raise ConfigError(f"{path} is not a checkpoint of {state.label}: {problem}, or {fix}")


def _check_full_checkpoint(job_config, path: str, keys: set[str], folder: str, steps: list[int]) -> None:
    """The step resumed (not a seed) holds optimizer, train state and this loader's data cursor."""
    ckpt = job_config.checkpoint
    tops = {key.split(".", 1)[0] for key in keys}
    missing = [k for k in FULL_CHECKPOINT_KEYS if k not in tops and k not in ckpt.exclude_from_loading]
    if missing:
        step = int(os.path.basename(path).split("-")[1])
        full = [s for s in steps if s != step and set(FULL_CHECKPOINT_KEYS) <= {
            k.split(".", 1)[0] for k in read_metadata(os.path.join(folder, f"step-{s}"), "move it away").state_dict_metadata}]
        raise ConfigError(
            f"{path} holds the model only (no {', '.join(missing)}: a final save with "
            "checkpoint.last_save_model_only = true), so training cannot resume from it. Resume from a full "
            f"checkpoint with --checkpoint.load_step N (full: {full or 'none'}), or start a new run from these "
            f"weights: move {folder} away and pass --checkpoint.initial_load_path {path}. Set "
            "checkpoint.last_save_model_only = false so that final saves can be resumed")
    if "dataloader" not in ckpt.exclude_from_loading:
        _check_data_cursor(job_config.training.dataset, path, keys)
        if job_config.training.dataset == LOCAL_TEXT_DATASET:
            _check_cursor_file(job_config.local_data.paths, path)


RESTART_DATA = "or restart the data from its beginning with --checkpoint.exclude_from_loading dataloader"


def _saved_by(saved: set[str]) -> str:
    """Which plugin datasets save exactly these ``dataloader`` keys: ``training.dataset =
    'synthetic_copy' or 'synthetic_docs'``, or what the keys are."""
    names = [name for name in PLUGIN_DATASETS if loader_state_keys(name) == saved]
    if names:
        return "training.dataset = " + " or ".join(map(repr, names))
    return f"dataloader keys {', '.join(sorted(saved)) or '(none)'}"


def _check_data_cursor(dataset: str, path: str, keys: set[str]) -> None:
    """The data loader state in the checkpoint is the one this job's loader loads: DCP loads into
    the job's own state, so a key it lacks stops the resume after launch ("Missing key …
    dataloader.stream.epoch" for a synthetic_copy checkpoint resumed on local_text)."""
    saved = {key.removeprefix("dataloader.") for key in keys if key.startswith("dataloader.")}
    per_rank = any(key.startswith("dp_rank_") for key in saved)
    if dataset in PLUGIN_DATASETS:
        if per_rank:
            raise ConfigError(
                f"{path} holds TorchTitan's per-rank data loader state, not the plugin's global data cursor of "
                f"training.dataset = {dataset!r}: resume with the dataset it was saved with, {RESTART_DATA}")
        if missing := sorted(loader_state_keys(dataset) - saved):
            raise ConfigError(
                f"{path} holds the data cursor of {_saved_by(saved)}, but training.dataset = {dataset!r} resumes "
                f"from {', '.join(f'dataloader.{key}' for key in missing)}: resume with the dataset it was saved "
                f"with, {RESTART_DATA}")
    elif saved and not per_rank:
        raise ConfigError(
            f"{path} holds the plugin's global data cursor ({_saved_by(saved)}), but training.dataset = "
            f"{dataset!r} is read by TorchTitan's loader, which resumes from one state per data-parallel rank: "
            f"resume with the dataset it was saved with, {RESTART_DATA}")


def _check_cursor_file(patterns: list[str], path: str) -> None:
    """A local_text cursor points into the file ``local_data.paths`` lists at its index now, as
    ``LocalTextStream.load_state_dict`` requires after launch (the files' order is the sorted
    paths: a file added or renamed moves the others)."""
    try:
        files = expand_paths(patterns)
    except ConfigError:  # patterns that match nothing: check_dataset names them
        return
    saved = read_values(path, {"dataloader": {"stream": {"file": -1, "file_path": ""}}}, "move it away")
    index, file_path = saved["dataloader"]["stream"]["file"], saved["dataloader"]["stream"]["file_path"]
    if 0 <= index < len(files) and files[index] == file_path:
        return
    here = files[index] if 0 <= index < len(files) else f"no file (it lists {len(files)})"
    raise ConfigError(f"{path}: the data cursor points into file {index} = {file_path}, but local_data.paths now lists "
                      f"{here} there: resume with the files of the original run (adding or renaming files changes the "
                      f"order), {RESTART_DATA}")


def resume_step(job_config, steps: list[int]) -> int:
    """The step TorchTitan will load from the checkpoint folder; -1 for none."""
    load_step = job_config.checkpoint.load_step
    return load_step if load_step != -1 else (steps[-1] if steps else -1)


def check_resume_point(job_config) -> None:
    """The step TorchTitan will resume from: readable metadata, complete shards, a full checkpoint
    (unless a seed, step 0) with this loader's keys, and this model's tensors."""
    if not job_config.checkpoint.enable:
        return
    folder = checkpoint_folder(job_config)
    steps = saved_steps(folder)
    step = resume_step(job_config, steps)
    if step == -1:
        return
    if step not in steps:
        raise ConfigError(f"checkpoint.load_step = {step} but {folder} holds steps {steps}: choose one of them")
    path = os.path.join(folder, f"step-{step}")
    earlier = [s for s in steps if s < step]
    fix = (f"move {path} away to resume from step {earlier[-1]}" if earlier
           else f"move {folder} away to start afresh")
    metadata = read_metadata(path, fix)
    check_shards(path, metadata, fix)
    if step > 0:  # step 0 is a seed checkpoint, which TorchTitan loads model-only
        _check_full_checkpoint(job_config, path, set(metadata.state_dict_metadata), folder, steps)
    _model_problem(job_config, path, model_shapes(metadata), False, fix)


def initial_load(job_config) -> tuple[str, str] | None:
    """(path, setting naming it) of the checkpoint a fresh job starts from, or None."""
    ckpt = job_config.checkpoint
    if ckpt.initial_load_path:
        return ckpt.initial_load_path, "checkpoint.initial_load_path"
    if ckpt.initial_load_in_hf:
        return job_config.model.hf_assets_path, "model.hf_assets_path"
    return None


def _check_no_stale_folder(job_config, path: str, setting: str) -> bool:
    """True when TorchTitan resumes instead (the folder holds a checkpoint); a ConfigError when
    the folder exists without one, because TorchTitan would then skip the initial load."""
    folder = checkpoint_folder(job_config)
    if not os.path.isdir(folder):
        return False
    if len(partial_steps(folder)) < len(step_folders(folder)):
        return True
    partial = partial_steps(folder)
    held = f"only save(s) cut short: step {', '.join(map(str, partial))}" if partial else "no checkpoint"
    raise ConfigError(f"{folder} exists but holds {held}: TorchTitan then starts from new random weights and "
                      f"ignores {setting} = {path!r}; remove {folder} to start from {path}")


def check_initial_load(job_config) -> None:
    """The checkpoint a fresh job starts from: it exists; DCP: readable, complete, this model's;
    Hugging Face: safetensors present, not cut short, this model's names and shapes."""
    found = initial_load(job_config) if job_config.checkpoint.enable else None
    if found is None:
        return
    path, setting = found
    if _check_no_stale_folder(job_config, path, setting):
        return
    if not os.path.isdir(path):
        raise ConfigError(f"{setting} = {path!r} does not exist: it is the checkpoint to start from. Fix the path "
                          "or drop the setting to start from random weights")
    if not job_config.checkpoint.initial_load_in_hf:
        fix = f"point {setting} at a complete checkpoint of this model"
        metadata = read_metadata(path, fix)
        check_shards(path, metadata, fix)
        _model_problem(job_config, path, model_shapes(metadata), False, fix)
        return
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ConfigError(
            f"checkpoint.initial_load_in_hf = true but {setting} = {path!r} has no *.safetensors: download the "
            f"weights ({download_hint(job_config, path)}) or set checkpoint.initial_load_in_hf = false "
            "(random initial weights)")
    shapes = safetensors_shapes(path, f"download the weights again ({download_hint(job_config, path)})")
    _model_problem(job_config, path, shapes, True, f"point {setting} at this model's weights")


def partial_checkpoint_warning(job_config) -> str | None:
    """A save cut short after the step the job resumes from (TorchTitan skips it silently)."""
    ckpt = job_config.checkpoint
    folder = checkpoint_folder(job_config)
    if not ckpt.enable or ckpt.load_step != -1 or not os.path.isdir(folder):
        return None
    steps = saved_steps(folder)
    after = [s for s in partial_steps(folder) if s > (steps[-1] if steps else -1)]
    if not after:
        return None
    cut = ", ".join(f"step-{s}" for s in after)
    if not steps and initial_load(job_config) is not None:
        return None  # check_initial_load refuses this folder
    if steps:
        return (f"{folder}: {cut} has no .metadata (a save cut short) and is skipped: the job resumes from step "
                f"{steps[-1]} and trains the steps after it again; remove {cut} to silence this")
    return (f"{folder}: {cut} has no .metadata (a save cut short) and is skipped: no checkpoint is complete, so the "
            f"job starts from step 1 with new weights; remove {folder} to silence this")

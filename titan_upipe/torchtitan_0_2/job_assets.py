"""The files a job needs, checked before any process group starts.

=========================== ============================================================
what                        checked when
=========================== ============================================================
tokenizer                   ``training.dataset`` is not synthetic: ``tokenizer.json`` (or
                            ``vocab.json``/``vocab.txt``) in ``model.hf_assets_path``
dataset files               ``training.dataset = "local_text"``: every ``local_data.paths``
                            pattern matches .jsonl/.parquet/.txt files; so does
                            ``validation.dataset_path`` for ``validation.dataset = "local_text"``
pretrained weights          ``checkpoint.initial_load_in_hf`` and nothing to resume:
                            ``*.safetensors`` in the load path
initial checkpoint          ``checkpoint.initial_load_path`` and nothing to resume: a folder
resume point                ``checkpoint.folder`` holds ``step-N``: the step to load is a full
                            checkpoint (not a model-only final save) with this loader's keys
output folder               ``checkpoint.enable``: ``job.dump_folder`` can be created
=========================== ============================================================

Each problem is a :class:`~titan_upipe.errors.ConfigError` naming the setting and the fix.
"""

from __future__ import annotations

import glob
import os
import re

from titan_upipe.data.builders import PLUGIN_DATASETS
from titan_upipe.data.local_text import LOCAL_TEXT_DATASET, expand_paths
from titan_upipe.data.synthetic import SYNTHETIC_DATASETS
from titan_upipe.errors import ConfigError

HF_REPOS = {"upipe_llama3": {"8B": "meta-llama/Llama-3.1-8B"}, "upipe_qwen3": {"32B": "Qwen/Qwen3-32B"},
            "llama3": {"8B": "meta-llama/Llama-3.1-8B"}, "qwen3": {"32B": "Qwen/Qwen3-32B"}}
"""The Hugging Face repositories of the recipes' models, for the download command in messages."""

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
FULL_CHECKPOINT_KEYS = ("optimizer", "train_state", "dataloader")


def download_hint(job_config, folder: str) -> str:
    repo = HF_REPOS.get(job_config.model.name, {}).get(job_config.model.flavor, "<org>/<model>")
    return (f"hf download {repo} --local-dir {folder} --include 'tokenizer*' 'config.json' "
            "'*.safetensors' 'model.safetensors.index.json'")


def check_tokenizer(job_config) -> None:
    if job_config.training.dataset in SYNTHETIC_DATASETS:
        return
    folder = job_config.model.hf_assets_path
    present = os.path.isdir(folder) and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)
    if not present:
        state = "has no tokenizer.json" if os.path.isdir(folder) else "does not exist"
        raise ConfigError(
            f"model.hf_assets_path = {folder!r} {state}: training.dataset = {job_config.training.dataset!r} is "
            f"tokenized with the Hugging Face tokenizer there. Download it ({download_hint(job_config, folder)}), "
            f"or point model.hf_assets_path at the folder holding tokenizer.json")


def check_dataset(job_config) -> None:
    if job_config.training.dataset == LOCAL_TEXT_DATASET:
        if not job_config.local_data.paths:
            raise ConfigError('training.dataset = "local_text" needs local_data.paths: glob patterns of '
                              '.jsonl/.parquet/.txt files, e.g. paths = ["/data/books/*.jsonl"]')
        expand_paths(job_config.local_data.paths)
    validation = job_config.validation
    if validation.enable and validation.dataset == LOCAL_TEXT_DATASET and validation.dataset_path:
        expand_paths([validation.dataset_path], "validation.dataset_path")


def checkpoint_folder(job_config) -> str:
    return os.path.join(job_config.job.dump_folder, job_config.checkpoint.folder)


def saved_steps(folder: str) -> list[int]:
    """The ``step-N`` checkpoints in ``folder``, oldest first (TorchTitan's naming)."""
    steps = []
    for path in glob.glob(os.path.join(folder, "step-*")):
        match = re.fullmatch(r"step-(\d+)", os.path.basename(path))
        if match and os.path.isfile(os.path.join(path, ".metadata")):
            steps.append(int(match.group(1)))
    return sorted(steps)


def checkpoint_keys(path: str) -> set[str]:
    """The flattened state keys of a DCP checkpoint (reads its ``.metadata`` only)."""
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def check_resume_point(job_config) -> None:
    """The step TorchTitan will resume from holds what this job loads."""
    ckpt = job_config.checkpoint
    folder = checkpoint_folder(job_config)
    steps = saved_steps(folder)
    step = ckpt.load_step if ckpt.load_step != -1 else (steps[-1] if steps else -1)
    if step <= 0:  # nothing to resume, or a seed checkpoint (loaded model-only by TorchTitan)
        return
    if step not in steps:
        raise ConfigError(f"checkpoint.load_step = {step} but {folder} holds steps {steps}: choose one of them")
    path = os.path.join(folder, f"step-{step}")
    keys = checkpoint_keys(path)
    tops = {key.split(".", 1)[0] for key in keys}
    missing = [k for k in FULL_CHECKPOINT_KEYS if k not in tops and k not in ckpt.exclude_from_loading]
    if missing:
        full = [s for s in steps if s != step and set(FULL_CHECKPOINT_KEYS) <= {
            k.split(".", 1)[0] for k in checkpoint_keys(os.path.join(folder, f"step-{s}"))}]
        raise ConfigError(
            f"{path} holds the model only (no {', '.join(missing)}: a final save with "
            "checkpoint.last_save_model_only = true), so training cannot resume from it. Resume from a full "
            f"checkpoint with --checkpoint.load_step N (full: {full or 'none'}), or start a new run from these "
            f"weights: move {folder} away and pass --checkpoint.initial_load_path {path}. Set "
            "checkpoint.last_save_model_only = false so that final saves can be resumed")
    if job_config.training.dataset in PLUGIN_DATASETS and "dataloader" not in ckpt.exclude_from_loading:
        if any(key.startswith("dataloader.dp_rank_") for key in keys):
            raise ConfigError(
                f"{path} holds TorchTitan's per-rank data loader state, not the plugin's global data cursor of "
                f"training.dataset = {job_config.training.dataset!r}: resume with the dataset it was saved with, or "
                "restart the data from its beginning with --checkpoint.exclude_from_loading dataloader")


def check_initial_load(job_config) -> None:
    ckpt = job_config.checkpoint
    if saved_steps(checkpoint_folder(job_config)):
        return  # TorchTitan resumes from the folder and ignores the initial load
    path = ckpt.initial_load_path or (job_config.model.hf_assets_path if ckpt.initial_load_in_hf else None)
    if path is None:
        return
    setting = "checkpoint.initial_load_path" if ckpt.initial_load_path else "model.hf_assets_path"
    if not os.path.isdir(path):
        raise ConfigError(f"{setting} = {path!r} does not exist: it is the checkpoint to start from. Fix the path "
                          "or drop the setting to start from random weights")
    if ckpt.initial_load_in_hf and not glob.glob(os.path.join(path, "*.safetensors")):
        raise ConfigError(
            f"checkpoint.initial_load_in_hf = true but {setting} = {path!r} has no *.safetensors: download the "
            f"weights ({download_hint(job_config, path)}) or set checkpoint.initial_load_in_hf = false "
            "(random initial weights)")


def check_output_folder(job_config) -> None:
    folder = os.path.abspath(checkpoint_folder(job_config))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"checkpoints go to {folder} but {existing} is not writable: set job.dump_folder to a "
                          "folder this job may write")


def check_checkpoint(job_config) -> None:
    if not job_config.checkpoint.enable:
        return
    check_resume_point(job_config)
    check_initial_load(job_config)
    if not job_config.checkpoint.load_only:
        check_output_folder(job_config)


ASSET_CHECKS = (check_tokenizer, check_dataset, check_checkpoint)
"""Every asset check as ``check(job_config)``; ``titan_upipe.validate`` reports all problems,
``check_assets`` (the trainer entry point) stops at the first."""


def check_assets(job_config) -> None:
    for check in ASSET_CHECKS:
        check(job_config)


def asset_warnings(job_config) -> list[str]:
    """Settings that run, but not as a long job wants them to."""
    warnings = []
    ckpt = job_config.checkpoint
    if ckpt.enable and ckpt.last_save_model_only and not ckpt.load_only:
        warnings.append("checkpoint.last_save_model_only = true: the final checkpoint holds the model only, so a "
                        "later run with more steps cannot resume from it; set it to false for resumable jobs")
    if job_config.training.dataset not in PLUGIN_DATASETS and not job_config.training.dataset_path:
        warnings.append(f"training.dataset = {job_config.training.dataset!r} streams from the Hugging Face hub: "
                        "every node needs network access; use training.dataset = \"local_text\" for local files")
    return warnings

"""The files a job needs, opened as the job will open them, before any process group starts.

=========================== ============================================================
what                        checked when
=========================== ============================================================
tokenizer                   ``training.dataset`` is not synthetic: ``tokenizer.json`` (or
                            ``vocab.json``/``vocab.txt``) in ``model.hf_assets_path``, loadable,
                            its vocabulary no larger than the model's ``vocab_size``, an EOS
                            token for a ``block_causal`` flavor
dataset files               ``training.dataset = "local_text"``: every ``local_data.paths``
                            pattern matches .jsonl/.parquet/.txt files, whose first records read
                            (text key present, no broken line, not empty); so does
                            ``validation.dataset_path`` for ``validation.dataset = "local_text"``
``[checkpoint]`` values     ``checkpoint.enable``: what TorchTitan's CheckpointManager refuses
                            (``keep_latest_k = 1``, ``interval`` < 1, a typo in ``exclude_from_loading``, …)
resume point                ``checkpoint.folder`` holds ``step-N``: the step to load has a readable
                            ``.metadata``, every ``.distcp`` shard it reads at full size, this
                            model's tensors (names and shapes), and is a full checkpoint (not a
                            model-only final save) with the data cursor of the configured dataset
initial checkpoint          no checkpoint folder: ``checkpoint.initial_load_path`` (DCP: as the
                            resume point) or, with ``initial_load_in_hf``, ``*.safetensors`` whose
                            headers hold this model's names and shapes and fit their files; a
                            checkpoint folder without a complete step is refused (TorchTitan
                            would skip the initial load)
output folders              what the job writes under ``job.dump_folder`` (checkpoints, TensorBoard,
                            profiles) can be created there; its disk holds one checkpoint
=========================== ============================================================

Each problem is a :class:`~titan_upipe.errors.ConfigError` naming the file or setting and the
fix. ``asset_warnings`` lists what runs but not as intended (a save cut short that the resume
skips, …); ``check_assets`` logs them on rank 0.
"""

from __future__ import annotations

from torchtitan.hf_datasets.text_datasets import DATASETS
from torchtitan.tools.logging import logger

from titan_upipe.torchtitan_0_2.data_builders import PLUGIN_DATASETS
from titan_upipe.torchtitan_0_2.job_assets.checkpoint_files import checkpoint_keys
from titan_upipe.torchtitan_0_2.job_assets.checkpoints import (
    check_checkpoint_settings,
    check_initial_load,
    check_resume_point,
    checkpoint_folder,
    partial_checkpoint_warning,
    partial_steps,
    saved_steps,
)
from titan_upipe.torchtitan_0_2.job_assets.inputs import check_dataset, check_tokenizer, download_hint
from titan_upipe.torchtitan_0_2.job_assets.output import check_output_folder

__all__ = ["ASSET_CHECKS", "asset_warnings", "check_assets", "check_checkpoint_settings", "check_dataset",
           "check_initial_load", "check_output_folder", "check_resume_point", "check_tokenizer", "checkpoint_folder",
           "checkpoint_keys", "download_hint", "partial_steps", "saved_steps"]

ASSET_CHECKS = (check_tokenizer, check_dataset, check_checkpoint_settings, check_resume_point, check_initial_load,
                check_output_folder)
"""Every asset check as ``check(job_config)``; ``titan_upipe.validate`` reports all problems,
``check_assets`` (the trainer entry point) stops at the first."""


def asset_warnings(job_config) -> list[str]:
    """Settings and files that run, but not as a long job wants them to."""
    warnings = []
    ckpt = job_config.checkpoint
    if ckpt.enable and ckpt.last_save_model_only and not ckpt.load_only:
        warnings.append("checkpoint.last_save_model_only = true: the final checkpoint holds the model only, so a "
                        "later run with more steps cannot resume from it; set it to false for resumable jobs")
    hub = job_config.training.dataset in DATASETS and job_config.training.dataset not in PLUGIN_DATASETS
    if hub and not job_config.training.dataset_path:  # (an unknown name: the job checks refuse it)
        warnings.append(f"training.dataset = {job_config.training.dataset!r} streams from the Hugging Face hub: "
                        "every node needs network access; use training.dataset = \"local_text\" for local files")
    if partial := partial_checkpoint_warning(job_config):
        warnings.append(partial)
    return warnings


def check_assets(job_config) -> None:
    """Run every asset check (the first problem raises); then log ``asset_warnings`` (rank 0 alone
    logs warnings: ``launch.log_on_rank_zero_only``)."""
    for check in ASSET_CHECKS:
        check(job_config)
    for warning in asset_warnings(job_config):
        logger.warning(warning)

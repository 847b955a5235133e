"""The one place a TorchTitan 0.2 ``JobConfig`` becomes the plugin's ``JobSpec`` (``spec.job_spec``).

The planner reads the spec this builds and nothing else (``plan.spec_input``; the adapter's
``job_plan`` and ``memory_guard`` plan a JobConfig through it); the tools get it from the door
(``load_job``); the CP converters, the trainer and the validation loss from the launch's one
``launched_job``. Its layout is the one the job checks built on the config (``checks.cp_layout``).
The model's shape
comes from the configured flavor's args, as the trainer builds them (``update_from_config``
changes no shape the spec holds); the settings from ``[upipe]`` (``[context_parallel]``),
``[transforms]``, ``[activation_checkpoint]``, ``[optimizer]``, ``[tsp]``, ``[checkpoint]``,
``[parallelism]`` and ``[training]``.
"""

from __future__ import annotations

from titan_upipe.spec.job_spec import JobSpec, degrees_world_size, section_fields
from titan_upipe.spec.job_spec import writes_async_checkpoints as async_checkpoints
from titan_upipe.torchtitan_0_2.checks.keep_attention import keep_setting, known_keep_attention_plan
from titan_upipe.torchtitan_0_2.checks.parallelism import cp_layout
from titan_upipe.torchtitan_0_2.config import ActivationCheckpointOffload, OptimizerHostState, plugin_fields
from titan_upipe.torchtitan_0_2.flavors import flavor_args, model_dims_from_args, packs_documents


def writes_async_checkpoints(job_config) -> bool:
    """``[checkpoint]`` writes async checkpoints (``spec.job_spec.writes_async_checkpoints``)."""
    return async_checkpoints(job_config.checkpoint.enable, job_config.checkpoint.async_mode)


def job_spec(job_config, world_size: int | None = None) -> JobSpec:
    """The ``JobSpec`` of a parsed TorchTitan 0.2 ``JobConfig`` on ``world_size`` ranks (default:
    the configured degrees' product). Raises ConfigError for a flavor, layout or keep-attention setting
    the job checks refuse; the layout is the checks' own (``checks.cp_layout``, built once per config)."""
    model_args = flavor_args(job_config, update=False)
    ac = job_config.activation_checkpoint
    where, blocks = keep_setting(job_config)
    return JobSpec(
        model=model_dims_from_args(f"{job_config.model.name}:{job_config.model.flavor}", model_args),
        seq_len=job_config.training.seq_len, local_batch=job_config.training.local_batch_size,
        world_size=degrees_world_size(job_config.parallelism) if world_size is None else world_size,
        layout=cp_layout(job_config), documents=packs_documents(model_args),
        param_dtype=job_config.training.mixed_precision_param, reduce_dtype=job_config.training.mixed_precision_reduce,
        keep_attention=where, keep_attention_blocks=blocks, keep_plan=known_keep_attention_plan(job_config),
        async_checkpoint=writes_async_checkpoints(job_config),
        **section_fields(job_config.model.converters, job_config.upipe, job_config.transforms, job_config.tsp,
                         plugin_fields(ac, ActivationCheckpointOffload),
                         plugin_fields(job_config.optimizer, OptimizerHostState).state_on_host, ac.mode,
                         str(ac.selective_ac_option).strip()),
    )

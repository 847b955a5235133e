"""Job-level checks that run before any process group starts, by config section.

Every check has one signature, ``check(job_config, world_size) -> None``, and raises a
:class:`~titan_upipe.errors.ConfigError` naming the setting, the valid choices and the fix.
``titan_upipe.train`` runs :func:`check_job` right after parsing the config; ``parallelize_fn``
runs it again so that launches through ``torchtitan.train`` are covered too (there after
process-group start, still before any collective of ours); ``python -m titan_upipe.validate``
runs the same ``JOB_CHECKS`` to report every problem. The context-parallel settings are read
once, into the job's one :class:`~titan_upipe.spec.cp_layout.CPLayout` (:func:`cp_layout`).

===============  ===========================================================================
module           sections
===============  ===========================================================================
device           ``TITAN_UPIPE_DEVICE``: a device this machine has
parallelism      ``[parallelism]`` degrees and world size; ``[upipe]``/``[tsp]`` layout: ``cp_layout``
layout_fixes     the fixes of a layout that does not fit, each tried on the job first (``job_problems``)
model            ``[model]`` converters and the flavor's masks, ``[transforms]``, ``[compile]``,
                 the kernel of ``[upipe] attention_backend``
training         ``[training]``, ``[validation]``, ``[activation_checkpoint]``, ``[optimizer]``
health           ``[training] on_nonfinite``: what a step with a NaN or infinite loss or grad norm does
ranges           the numbers of TorchTitan's sections (``[optimizer]``, ``[lr_scheduler]``, ``[comm]`` ...)
                 against their valid ranges
keep_attention   ``[activation_checkpoint] keep_attention``: the check and the job's one plan
ignored          plugin keys with no effect in the job's layout: warnings (``config_warnings``)
===============  ===========================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_2.checks import (
    device,
    health,
    keep_attention,
    layout_fixes,
    model,
    parallelism,
    ranges,
    training,
)
from titan_upipe.torchtitan_0_2.checks.layout_fixes import UnfitLayout
from titan_upipe.torchtitan_0_2.checks.model import (
    PLUGIN_IMPORT,
    attention_backend_choice,
    compute_dtype,
    config_warnings,
)
from titan_upipe.torchtitan_0_2.checks.parallelism import (
    cp_layout,
    data_parallel_degree,
    degrees_besides_shard,
    model_heads,
    world_size_problem,
)

JobCheck = Callable[[Any, int], None]
"""``check(job_config, world_size)``: raises ConfigError, else returns None."""

JOB_CHECKS: tuple[JobCheck, ...] = (
    device.check_device,
    parallelism.check_parallel_degrees,
    parallelism.check_supported_parallelism,
    parallelism.check_world_size,
    training.check_training,
    ranges.check_ranges,
    health.check_on_nonfinite,
    model.check_converter_names,
    parallelism.check_context_parallel,
    model.check_attention_backend,
    parallelism.check_tsp,
    model.check_document_masking,
    model.check_transforms,
    training.check_offload,
    keep_attention.check_keep_attention,
    training.check_validation,
    model.check_compile,
    training.check_activation_checkpointing,
    training.check_optimizer,
    training.check_metrics,
)
"""Every job-level check, in the order a launch meets them: ``check_job`` stops at the first
problem, ``titan_upipe.validate`` reports them all."""


def refusals(job_config, world_size: int) -> list[ConfigError]:
    """What each job check refuses, in order, as raised (a layout that does not fit: its problem
    alone, ``layout_fixes.UnfitLayout``); the trials of ``layout_fixes`` run candidates through it."""
    found = []
    for check in JOB_CHECKS:
        try:
            check(job_config, world_size)
        except ConfigError as err:
            found.append(layout_fixes.unfit(err))
    return found


def job_problems(job_config, world_size: int) -> list[str]:
    """Every problem the job checks find (not only the first), each once; a layout that does not
    fit comes with the fixes that pass these same checks (``layout_fixes.with_fix``)."""
    problems: list[str] = []
    fixed: dict[str, str] = {}  # (a check that reads the layout or the flavor meets their problems again)
    for err in refusals(job_config, world_size):
        message = str(err)
        if isinstance(err, UnfitLayout):
            if message not in fixed:
                fixed[message] = layout_fixes.with_fix(err, job_config, world_size, refusals)
            message = fixed[message]
        if message not in problems:
            problems.append(message)
    return problems


def check_job(job_config, world_size: int) -> None:
    """All checks; raises the first problem found (a layout that does not fit: with the fixes that
    pass every check)."""
    for check in JOB_CHECKS:
        try:
            check(job_config, world_size)
        except ConfigError as err:
            if isinstance(unfit := layout_fixes.unfit(err), UnfitLayout):
                raise ConfigError(layout_fixes.with_fix(unfit, job_config, world_size, refusals)) from None
            raise


__all__ = ["JOB_CHECKS", "PLUGIN_IMPORT", "JobCheck", "attention_backend_choice", "check_job", "compute_dtype",
           "config_warnings", "cp_layout", "data_parallel_degree", "degrees_besides_shard", "job_problems",
           "model_heads", "refusals", "world_size_problem"]

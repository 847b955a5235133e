"""``training.on_nonfinite`` on TorchTitan 0.2.2: the guard of a JobConfig (``torchtitan_common.health``
holds the decision, the messages and the guard both adapters' trainers use)."""

from __future__ import annotations

from titan_upipe.torchtitan_0_2.config import TrainingHealth, plugin_fields
from titan_upipe.torchtitan_common.health import (
    NONFINITE_TAG,
    NonFiniteGuard,
    StepValues,
    global_step_values,
    last_checkpoint_text,
    likely_cause,
    nonfinite_action,
)

__all__ = ["NONFINITE_TAG", "NonFiniteGuard", "StepValues", "build_guard", "global_step_values",
           "last_checkpoint_text", "likely_cause", "nonfinite_action"]


def build_guard(job_config, checkpointer) -> NonFiniteGuard:
    """The guard of ``job_config`` (its ``on_nonfinite`` checked before launch: ``checks.health``)."""
    on_nonfinite = plugin_fields(job_config.training, TrainingHealth).on_nonfinite
    return NonFiniteGuard(on_nonfinite, float(job_config.optimizer.lr), checkpointer)

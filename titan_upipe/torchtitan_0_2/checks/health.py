"""Job check of the plugin's ``[training]`` field ``on_nonfinite`` (what a step with a NaN or infinite
loss or gradient norm does: ``titan_upipe.torchtitan_0_2.health``)."""

from __future__ import annotations

from titan_upipe.errors import ConfigError, with_suggestion
from titan_upipe.torchtitan_0_2.config import NONFINITE_ACTIONS, TrainingHealth, plugin_fields

ACTION_MEANINGS = {
    "stop": "end the job at that step",
    "skip_step": "skip that step's update and go on",
    "warn": "log a warning and apply the update",
}
"""What each ``training.on_nonfinite`` value does, for the refusal."""


def check_on_nonfinite(job_config, world_size: int) -> None:
    """``training.on_nonfinite`` is one of :data:`NONFINITE_ACTIONS` (TorchTitan does not check a
    merged field's value: a typo would otherwise reach the first bad step unnoticed)."""
    value = plugin_fields(job_config.training, TrainingHealth).on_nonfinite
    if value in NONFINITE_ACTIONS:
        return
    choices = ", ".join(f'"{action}" ({ACTION_MEANINGS[action]})' for action in NONFINITE_ACTIONS)
    raise ConfigError(with_suggestion(f"invalid training.on_nonfinite = {value!r}: valid values are {choices}",
                                      value, NONFINITE_ACTIONS))

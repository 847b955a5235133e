"""The plugin's config sections (``spec.sections``), merged into TorchTitan's ``JobConfig``.

TorchTitan 0.2.2 merges the ``JobConfig`` dataclass of the module named by
``job.custom_config_module`` into its own, so these sections parse from TOML and
from the CLI (``--upipe.heads_per_stage 8``) like the stock ones. TOML values
are not type-checked by TorchTitan (``Literal`` fields included), so every
section validates itself in ``__post_init__`` and names the offending key and
the valid choices: a bad value fails before any process group starts.
"""

# No `from __future__ import annotations`: TorchTitan merges these fields by their
# runtime types, which must be classes, not strings.

from dataclasses import dataclass, field

from titan_upipe.spec.sections import (
    ATTENTION_BACKENDS,
    KERNEL_BACKENDS,
    NONFINITE_ACTIONS,
    TSP,
    ActivationCheckpointOffload,
    ConfigError,
    LocalData,
    MetricsConsole,
    OptimizerHostState,
    TrainingHealth,
    Transforms,
    UPipe,
    plugin_fields,  # noqa: F401  (the adapter's modules read merged sections through it)
)

__all__ = ["ATTENTION_BACKENDS", "KERNEL_BACKENDS", "ActivationCheckpointOffload", "ConfigError", "JobConfig", "LocalData",
           "MetricsConsole", "NONFINITE_ACTIONS", "OptimizerHostState", "TSP", "TrainingHealth", "Transforms", "UPipe"]


@dataclass
class JobConfig:
    """Sections this plugin adds to TorchTitan's ``JobConfig``."""

    upipe: UPipe = field(default_factory=UPipe)
    transforms: Transforms = field(default_factory=Transforms)
    tsp: TSP = field(default_factory=TSP)
    activation_checkpoint: ActivationCheckpointOffload = field(default_factory=ActivationCheckpointOffload)
    local_data: LocalData = field(default_factory=LocalData)
    optimizer: OptimizerHostState = field(default_factory=OptimizerHostState)
    metrics: MetricsConsole = field(default_factory=MetricsConsole)
    training: TrainingHealth = field(default_factory=TrainingHealth)

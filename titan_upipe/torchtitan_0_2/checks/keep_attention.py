"""``[activation_checkpoint] keep_attention`` and ``keep_attention_blocks``: the check, and the job's
one :class:`~titan_upipe.spec.keep_attention.KeepAttentionPlan`.

A plan with a number of blocks and one place (``device`` or ``host`` with ``keep_attention_blocks =
N``) follows from the config alone. ``auto`` (either key) depends on the memory of the machine the
job runs on: the planner sizes it at launch (``titan_upipe.plan.keep``, called by the tools'
entry points before any process group starts) and leaves the plan here, on the job config
(:func:`set_keep_attention_plan`), where ``parallelize`` reads it (:func:`keep_attention_plan`).
"""

from __future__ import annotations

from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import cp_mode
from titan_upipe.spec.keep_attention import (
    KeepAttentionPlan,
    keep_setting_of,
    needs_planner_for,
    stated_plan,
)
from titan_upipe.torchtitan_0_2.config import ActivationCheckpointOffload, plugin_fields
from titan_upipe.torchtitan_0_2.flavors import flavor_args

PLAN_ATTRIBUTE = "_titan_upipe_keep_plan"


def keep_setting(job_config) -> tuple[str, int | None]:
    """``(keep_attention, blocks)``: blocks None for ``auto``. Raises ConfigError for a bad value
    (``spec.keep_attention.keep_setting_of``)."""
    offload = plugin_fields(job_config.activation_checkpoint, ActivationCheckpointOffload)
    return keep_setting_of(offload.keep_attention, offload.keep_attention_blocks,
                           flavor_args(job_config, update=False).n_layers, job_config.model.flavor)


def check_keep_attention(job_config, world_size: int) -> None:
    """``keep_attention`` other than off: the plugin's offloaded full AC (its wrapper replays the
    blocks) and a context-parallel converter (its attention takes the record)."""
    where, _ = keep_setting(job_config)
    if where == "off":
        return
    ac = job_config.activation_checkpoint
    if ac.mode != "full" or not plugin_fields(ac, ActivationCheckpointOffload).cpu_offload:
        raise ConfigError(
            f"activation_checkpoint.keep_attention = {where!r} skips the attention recompute of the plugin's "
            f"offloaded full checkpointing, which this job does not use (mode = {ac.mode!r}, cpu_offload = "
            f"{str(plugin_fields(ac, ActivationCheckpointOffload).cpu_offload).lower()}): set "
            "activation_checkpoint.mode = \"full\" and cpu_offload = true (resident_blocks = N keeps block inputs "
            "on the device), or keep_attention = \"off\"")
    mode = cp_mode(list(job_config.model.converters))
    if mode is None:
        raise ConfigError(
            f"activation_checkpoint.keep_attention = {where!r} keeps the results of the plugin's context-parallel "
            "attention; without a CP converter the blocks run TorchTitan's own attention, which has no kept path: "
            "add one of ulysses, upipe, ring, usp, tsp to model.converters, or set keep_attention = \"off\"")


def needs_planner(job_config) -> bool:
    """Whether the plan depends on the machine's memory (``auto`` in either key)."""
    return needs_planner_for(*keep_setting(job_config))


def plan_of_setting(job_config) -> KeepAttentionPlan | None:
    """The plan the config states on its own (None where the planner must size it)."""
    return stated_plan(*keep_setting(job_config))


def set_keep_attention_plan(job_config, plan: KeepAttentionPlan) -> None:
    """The planner's sizing of an ``auto`` setting, for :func:`keep_attention_plan` (the tools' entry
    points call it before any process group starts)."""
    vars(job_config)[PLAN_ATTRIBUTE] = (keep_setting(job_config), plan)


def known_keep_attention_plan(job_config) -> KeepAttentionPlan | None:
    """The config's own plan, or the planner's sizing of ``auto`` when it ran; else None."""
    stated = plan_of_setting(job_config)
    if stated is not None:
        return stated
    sized = vars(job_config).get(PLAN_ATTRIBUTE)
    return sized[1] if sized is not None and sized[0] == keep_setting(job_config) else None


def keep_attention_plan(job_config) -> KeepAttentionPlan:
    """The job's plan: the config's own, or the planner's sizing of ``auto``; ConfigError when an
    ``auto`` setting reaches the model unsized (launched without the plugin's entry points)."""
    plan = known_keep_attention_plan(job_config)
    if plan is None:
        raise ConfigError(
            "activation_checkpoint.keep_attention / keep_attention_blocks = \"auto\" is sized by the memory planner "
            "at launch, which did not run: launch with torchrun ... -m titan_upipe.train (or the emulator, check), "
            "or give keep_attention = \"device\" or \"host\" with keep_attention_blocks = N")
    return plan

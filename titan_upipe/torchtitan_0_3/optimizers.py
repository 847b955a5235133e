"""``[optimizer] state_on_host = true`` on TorchTitan 0.3: its ``OptimizersContainer`` with AdamW's moments in
host memory (``titan_upipe.optim.host_adamw.HostStateAdamW``).

0.3 builds every optimizer from ``Trainer.Config.optimizer``, an ``OptimizersContainer.Config`` whose
parameter groups name their optimizer (the recipes: one ``AdamW`` group over every parameter). The
container resolves a name to a class in one static method; :class:`HostStateOptimizers` resolves
``AdamW`` to ``HostStateAdamW`` (a ``torch.optim.AdamW`` whose update is torch's own, so the parameters
and the checkpointed state are AdamW's: a checkpoint loads into either container).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from torchtitan.components.optimizer import OptimizersContainer

from titan_upipe.errors import ConfigError
from titan_upipe.optim.host_adamw import HostStateAdamW

logger = logging.getLogger()


class HostStateOptimizers(OptimizersContainer):
    """0.3's optimizers container whose AdamW keeps its moments in host memory, streamed per parameter in
    the step."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name != "AdamW":  # the recipes name AdamW only (recipe.load_recipe); a tyro override may not
            raise ConfigError(f"optimizer.state_on_host = true runs AdamW only (a parameter group names {name!r}): "
                              "valid values are \"AdamW\"; set state_on_host = false")
        return HostStateAdamW

    def __init__(self, config: Config, *, model_parts) -> None:
        super().__init__(config, model_parts=model_parts)
        logger.info("AdamW moments in host memory (optimizer.state_on_host): streamed per parameter in the step")


def check_host_state(optimizer: OptimizersContainer.Config) -> None:
    """ConfigError where ``state_on_host`` cannot run ``optimizer`` (before launch): AdamW groups only, and
    not 0.3's ``fused_opt_states_bf16`` (its step pre-hook creates bf16 moments on the device)."""
    names = sorted({group.optimizer_name for group in optimizer.param_groups} - {"AdamW"})
    if names:
        raise ConfigError(f"optimizer.state_on_host = true runs AdamW only (got {', '.join(map(repr, names))}): valid "
                          "values are \"AdamW\"; set state_on_host = false")
    if optimizer.implementation == "fused_opt_states_bf16":
        raise ConfigError("optimizer.state_on_host = true keeps fp32 moments in host memory: valid "
                          "optimizer.implementation values with it are for-loop, foreach, fused")


def host_state_optimizers(optimizer: OptimizersContainer.Config) -> HostStateOptimizers.Config:
    """``optimizer`` (0.3's container config) as :class:`HostStateOptimizers`' config, its groups unchanged."""
    return HostStateOptimizers.Config(**{f.name: getattr(optimizer, f.name) for f in dataclasses.fields(optimizer)})

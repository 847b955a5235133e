"""The train specs' ``build_optimizers_fn``: TorchTitan's optimizers, or with
``[optimizer] state_on_host = true`` TorchTitan's ``OptimizersContainer`` of ``HostStateAdamW``
(AdamW's moments in host memory, ``titan_upipe.optim.host_adamw``) with the section's settings."""

from __future__ import annotations

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer import build_optimizers as titan_build_optimizers
from torchtitan.tools.logging import logger

from titan_upipe.optim.host_adamw import HostStateAdamW
from titan_upipe.torchtitan_0_2.config import (
    OptimizerHostState,
    plugin_fields,
)


def optimizer_kwargs(optimizer_config) -> dict:
    """``torch.optim.AdamW``'s arguments from TorchTitan's ``[optimizer]`` section."""
    implementation = optimizer_config.implementation
    return {"lr": optimizer_config.lr, "betas": (optimizer_config.beta1, optimizer_config.beta2),
            "eps": optimizer_config.eps, "weight_decay": optimizer_config.weight_decay,
            "fused": implementation == "fused", "foreach": implementation == "foreach"}


def build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None) -> OptimizersContainer:
    if not plugin_fields(optimizer_config, OptimizerHostState).state_on_host:
        return titan_build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    # titan_upipe.torchtitan_0_2.checks.check_optimizer refused the settings this does not run (name, early
    # step in backward, TorchFT) before any process group started
    logger.info("AdamW moments in host memory (optimizer.state_on_host): streamed per parameter in the step")
    return OptimizersContainer(model_parts, HostStateAdamW, optimizer_kwargs(optimizer_config))

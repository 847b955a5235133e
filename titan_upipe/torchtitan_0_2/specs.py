"""The plugin's train specs: TorchTitan's Llama3 and Qwen3 with our infrastructure.

``upipe_llama3`` and ``upipe_qwen3`` keep TorchTitan's model classes and
flavors (so checkpoints and HF conversion are unchanged) and swap in our
``parallelize_fn``, data/tokenizer builders, validator (``titan_upipe.torchtitan_0_2.validation_loss``: the loss of
every CP layout over the global token count), optimizers (``titan_upipe.torchtitan_0_2.optimizers``: AdamW's
moments on the host with ``[optimizer] state_on_host``) and loss (TorchTitan's summed cross-entropy,
or the fused head's under the ``fused_ce`` converter) and metrics (causal attention FLOPs,
grouped TensorBoard tags: ``titan_upipe.torchtitan_0_2.metrics``). Each spec owns a copy of the flavor dict, because
``update_from_config`` mutates the flavor args in place.
The flavors themselves are ``titan_upipe.torchtitan_0_2.flavors``.
"""

from __future__ import annotations

import copy
import dataclasses

from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec

from titan_upipe.torchtitan_0_2 import data_builders as builders
from titan_upipe.torchtitan_0_2.flavors import BASE_MODELS, model_flavors
from titan_upipe.torchtitan_0_2.loss import build_loss_fn
from titan_upipe.torchtitan_0_2.metrics import build_metrics_processor
from titan_upipe.torchtitan_0_2.optimizers import build_optimizers
from titan_upipe.torchtitan_0_2.parallelize import parallelize
from titan_upipe.torchtitan_0_2.validation_loss import build_validator


def _derived_spec(name: str) -> TrainSpec:
    base_name, _ = BASE_MODELS[name]
    return dataclasses.replace(
        get_train_spec(base_name),
        model_args=copy.deepcopy(model_flavors(name)),
        parallelize_fn=parallelize,
        pipelining_fn=None,
        build_dataloader_fn=builders.build_dataloader,
        build_tokenizer_fn=builders.build_tokenizer,
        build_loss_fn=build_loss_fn,
        build_metrics_processor_fn=build_metrics_processor,
        build_validator_fn=build_validator,
        build_optimizers_fn=build_optimizers,
    )


def _is_registered(name: str) -> bool:
    try:
        get_train_spec(name)
    except ValueError:
        return False
    return True


def register() -> None:
    """Register ``upipe_llama3`` and ``upipe_qwen3`` (once; later calls find them registered)."""
    for name in BASE_MODELS:
        if not _is_registered(name):
            register_train_spec(name, _derived_spec(name))

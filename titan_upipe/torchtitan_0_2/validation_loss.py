"""Validation loss under every CP layout: the train specs' ``build_validator_fn``.

For ``K = validation.steps`` batches of ``D`` data-parallel ranks, CP rank ``c`` of batch ``d``
holding the loss sum ``L_{k,d,c}`` of its ``1/C`` of the tokens (sharded like training,
``parallel.inputs.prepare_cp_batch``, with the same ``block_causal`` documents) and ``N_{k,d}`` the valid
tokens of batch ``d`` (counted whole, before sharding)::

    validation loss = (1/K) Σ_k  Σ_{d,c} L_{k,d,c} / Σ_d N_{k,d}

the single-device mean of each global batch, averaged over the batches. TorchTitan 0.2.2's
validator shards head-tail (not the attention's layout) and counts tokens after sharding, so under
CP its loss is about C times too large, on tokens in the wrong order.

Plugin datasets restart at every evaluation (``torchtitan_0_2.data_builders.build_validation_dataloader``): each
point of the curve scores the same held-out tokens. The validation window's tokens and time are its
own (``validation_metrics/throughput(tps)``); the training throughput window resumes afterwards
without them.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import BaseValidator, Validator
from torchtitan.distributed import utils as dist_utils

from titan_upipe.errors import ConfigError
from titan_upipe.parallel.inputs import valid_tokens
from titan_upipe.torchtitan_0_2.cp_inputs import (
    document_eos_id,
    global_valid_tokens,
    shard_batch,
)
from titan_upipe.torchtitan_0_2.data_builders import PLUGIN_DATASETS, build_validation_dataloader
from titan_upipe.torchtitan_0_2.launched_job import launched_job


class LayoutValidator(BaseValidator):
    def __init__(self, job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                 validation_context, maybe_enable_amp, metrics_processor=None, pp_schedule=None,
                 pp_has_first_stage=None, pp_has_last_stage=None) -> None:
        super().__init__(job_config)
        if parallel_dims.pp_enabled:
            raise ConfigError("validation.enable with pipeline parallelism is not supported by titan_upipe: "
                              "set parallelism.pipeline_parallel_degree = 1")
        self.tokenizer = tokenizer
        self.parallel_dims = parallel_dims
        self.loss_fn = loss_fn
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self._new_loader = lambda: build_validation_dataloader(dp_world_size, dp_rank, tokenizer, job_config)
        # TorchTitan's pipeline (other datasets) is built once and read on, as TorchTitan does.
        self._loader = None if job_config.validation.dataset in PLUGIN_DATASETS else self._new_loader()

    def _batches(self):
        loader = self._loader if self._loader is not None else self._new_loader()
        steps = self.job_config.validation.steps
        for index, batch in enumerate(loader):
            if steps != -1 and index >= steps:
                return
            yield batch

    def _split(self, input_dict, labels, model_parts: list[nn.Module]):
        if self.parallel_dims.cp_enabled:
            eos_id = document_eos_id(model_parts[0].model_args, self.tokenizer)
            job = launched_job(self.job_config, self.parallel_dims)  # the mesh the converters built
            return shard_batch(input_dict, labels, job.required_cp_mesh(), job.spec, eos_id)
        # Without CP, TorchTitan's own split (it also builds flex/varlen masks where a model has them).
        return Validator.post_dataloading_process(self, input_dict, labels, model_parts)

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        assert len(model_parts) == 1, "titan_upipe validates a single model part (no pipeline parallelism)"
        model = model_parts[0]
        device = next(model.parameters()).device
        batch_mesh = self.parallel_dims.get_optional_mesh("batch")
        training_tokens, training_clock = self.metrics_processor.ntokens_since_last_log, time.perf_counter()
        model.eval()
        batch_losses, tokens = [], 0
        for input_dict, labels in self._batches():
            tokens += labels.numel()
            input_dict = {k: v.to(device) for k, v in input_dict.items()}
            labels = labels.to(device)
            batch_valid = valid_tokens(labels, IGNORE_INDEX)
            global_valid = global_valid_tokens(batch_valid, batch_mesh)
            inputs, labels, extra_inputs, extra_kwargs = self._split(input_dict, labels, model_parts)
            with self.validation_context(), self.maybe_enable_amp:
                loss_sum = self.loss_fn(model(inputs, **extra_inputs, **extra_kwargs), labels)
            batch_losses.append(loss_sum.detach().float() / global_valid)
        model.train()
        if not batch_losses:
            raise ConfigError(f"validation.dataset = {self.job_config.validation.dataset!r} yielded no batch of "
                              f"{self.job_config.validation.local_batch_size} x {self.job_config.validation.seq_len} "
                              "tokens: give it more data or lower validation.local_batch_size / seq_len")
        loss = torch.stack(batch_losses).sum() / len(batch_losses)
        loss_mesh = self.parallel_dims.get_optional_mesh("loss")
        global_loss = loss.item() if loss_mesh is None else dist_utils.dist_sum(loss, loss_mesh)
        self._log(global_loss, step, tokens, training_tokens, training_clock)

    def _log(self, loss: float, step: int, tokens: int, training_tokens: int, training_clock: float) -> None:
        """Log over the validation window only, then hand the training window back without it."""
        metrics = self.metrics_processor
        elapsed_before = training_clock - metrics.time_last_log
        metrics.ntokens_since_last_log, metrics.time_last_log = tokens, training_clock
        metrics.log_validation(loss=loss, step=step)
        metrics.ntokens_since_last_log = training_tokens
        metrics.time_last_log = time.perf_counter() - elapsed_before


def build_validator(**kwargs) -> LayoutValidator:
    """``TrainSpec.build_validator_fn``."""
    return LayoutValidator(**kwargs)

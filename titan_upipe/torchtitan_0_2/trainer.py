"""TorchTitan's ``Trainer`` with the plugin's inputs, validator and counters.

* **Inputs.** Under CP, tokens, labels and their global positions are sharded in the converted
  attention's layout (``titan_upipe.parallel.inputs.prepare_cp_batch`` on the launch's CP mesh,
  ``launched_job``: the mesh the converters built), not TorchTitan's head-tail one;
  ``attn_mask_type = "block_causal"`` adds the whole batch's documents (split after each EOS)
  as ``attention_masks`` (``cp_inputs.document_eos_id``), whatever the ``attn_type``.
* **Validation.** ``validation.enable`` runs ``titan_upipe.torchtitan_0_2.validation_loss.LayoutValidator`` (the train
  specs' ``build_validator_fn``): the same sharding, the loss over the global token count.
* **Counters.** A step's numbers, for ``D`` data-parallel batches of ``N_d`` valid tokens each, CP
  rank ``c`` holding the loss sum ``L_{d,c}`` of its ``1/C`` of batch ``d``:

  ============================ =================================================================
  ``loss_metrics/global_avg``  ``Σ_{d,c} L_{d,c} / Σ_d N_d`` (the single-device mean)
  ``loss_metrics/global_max``  ``max_d Σ_c L_{d,c} / N_d``: the worst data-parallel batch (= the
                               mean when D = 1, as on one device)
  ``n_tokens_seen``            ``Σ_d`` tokens of every step so far, counted once per batch (not once
                               per CP rank), held identically by every rank so that a checkpoint
                               resumes under any layout
  ``throughput(tps)``          tokens of this rank's batch / (time x C): per device, unchanged
  ============================ =================================================================

  TorchTitan 0.2.2 sums ``n_tokens_seen`` and takes the max over the CP ranks as well, which makes
  the first C times too large and the second the max of ``L_{d,c} / N_d`` (about the mean / C).
* **Document statistics.** A packed corpus's document lengths go to the metrics (``data/…`` tags).
* **Progress.** The step's phases and blocks, for the long-step lines, the ``progress/…`` tags
  and the run's ETA (``titan_upipe.torchtitan_common.progress``).
* **Health.** A step whose loss or gradient norm is NaN or infinite stops the job, skips its update
  or warns (``training.on_nonfinite``; ``titan_upipe.torchtitan_0_2.health``), decided before the
  optimizer step and the same on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from titan_upipe.parallel.inputs import valid_tokens
from titan_upipe.torchtitan_0_2.checkpoint_errors import SaveErrorReporter
from titan_upipe.torchtitan_0_2.config import MetricsConsole, plugin_fields
from titan_upipe.torchtitan_0_2.cp_inputs import (
    batch_ring_work,
    document_eos_id,
    document_layout_text,
    global_valid_tokens,
    shard_batch,
)
from titan_upipe.torchtitan_0_2.health import NONFINITE_TAG, build_guard, global_step_values
from titan_upipe.torchtitan_0_2.launched_job import launched_job
from titan_upipe.torchtitan_common.grad_norm import clip_grad_norm_
from titan_upipe.torchtitan_common.progress import build_step_progress
from titan_upipe.torchtitan_common.step_losses import reduce_step_losses

Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


class ContextParallelTrainer(Trainer):
    def __init__(self, job_config) -> None:
        super().__init__(job_config)
        # A failed save names its path and cause (no space, permission) in one line.
        self.checkpointer = SaveErrorReporter(self.checkpointer, self.model_parts)
        take_stats = getattr(self.dataloader, "take_document_stats", None)
        if take_stats is not None and hasattr(self.metrics_processor, "document_stats"):
            self.metrics_processor.document_stats = take_stats
        self.progress = build_step_progress(plugin_fields(job_config.metrics, MetricsConsole).progress_after_seconds,
                                            job_config.training.steps, self.model_parts, self.device)
        self.health = build_guard(job_config, self.checkpointer)
        self._logged_document_layout = False

    @property
    def data_parallel_degree(self) -> int:
        """D: the batches read per step (every CP rank of a batch reads all of it)."""
        return self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard

    def post_dataloading_process(
        self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
        if not self.parallel_dims.cp_enabled:
            return super().post_dataloading_process(input_dict, labels)
        eos_id = document_eos_id(self.model_args, self.tokenizer)
        # the launch's one job (the converters built its CP mesh): not read back from the model
        job = launched_job(self.job_config, self.parallel_dims)
        ring_degree = job.spec.layout.ring_degree
        if eos_id is not None and ring_degree > 1:
            if not self._logged_document_layout:
                logger.info("packed documents: " + document_layout_text(job.spec))
                self._logged_document_layout = True
            if hasattr(self.metrics_processor, "ring_work"):
                # what the ring's synchronous steps cost this batch (the busiest ring rank sets the pace)
                self.metrics_processor.ring_work.append(batch_ring_work(
                    input_dict["input"], eos_id, ring_degree, job.spec.document_min_split))
        return shard_batch(input_dict, labels, job.required_cp_mesh(), job.spec, eos_id)

    def batch_generator(self, data_iterable: Iterable[Batch]) -> Iterator[Batch]:
        """This rank's batches, on the host; counts the step's global tokens (``n_tokens_seen``)
        and this rank's tokens (per-device throughput)."""
        data_iterator = iter(data_iterable)
        while True:
            started = time.perf_counter()
            try:
                input_dict, labels = next(data_iterator)
            except StopIteration as exhausted:
                raise DataloaderExhaustedError() from exhausted
            # Every data-parallel rank reads a batch of the same shape.
            self.ntokens_seen += labels.numel() * self.data_parallel_degree
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            self.metrics_processor.data_loading_times.append(time.perf_counter() - started)
            yield input_dict, labels

    def train_step(self, data_iterator: Iterator[Batch]) -> None:
        """One optimizer step over ``gradient_accumulation_steps`` microbatches; losses over the
        global valid-token count; logs the counters in the module docstring."""
        self.progress.begin_step(self.step, self.gradient_accumulation_steps)
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        # N_d: this rank's data-parallel batch, whole (counted before CP sharding).
        batch_valid = torch.stack([valid_tokens(labels, IGNORE_INDEX) for _, labels in microbatches]).sum()
        batch_valid = batch_valid.to(self.device)
        batch_mesh = self.parallel_dims.get_optional_mesh("batch")
        global_valid = global_valid_tokens(batch_valid, batch_mesh)

        losses = []
        for input_dict, labels in microbatches:
            input_dict = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
            self.progress.begin_microbatch()
            loss = self.forward_backward_step(input_dict=input_dict, labels=labels.to(self.device),
                                              global_valid_tokens=global_valid)
            losses.append(loss.detach())

        self.progress.begin_optimizer()
        grad_norm = clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.job_config.training.max_norm,
            foreach=True, pp_mesh=self.parallel_dims.get_optional_mesh("pp"), ep_enabled=self.parallel_dims.ep_enabled)
        self.checkpointer.maybe_wait_for_staging()
        values = global_step_values(self.step, torch.stack(losses).sum(), grad_norm, lr)
        action = self.health.action(values)  # training.on_nonfinite, the same on every rank
        self.health.update(action, self.optimizers, self.lr_schedulers)
        phase_times = self.progress.end_step()

        # A non-finite step is always logged, so that the dashboard marks it (health/nonfinite_steps).
        if action is None and not self.metrics_processor.should_log(self.step):
            return
        avg_loss, max_loss = reduce_step_losses(self.parallel_dims, torch.stack(losses).sum(), global_valid,
                                                   batch_valid)
        self.metrics_processor.log(self.step, avg_loss, max_loss, values.grad_norm,
                                   extra_metrics={"n_tokens_seen": self.ntokens_seen, "lr": lr,
                                                  NONFINITE_TAG: self.health.nonfinite_steps, **phase_times})
        self.progress.report_step_end()
        if action == "stop":
            raise self.health.stopped(values)


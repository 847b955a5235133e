"""TorchTitan 0.3's ``Trainer`` with the plugin's CP inputs, parallelize and counters.

* **The launch's one job** (``job.Launch``, built and checked before ``Trainer.__init__`` starts a
  process group: ``job.launch_of``): the JobSpec, the CP mesh built from TorchTitan's ``cp`` mesh and
  the spec's layout once (``init_distributed``), and the attention's compute dtype. ``parallelize``
  and the input sharding read that one mesh.
* **Inputs.** Under CP, tokens, labels and their global positions are sharded in the converted
  attention's layout (``parallel.inputs.prepare_cp_batch``: contiguous for Ulysses/UPipe, zigzag
  over a ring), not 0.3's head-tail one; the positions go to the model, whose attention indexes
  its RoPE table with them.
* **Counters**, for ``D`` data-parallel batches of ``N_d`` valid tokens, CP rank ``c`` holding the
  loss sum ``L_{d,c}`` of its share of batch ``d`` (0.3's loss returns ``L_{d,c} / Σ_d N_d``):

  =========================== ==============================================================
  ``loss_metrics/global_avg`` ``Σ_{d,c} L_{d,c} / Σ_d N_d`` (the single-device mean)
  ``loss_metrics/global_max`` ``max_d Σ_c L_{d,c} / N_d`` (0.3's own takes the max over the CP
                              shares as well, which is about the mean / C)
  ``n_tokens_seen``           the global batch's tokens of every step so far, the same number on
                              every rank (a checkpoint resumes under any layout)
  ``throughput(tps)``         0.3's: the rank's whole batch / (time x C), per device
  ``tflops``, ``mfu(%)``      0.3's, from FLOPs per token with the causal attention term
                              (``costs.model_flops``; 0.3 counts every query against every key)
  ``progress/…_seconds``      the step's forward, backward and optimizer times
                              (``torchtitan_common.progress``, which prints a long step's progress
                              lines on rank 0 past ``metrics.progress_after_seconds``, as on 0.2)
  ``health/nonfinite_steps``  the non-finite steps so far (``training.on_nonfinite``:
                              ``torchtitan_common.health``, decided before the optimizer step)
  =========================== ==============================================================
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any

import torch
import tyro
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils
from torchtitan.trainer import Trainer

from titan_upipe.costs.model_flops import attention_overcount
from titan_upipe.errors import ConfigError
from titan_upipe.parallel.inputs import valid_tokens
from titan_upipe.parallel.mesh import layout_mesh
from titan_upipe.torchtitan_0_3.cp_inputs import document_eos_id, shard_for_attention
from titan_upipe.torchtitan_0_3.job import apply_plugin_settings, launch_of
from titan_upipe.torchtitan_0_3.parallelize import parallelize
from titan_upipe.torchtitan_0_3.recipe import Recipe
from titan_upipe.torchtitan_common.console import colours_off, log_on_rank_zero_only
from titan_upipe.torchtitan_common.grad_norm import clip_grad_norm_
from titan_upipe.torchtitan_common.health import NONFINITE_TAG, NonFiniteGuard, global_step_values
from titan_upipe.torchtitan_common.progress import build_step_progress
from titan_upipe.torchtitan_common.step_losses import reduce_step_losses


class ContextParallelTrainer(Trainer):
    """0.3's trainer for the plugin's jobs (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        """0.3's ``Trainer.Config`` with the recipe it came from (``job.plugin_config``): its plugin
        sections and the settings 0.3 has no field for. ``build()`` builds this trainer."""

        recipe: Annotated[Recipe | None, tyro.conf.Suppress] = None

        def to_dict(self) -> dict:  # the recipe holds this config: not twice in the logged dict
            return {key: value for key, value in Trainer.Config.to_dict(self).items() if key != "recipe"}

    def __init__(self, config: Config) -> None:
        if config.recipe is None:
            raise ConfigError("ContextParallelTrainer.Config carries no recipe: build it with "
                              "titan_upipe.torchtitan_0_3.job.plugin_config(recipe) (or a config function of "
                              "titan_upipe.torchtitan_0_3.config_registry)")
        # rank 0 alone logs, unless metrics.log_all_ranks (both entry points: titan_upipe.train, torchtitan.train);
        # colour codes only on a terminal (0.3 colours its lines whatever the stream)
        log_on_rank_zero_only(config.recipe.plugin["metrics"].log_all_ranks)
        config.metrics.disable_color_printing = colours_off(config.metrics.disable_color_printing, sys.stdout)
        self.launch = launch = launch_of(config)  # the job checked before any process group
        config.model_spec = dataclasses.replace(config.model_spec, parallelize_fn=partial(parallelize, launch=launch))
        super().__init__(config)
        self._count_causal_attention()
        if launch.spec.documents:
            launch.eos_id = document_eos_id(self.tokenizer)
        if config.validator.enable:
            self.validator.launch = launch  # the validation batches in the attention's layout
        self.health = NonFiniteGuard(launch.on_nonfinite, float(self.lr_schedulers.schedulers[0].base_lrs[0]),
                                     self.checkpointer)
        self.progress = build_step_progress(config.recipe.plugin["metrics"].progress_after_seconds,
                                            config.training.steps, self.model_parts, self.device)

    def _count_causal_attention(self) -> None:
        """The FLOPs behind ``tflops`` and ``mfu(%)``: TorchTitan's count with its full-square attention
        term swapped for the causal one (``costs.model_flops``), as on 0.2."""
        model, seq_len = self.launch.spec.model, self.config.training.seq_len
        if self.metrics_processor.num_flops_per_token > 0:
            self.metrics_processor.num_flops_per_token -= attention_overcount(model.n_layers, model.n_heads,
                                                                             model.head_dim, seq_len)

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        titan_cp_mesh = parallel_dims.get_optional_mesh("cp")
        if titan_cp_mesh is not None and self.launch.spec.layout.mode is not None:
            self.launch.cp_mesh = layout_mesh(titan_cp_mesh, self.launch.spec.layout)
        return parallel_dims

    @property
    def data_parallel_degree(self) -> int:
        return self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        if self.launch.cp_mesh is None:
            return input_dict["input"], labels, {k: v for k, v in input_dict.items() if k != "input"}
        return shard_for_attention(input_dict, labels, self.launch)

    def train_step(self, data_iterator) -> None:
        """One optimizer step over ``gradient_accumulation_steps`` microbatches, losses over the
        global valid-token count; logs the counters of the module docstring."""
        self.progress.begin_step(self.step, self.gradient_accumulation_steps)
        self.optimizers.zero_grad()
        lr_metrics = self.lr_schedulers.get_metrics()
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        # N_d: this rank's data-parallel batch, whole (counted before CP sharding).
        batch_valid = torch.stack([valid_tokens(labels, IGNORE_INDEX) for _, labels in microbatches]).sum()
        batch_valid = batch_valid.to(self.device)
        batch_mesh = self.parallel_dims.get_optional_mesh("batch")
        global_valid = batch_valid if batch_mesh is None else dist_utils.dist_sum_tensor(batch_valid, batch_mesh)
        self.ntokens_seen += sum(labels.numel() for _, labels in microbatches) * self.data_parallel_degree

        losses = []
        for input_dict, labels in microbatches:
            input_dict = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
            self.progress.begin_microbatch()
            loss = self.forward_backward_step(input_dict=input_dict, labels=labels.to(self.device),
                                              global_valid_tokens=global_valid)
            losses.append(loss.detach())

        self.progress.begin_optimizer()
        grad_norm = clip_grad_norm_(  # by mesh: TSP's weights and FSDP's shards live on two
            [p for m in self.model_parts for p in m.parameters()], self.config.training.max_norm, foreach=True,
            pp_mesh=self.parallel_dims.get_optional_mesh("pp"), ep_enabled=self.parallel_dims.ep_enabled)
        self.checkpointer.maybe_wait_for_staging()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        values = global_step_values(self.step, torch.stack(losses).sum(), grad_norm, lr)
        action = self.health.action(values)  # training.on_nonfinite, the same on every rank
        self.health.update(action, self.optimizers, self.lr_schedulers)
        phase_times = self.progress.end_step()
        if action is not None or self.metrics_processor.should_log(self.step):
            avg_loss, max_loss = reduce_step_losses(self.parallel_dims, torch.stack(losses).sum(), global_valid,
                                                       batch_valid)
            self.metrics_processor.log(self.step, avg_loss, max_loss, values.grad_norm,
                                       extra_metrics={"n_tokens_seen": self.ntokens_seen,
                                                      NONFINITE_TAG: self.health.nonfinite_steps, **lr_metrics,
                                                      **phase_times})
            self.progress.report_step_end()
        if action == "stop":
            raise self.health.stopped(values)


def plugin_config(recipe: Recipe) -> ContextParallelTrainer.Config:
    """The recipe's job as the plugin trainer's ``Config`` (``build()`` builds :class:`ContextParallelTrainer`):
    the recipe's ``Trainer.Config`` fields, the plugin's settings (``job.apply_plugin_settings``), the recipe."""
    trainer = recipe.trainer
    config = ContextParallelTrainer.Config(**{f.name: getattr(trainer, f.name) for f in dataclasses.fields(trainer)},
                                           recipe=recipe)
    apply_plugin_settings(config, recipe)
    return config

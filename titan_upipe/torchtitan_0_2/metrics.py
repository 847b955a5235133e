"""Training metrics for long-context runs: causal attention FLOPs, grouped TensorBoard tags.

TorchTitan 0.2.2 counts attention as if every query saw all ``S`` keys
(``6 · L · H · 2D · S`` per token). Under the causal mask query ``i`` sees ``i + 1`` keys,
``(S + 1) / 2`` on average, so the true forward+backward matmul cost is

    attention FLOPs / token = 3 (fwd + 2 bwd) · 2 matmuls · 2 (mul+add) · L · H · D · (S + 1) / 2
                            = 6 · L · H · D · (S + 1)

about half TorchTitan's figure; at 1M+ tokens attention dominates, so TorchTitan's MFU
would be ~2× too high. :class:`LongContextMetricsProcessor` replaces the attention term
(the parameter term ``6 · N`` is unchanged) and adds, per logged step, the tags below; a
custom-scalars layout makes TensorBoard open them grouped as Loss, Throughput, Memory.

============================== ==============================================
tag                            meaning
============================== ==============================================
loss/global_avg                mean loss over all non-ignored tokens
loss_metrics/global_max_loss   the worst data-parallel batch's mean loss (TorchTitan's tag)
validation_metrics/loss        the held-out loss (``validation.enable``; titan_upipe.torchtitan_0_2.validation_loss)
throughput/tokens_per_s_per_gpu tokens per second per device (CP ranks share a sequence)
throughput/step_time_s         wall time per step
throughput/tflops_per_gpu      achieved TFLOP/s per device, causal FLOPs
throughput/mfu_pct             model FLOPs utilisation (causal FLOPs / peak)
memory/peak_allocated_gib      peak allocated bytes on the device (GiB)
memory/peak_reserved_gib       peak reserved bytes (caching allocator) (GiB)
memory/alloc_retries           cudaMalloc retries (allocator under pressure)
memory/offload_host_gib        peak host memory held by offloaded checkpoints
data/documents, data/doc_*     documents read since the last log and their lengths in tokens
data/tokens_in_docs_ge_*_pct   share of tokens in long documents (``local_text`` only)
data/ring_work_busiest_over_*  packed documents on a ring: the busiest ring rank's attention work over the
                               mean (the ring waits for it), ``_zigzag`` under the fixed zigzag and
                               ``_documents`` under the batch's own layout (``parallel.DocumentZigzagLayout``),
                               whichever ``upipe.document_balance`` runs; batch mean since the last log
progress/<phase>_seconds       forward, backward, optimizer time of a step timed with the progress
                               on (``metrics.progress_after_seconds``; titan_upipe.torchtitan_common.progress)
health/nonfinite_steps         steps so far whose loss or gradient norm was NaN or infinite, also written
                               at each such step (``training.on_nonfinite``; titan_upipe.torchtitan_0_2.health)
============================== ==============================================

TorchTitan colours its console lines unless ``metrics.disable_color_printing``; the processor
keeps them plain also when stdout is not a terminal (a redirected log, a SLURM output file).

On CPU (``titan_upipe.torchtitan_common.cpu_runtime``) the device statistics are the process's resident set.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from titan_upipe.costs.model_flops import attention_overcount
from titan_upipe.spec.cp_layout import cp_mode
from titan_upipe.torchtitan_0_2.checks import attention_backend_choice
from titan_upipe.torchtitan_0_2.checks.keep_attention import known_keep_attention_plan
from titan_upipe.torchtitan_0_2.flavors import flavor_args, head_dim
from titan_upipe.torchtitan_common.console import console_colors
from titan_upipe.torchtitan_common.dashboard import (
    grouped_metrics,
    start_offload_window,
    tensorboard_writers,
    write_layout,
)


class LongContextMetricsProcessor(MetricsProcessor):
    """TorchTitan's metrics with causal attention FLOPs and the grouped tags above."""

    def __init__(self, job_config, parallel_dims, model_args=None, tag: str | None = None) -> None:
        self._set_flops_model(job_config, model_args)
        self.document_stats: Callable[[], dict[str, float]] | None = None
        """Set by the trainer when its loader reports document lengths (``data/…`` tags)."""
        self.ring_work: list[dict[str, float]] = []
        """Each batch's busiest / mean ring work since the last log (packed documents on a ring:
        ``cp_inputs.batch_ring_work``), logged as their mean."""
        super().__init__(job_config, parallel_dims, tag)
        # TorchTitan's logger writes to stdout; its trainer and validator read this attribute.
        self.color = console_colors(job_config.metrics.disable_color_printing, sys.stdout)
        self._write_custom_scalars_layout()
        self._write_attention_backend(job_config)
        self._write_keep_attention(job_config)

    def _set_flops_model(self, job_config, model_args) -> None:
        self._flops_per_token = -1
        self._attention_overcount = 0
        if model_args is not None:
            self._attention_overcount = attention_overcount(model_args.n_layers, model_args.n_heads,
                                                            head_dim(model_args), job_config.training.seq_len)

    # TorchTitan's trainer assigns its own estimate right after building this processor;
    # the setter swaps its attention term for the causal one, so TorchTitan's own
    # `tflops`/`mfu(%)` tags and console line are corrected too.
    @property
    def num_flops_per_token(self) -> int:
        return self._flops_per_token

    @num_flops_per_token.setter
    def num_flops_per_token(self, value: int) -> None:
        self._flops_per_token = value if value <= 0 else value - self._attention_overcount

    def _write_custom_scalars_layout(self) -> None:
        write_layout(self.logger)

    def _tensorboard_writers(self) -> list:
        return tensorboard_writers(self.logger)

    def _write_attention_backend(self, job_config) -> None:
        """The kernel the attention converter runs (``auto`` resolved), as the run's text tag
        ``upipe/attention_backend``: the same pure resolution the converter logged."""
        if cp_mode(job_config.model.converters) is None:
            return
        text = attention_backend_choice(job_config).describe()
        for writer in self._tensorboard_writers():
            writer.add_text("upipe/attention_backend", text, 0)

    def _write_keep_attention(self, job_config) -> None:
        """Which blocks keep their attention (``[activation_checkpoint] keep_attention``, ``auto`` as
        the planner sized it at launch), as the run's text tag ``upipe/keep_attention``."""
        plan = known_keep_attention_plan(job_config)
        if plan is None or cp_mode(job_config.model.converters) is None:
            return
        text = plan.describe(flavor_args(job_config, update=False).n_layers)
        for writer in self._tensorboard_writers():
            writer.add_text("upipe/keep_attention", text, 0)

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        extra = dict(extra_metrics or {})
        extra.update(self.long_context_metrics(global_avg_loss))
        if self.document_stats is not None:
            extra.update(self._document_metrics())
        if self.ring_work:
            extra.update({tag: sum(batch[tag] for batch in self.ring_work) / len(self.ring_work)
                          for tag in self.ring_work[0]})
            self.ring_work.clear()
        start_offload_window()  # a new window starts after this log
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

    def _document_metrics(self) -> dict[str, float]:
        data = self.document_stats()
        if data:
            logger.info("data: {:.0f} documents since the last log, tokens p50 {:.0f} p90 {:.0f} max {:.0f}; "
                        "{:.1f}% of tokens in documents >= seq_len".format(
                            data["data/documents"], data["data/doc_tokens_p50"], data["data/doc_tokens_p90"],
                            data["data/doc_tokens_max"], data["data/tokens_in_docs_ge_seq_len_pct"]))
        return data

    def long_context_metrics(self, global_avg_loss: float) -> dict[str, float]:
        """The grouped tags, from the same counters TorchTitan's own ``log`` reads next."""
        import time

        return grouped_metrics(global_avg_loss, tokens=self.ntokens_since_last_log,
                               seconds=time.perf_counter() - self.time_last_log,
                               steps=self.job_config.metrics.log_freq,
                               non_data_parallel=self.parallel_dims.non_data_parallel_size,
                               flops_per_token=self.num_flops_per_token, peak_flops=self.gpu_peak_flops,
                               device_stats=self._device_memory_stats())

    def _device_memory_stats(self) -> dict[str, int]:
        from torchtitan.tools.utils import device_module

        return device_module.memory_stats(self.device_memory_monitor.device)


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag: str | None = None):
    """``TrainSpec.build_metrics_processor_fn``."""
    return LongContextMetricsProcessor(job_config, parallel_dims, model_args, tag)

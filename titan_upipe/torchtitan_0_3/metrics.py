"""TorchTitan 0.3's metrics processor with the plugin's grouped TensorBoard tags (``torchtitan_common.dashboard``:
Loss, Throughput, Memory; the custom-scalars layout that groups them, with the counters, progress and health
tags the trainer logs), as 0.2's ``torchtitan_0_2.metrics`` writes them. 0.3's own tags stay as they are;
``tflops`` and ``mfu(%)`` count the causal attention FLOPs (the trainer sets ``num_flops_per_token``).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor

from titan_upipe.torchtitan_common.dashboard import grouped_metrics, start_offload_window, write_layout


class LongContextMetrics(MetricsProcessor):
    """0.3's ``MetricsProcessor`` that also writes the plugin's grouped tags at every log."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        write_layout(self.logger)

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        from torchtitan.tools.utils import device_module  # (rebound to the CPU's by cpu_runtime where no GPU)

        extra = dict(extra_metrics or {})
        extra.update(grouped_metrics(global_avg_loss, tokens=self.ntokens_since_last_log,
                                     seconds=time.perf_counter() - self.time_last_log, steps=self.config.log_freq,
                                     non_data_parallel=self.parallel_dims.non_data_parallel_size,
                                     flops_per_token=self.num_flops_per_token, peak_flops=self.gpu_peak_flops,
                                     device_stats=device_module.memory_stats(self.device_memory_monitor.device)))
        start_offload_window()  # a new window starts after this log
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)


def long_context_metrics(metrics: MetricsProcessor.Config) -> LongContextMetrics.Config:
    """``metrics`` (0.3's config) as :class:`LongContextMetrics`' config, its settings unchanged."""
    return LongContextMetrics.Config(**{f.name: getattr(metrics, f.name) for f in dataclasses.fields(metrics)})

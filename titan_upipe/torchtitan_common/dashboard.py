"""The plugin's grouped TensorBoard tags, which both adapters' metrics processors write beside TorchTitan's own
(0.2.2: ``torchtitan_0_2.metrics``; 0.3: ``torchtitan_0_3.metrics``): what they are and how each is computed,
in ``docs/dashboard.md``. :data:`CUSTOM_SCALARS_LAYOUT` makes TensorBoard open them grouped as Loss,
Throughput, Memory, Data and Progress.
"""

from __future__ import annotations

from typing import Any

from torchtitan.components.metrics import TensorBoardLogger

from titan_upipe.transforms.offload import OFFLOAD_STATS

GIB = 1024**3

CUSTOM_SCALARS_LAYOUT = {
    "Loss": {
        "loss": ("Multiline", ["loss/global_avg", "loss_metrics/global_avg_loss"]),
        # The worst data-parallel batch's mean (each adapter's trainer), the mean itself without DP.
        "max batch loss": ("Multiline", ["loss_metrics/global_max_loss"]),
        "validation loss": ("Multiline", ["validation_metrics/loss"]),
        "grad norm": ("Multiline", ["grad_norm"]),
        # rises at the step whose loss or gradient norm went NaN or infinite (torchtitan_common/health.py)
        "non-finite steps": ("Multiline", ["health/nonfinite_steps"]),
    },
    "Throughput": {
        "tokens/s per GPU": ("Multiline", ["throughput/tokens_per_s_per_gpu"]),
        "step time (s)": ("Multiline", ["throughput/step_time_s"]),
        "TFLOP/s per GPU (causal)": ("Multiline", ["throughput/tflops_per_gpu"]),
        "MFU % (causal)": ("Multiline", ["throughput/mfu_pct"]),
    },
    "Memory": {
        "peak GiB": ("Multiline", ["memory/peak_allocated_gib", "memory/peak_reserved_gib"]),
        "allocator retries": ("Multiline", ["memory/alloc_retries"]),
        "offload host GiB": ("Multiline", ["memory/offload_host_gib"]),
    },
    "Data": {
        "document tokens": ("Multiline", ["data/doc_tokens_p50", "data/doc_tokens_p90", "data/doc_tokens_max"]),
        "% tokens in long documents": ("Multiline", ["data/tokens_in_docs_ge_32k_pct",
                                                     "data/tokens_in_docs_ge_seq_len_pct"]),
        "ring work busiest / mean": ("Multiline", ["data/ring_work_busiest_over_mean_zigzag",
                                                   "data/ring_work_busiest_over_mean_documents"]),
    },
    "Progress": {
        "phase time (s)": ("Multiline", ["progress/forward_seconds", "progress/backward_seconds",
                                         "progress/optimizer_seconds"]),
    },
}


def tensorboard_writers(metric_logger: Any) -> list:
    """The ``SummaryWriter`` of each TensorBoard logger of a metrics processor's ``logger``: TorchTitan wraps
    its loggers in a ``LoggerContainer``; ranks that do not log hold none."""
    loggers = getattr(metric_logger, "_loggers", [metric_logger])
    return [tb.writer for tb in loggers if isinstance(tb, TensorBoardLogger)]


def write_layout(metric_logger: Any) -> None:
    """:data:`CUSTOM_SCALARS_LAYOUT` into every TensorBoard log of ``metric_logger``."""
    for writer in tensorboard_writers(metric_logger):
        writer.add_custom_scalars(CUSTOM_SCALARS_LAYOUT)


def grouped_metrics(global_avg_loss: float, *, tokens: int, seconds: float, steps: int, non_data_parallel: int,
                    flops_per_token: int, peak_flops: float, device_stats: dict[str, int]) -> dict[str, float]:
    """The Loss, Throughput and Memory tags of one log: ``tokens`` this rank read in ``seconds`` over ``steps``
    steps (shared by its ``non_data_parallel`` ranks: CP ranks share a sequence), the FLOPs per token with the
    causal attention term, the device's peak FLOP/s, its allocator statistics (``memory_stats``)."""
    tps = tokens / (seconds * non_data_parallel)
    flops = flops_per_token * tps
    return {
        "loss/global_avg": global_avg_loss,
        "throughput/tokens_per_s_per_gpu": tps,
        "throughput/step_time_s": seconds / steps,
        "throughput/tflops_per_gpu": flops / 1e12,
        "throughput/mfu_pct": 100 * flops / peak_flops,
        "memory/peak_allocated_gib": device_stats.get("allocated_bytes.all.peak", -1) / GIB,
        "memory/peak_reserved_gib": device_stats.get("reserved_bytes.all.peak", -1) / GIB,
        "memory/alloc_retries": device_stats.get("num_alloc_retries", -1),
        "memory/offload_host_gib": OFFLOAD_STATS.peak_host_bytes / GIB,
    }


def start_offload_window() -> None:
    """After a log: the offloaded checkpoints' host peak counts from what they hold now."""
    OFFLOAD_STATS.peak_host_bytes = OFFLOAD_STATS.host_bytes

"""Job checks of ``[training]``, ``[validation]``, ``[activation_checkpoint]``, ``[optimizer]`` and the
plugin's ``[metrics]`` fields."""

from __future__ import annotations

import csv
import math

from torchtitan.hf_datasets.text_datasets import DATASETS

from titan_upipe.data.local_text import LOCAL_TEXT_DATASET
from titan_upipe.data.synthetic import SYNTHETIC_DATASETS
from titan_upipe.errors import ConfigError, with_suggestion
from titan_upipe.resources import resource
from titan_upipe.spec.cp_layout import cp_mode
from titan_upipe.torchtitan_0_2.checks.parallelism import cp_layout, data_parallel_degree
from titan_upipe.torchtitan_0_2.config import (
    ActivationCheckpointOffload,
    MetricsConsole,
    OptimizerHostState,
    plugin_fields,
)
from titan_upipe.torchtitan_0_2.data_builders import PLUGIN_DATASETS
from titan_upipe.torchtitan_0_2.flavors import flavor_args

POSITIVE_TRAINING_KEYS = {
    "local_batch_size": "sequences per data-parallel rank",
    "steps": "optimizer steps to run",
    "seq_len": "tokens per sequence",
}
"""``[training]`` counts that must be at least 1, with what a value means (TorchTitan refuses a
batch of 0 only after the process group starts, and exits 0 after 0 steps)."""


def check_training_counts(training) -> None:
    for key, meaning in POSITIVE_TRAINING_KEYS.items():
        if (value := getattr(training, key)) < 1:
            raise ConfigError(f"training.{key} = {value} is invalid ({meaning}): valid values are 1 or more")


def check_global_batch(training, parallelism, world_size: int) -> None:
    """``global_batch_size`` is -1 (one step of local x data-parallel sequences) or a multiple of it
    (that many gradient-accumulation micro-batches)."""
    dp = data_parallel_degree(parallelism, world_size)
    if training.global_batch_size < 0 or dp is None or training.local_batch_size < 1:
        return
    unit = training.local_batch_size * dp
    if training.global_batch_size == 0 or training.global_batch_size % unit:
        raise ConfigError(
            f"training.global_batch_size = {training.global_batch_size} is not a multiple of local_batch_size "
            f"{training.local_batch_size} x data-parallel degree {dp} = {unit}: use a multiple of {unit} (global / {unit} "
            f"gradient-accumulation micro-batches per step) or -1 (= {unit}, one micro-batch per step)"
        )


def dataset_names() -> list[str]:
    """Every ``training.dataset``/``validation.dataset`` a job can read: the plugin's own and the ones
    in TorchTitan's hub registry (``DATASETS``, which names none of the plugin's but synthetic_copy)."""
    return sorted({*PLUGIN_DATASETS, *DATASETS})


def check_dataset_name(key: str, dataset: str) -> None:
    """``key`` (``training.dataset``, ``validation.dataset``) names a dataset a loader reads: any
    other name goes to TorchTitan's hub pipeline, which refuses it only after the process groups
    started."""
    if dataset not in PLUGIN_DATASETS and dataset not in DATASETS:
        raise ConfigError(with_suggestion(f"{key} = {dataset!r} is unknown: valid values are "
                                          f"{', '.join(dataset_names())}", dataset, dataset_names()))


def check_training(job_config, world_size: int) -> None:
    """Batch sizes, step count and the dataset name before any process group starts."""
    check_training_counts(job_config.training)
    check_global_batch(job_config.training, job_config.parallelism, world_size)
    check_dataset_name("training.dataset", job_config.training.dataset)


def check_offload(job_config, world_size: int) -> None:
    ac = job_config.activation_checkpoint
    offload = plugin_fields(ac, ActivationCheckpointOffload)
    late = offload.prefetch_after_attention
    if not isinstance(late, bool):
        raise ConfigError(f"invalid activation_checkpoint.prefetch_after_attention = {late!r}: valid values are "
                          "true, false")
    resident = offload.resident_blocks
    if isinstance(resident, bool) or not isinstance(resident, int) or resident < 0:
        raise ConfigError(f"invalid activation_checkpoint.resident_blocks = {resident!r}: valid values are 0 (every "
                          "block input offloaded) or a positive number of last blocks kept on the device")
    if not offload.cpu_offload:
        # it would change nothing: no block input is offloaded
        enable = "activation_checkpoint.cpu_offload = true" + ("" if ac.mode == "full" else ' (and mode = "full")')
        if resident:
            raise ConfigError("activation_checkpoint.resident_blocks keeps some offloaded block inputs on the device: "
                              f"set {enable} or drop it")
        if late:
            raise ConfigError("activation_checkpoint.prefetch_after_attention = true times the prefetch of offloaded "
                              f"block inputs: set {enable} or drop it")
        return
    if ac.mode != "full":
        raise ConfigError(
            f"activation_checkpoint.cpu_offload = true needs activation_checkpoint.mode = \"full\" "
            f"(got {ac.mode!r}): offloading keeps each block's checkpointed input on the host; "
            "valid values with offload: full"
        )
    if job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError("activation_checkpoint.cpu_offload = true does not support compile.enable with the "
                          "'model' component: set compile.enable = false or cpu_offload = false")
    if not isinstance(offload.pin_memory, bool):
        raise ConfigError(f"invalid activation_checkpoint.pin_memory = {offload.pin_memory!r}: valid values are true, "
                          "false")
    check_resident_blocks(job_config, resident)


def check_resident_blocks(job_config, resident: int) -> None:
    """``resident_blocks`` at most the flavor's block count (all of them: nothing offloaded, which
    ``checks.ignored`` warns about)."""
    n_layers = flavor_args(job_config, update=False).n_layers
    if resident > n_layers:
        raise ConfigError(
            f"activation_checkpoint.resident_blocks = {resident} is more than the {n_layers} blocks of model.flavor "
            f"{job_config.model.flavor!r}: valid values are 0 to {n_layers} ({n_layers}: no block input offloaded)")


def check_optimizer(job_config, world_size: int) -> None:
    """``[optimizer] state_on_host``: a bool, with AdamW stepped after backward (no early step in
    backward, no TorchFT wrapper), which is what ``titan_upipe.torchtitan_0_2.optimizers`` builds."""
    optimizer = job_config.optimizer
    on_host = plugin_fields(optimizer, OptimizerHostState).state_on_host
    if not isinstance(on_host, bool):
        raise ConfigError(f"invalid optimizer.state_on_host = {on_host!r}: valid values are true, false")
    if not on_host:
        return
    if optimizer.name != "AdamW":
        raise ConfigError(f"optimizer.state_on_host = true runs AdamW only (got optimizer.name = {optimizer.name!r}): "
                          "valid values are \"AdamW\"; set optimizer.name = \"AdamW\" or state_on_host = false")
    if optimizer.early_step_in_backward:
        raise ConfigError("optimizer.state_on_host = true does not support optimizer.early_step_in_backward = true "
                          "(the moments are streamed once per step, after backward): valid values are false")
    if job_config.fault_tolerance.enable:
        raise ConfigError("optimizer.state_on_host = true does not support fault_tolerance.enable = true (TorchFT "
                          "wraps its own optimizer container): set one of them to false")


def check_validation(job_config, world_size: int) -> None:
    """``[validation]`` when enabled: a CP-shardable ``seq_len`` within the RoPE table, batches and
    steps that end, a dataset the plugin or TorchTitan can read."""
    validation = job_config.validation
    if not validation.enable:
        return
    if validation.local_batch_size < 1 or validation.seq_len < 1:
        raise ConfigError(f"validation.local_batch_size = {validation.local_batch_size} and validation.seq_len = "
                          f"{validation.seq_len} must both be >= 1")
    if validation.seq_len > job_config.training.seq_len:
        raise ConfigError(f"validation.seq_len = {validation.seq_len} exceeds training.seq_len = "
                          f"{job_config.training.seq_len} (the RoPE table's length): set validation.seq_len <= "
                          f"{job_config.training.seq_len}")
    cp_layout(job_config).check_length(validation.seq_len, "validation.seq_len")
    check_dataset_name("validation.dataset", validation.dataset)
    if (validation.dataset in SYNTHETIC_DATASETS) != (job_config.training.dataset in SYNTHETIC_DATASETS):
        raise ConfigError(f"validation.dataset = {validation.dataset!r} and training.dataset = "
                          f"{job_config.training.dataset!r} use different tokenizers ({', '.join(SYNTHETIC_DATASETS)} "
                          "have their own vocabulary): validate on a synthetic dataset with synthetic training data, "
                          "on text otherwise")
    if validation.dataset in PLUGIN_DATASETS:  # infinite streams
        if validation.steps < 1:
            raise ConfigError(f"validation.steps = {validation.steps} reads {validation.dataset!r} until it ends, "
                              "and it never ends (synthetic, or local files read pass after pass): set "
                              "validation.steps to the number of batches to score, e.g. 4")
        if validation.dataset == LOCAL_TEXT_DATASET and not validation.dataset_path:
            raise ConfigError('validation.dataset = "local_text" needs validation.dataset_path: a glob pattern of '
                              '.jsonl/.parquet/.txt files, e.g. "/data/heldout/*.jsonl"')


def selective_ac_1m_gib() -> dict[str, tuple[int, int, int, int]]:
    """Per CP converter: (ranks, GiB per rank with selective layer AC "2", with full AC, with full AC
    offloaded) of its Llama3-8B recipe at 1M tokens (``configs/llama3_8b/<converter>_1m.toml``;
    planner, the selective figure extrapolated from its full/none moments and checked against the
    rank emulator on CPU: ``docs/benchmarks/selective_ac.md``, ``scripts/bench_selective_ac.py``),
    read from ``titan_upipe/resources/selective_ac_1m.csv``."""
    with open(resource("selective_ac_1m.csv"), newline="") as f:
        return {row["converter"]: (int(row["ranks"]), int(row["selective_gib"]), int(row["full_gib"]),
                                   int(row["full_offloaded_gib"])) for row in csv.DictReader(f)}


def check_activation_checkpointing(job_config, world_size: int) -> None:
    """``activation_checkpoint.mode = "selective"`` (TorchTitan's default when a TOML has no
    ``[activation_checkpoint]`` section, with ``selective_ac_option = "2"``) with a CP converter:
    a layer frequency k >= 2 checkpoints every k-th block and keeps the others' activations whole,
    which long contexts cannot hold (``selective_ac_1m_gib``); refused with the setting to use.
    ``"op"`` and k = 1 (every block checkpointed) are full AC in this plugin and pass: its
    ``parallelize`` gives TorchTitan's op-level AC no save list, so every op is recomputed
    (measured: the same bytes as full). Without a CP converter selective AC is TorchTitan's and
    passes. A ``selective_ac_option`` TorchTitan would reject at ``apply_ac`` is refused here."""
    ac = job_config.activation_checkpoint
    if ac.mode != "selective":
        return
    option = str(ac.selective_ac_option).strip()
    if option != "op" and not option.isdigit():
        raise ConfigError(f"activation_checkpoint.selective_ac_option = {option!r} is invalid: valid values are "
                          "\"op\" or a block frequency k (\"2\": every 2nd block checkpointed)")
    mode = cp_mode(list(job_config.model.converters))
    if mode is None or option == "op" or int(option) <= 1:
        return
    measured = selective_ac_1m_gib()
    if mode not in measured:
        raise ConfigError(
            f"activation_checkpoint.mode = \"selective\" (selective_ac_option = \"{option}\") checkpoints one block "
            f"in {option} and keeps the other blocks' activations, too many for {mode} at long contexts: set "
            "activation_checkpoint.mode = \"full\", or \"none\" for short debug runs")
    ranks, selective, full, offloaded = measured[mode]
    default = "; TorchTitan's default when the TOML has no [activation_checkpoint] section" if option == "2" else ""
    offload = ("" if plugin_fields(ac, ActivationCheckpointOffload).cpu_offload
               else " (with activation_checkpoint.cpu_offload = true for long contexts)")
    raise ConfigError(
        f"activation_checkpoint.mode = \"selective\" (selective_ac_option = \"{option}\"{default}) checkpoints one "
        f"block in {option} and keeps the other blocks' activations, too many for {mode} at long contexts "
        f"(Llama3-8B, 1M tokens, {ranks} ranks: {selective} GiB per rank against {full} with full AC and {offloaded} "
        f"offloaded; docs/benchmarks/selective_ac.md): set activation_checkpoint.mode = \"full\"{offload}, or "
        "\"none\" for short debug runs"
    )


def check_metrics(job_config, world_size: int) -> None:
    """The plugin's ``[metrics]`` fields: ``progress_after_seconds`` is a number of seconds >= 0."""
    value = plugin_fields(job_config.metrics, MetricsConsole).progress_after_seconds
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not ok:
        raise ConfigError(f"invalid metrics.progress_after_seconds = {value!r}: valid values are 0 (every step) or "
                          f"a positive number of seconds; set e.g. {MetricsConsole.progress_after_seconds}")

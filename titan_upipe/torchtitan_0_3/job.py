"""The job a 0.3 launch runs: its checks before any process group, and what the plugin's jobs need of 0.3.

``trainer.plugin_config(recipe)`` turns a recipe into the plugin trainer's ``Config`` (``trainer.
ContextParallelTrainer.Config``, which builds that trainer) with the settings below
(:func:`apply_plugin_settings`); the trainer, before
``Trainer.__init__`` starts a process group, builds the job's ``JobSpec`` from that config as it stands
then (a CLI override of ``torchtitan.train`` included) and checks it (:func:`launch_of`):
:func:`check_world_size`, :func:`check_hosted` (what 0.3 does not host yet, by name), the files (the
dataset, :func:`check_inputs`: the tokenizer and data files; a checkpoint of 0.2.2), ``prepare.prepare_job``
(``keep_attention = "auto"`` sized, the memory guard).

=========================== ===================================================================
setting                     why
=========================== ===================================================================
``spmd_backend``            ``"partial_dtensor"``: plain tensors in the model (the CP attention
                            runs its own collectives) and the ``fsdp`` mesh over ``dp x cp``
``disable_cuda_graphs``     true: the attention's collectives and host checks are not capturable
``dataloader``              the plugin's global-batch loader (``data``), the recipe's dataset
``hf_assets_path``          the embedded tokenizer for the synthetic datasets
``optimizer``               with ``[optimizer] state_on_host``, the container of AdamW with its
                            moments in host memory (``optimizers.HostStateOptimizers``)
``metrics``                 0.3's processor with the plugin's grouped TensorBoard tags
                            (``metrics.LongContextMetrics``)
``loss``                    cross-entropy over the whole logits (0.2's loss), chunked under
                            ``fused_ce`` (``transforms.loss_config``)
``model_spec``              separate Q/K/V under a CP mode (``flavors.with_separate_qkv``)
=========================== ===================================================================
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models.common.attention import ScaledDotProductAttention

from titan_upipe.data.local_text import LOCAL_TEXT_DATASET
from titan_upipe.data.synthetic import SYNTHETIC_DATASETS
from titan_upipe.data.tokenizer import embedded_tokenizer_dir
from titan_upipe.errors import ConfigError, with_suggestion
from titan_upipe.spec.cp_layout import CPMode, check_sequence_length, cp_mode
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.spec.tsp_shards import tsp_job_problems
from titan_upipe.torchtitan_0_3 import torch_compat
from titan_upipe.torchtitan_0_3.checkpoints import check_checkpoint_version
from titan_upipe.torchtitan_0_3.data import GlobalBatchDataLoader, check_dataset
from titan_upipe.torchtitan_0_3.flavors import with_separate_qkv
from titan_upipe.torchtitan_0_3.job_spec import job_spec
from titan_upipe.torchtitan_0_3.metrics import long_context_metrics
from titan_upipe.torchtitan_0_3.model_classes import register_model_classes
from titan_upipe.torchtitan_0_3.optimizers import check_host_state, host_state_optimizers
from titan_upipe.torchtitan_0_3.prepare import prepare_job
from titan_upipe.torchtitan_0_3.recipe import Recipe
from titan_upipe.torchtitan_0_3.transforms import loss_config
from titan_upipe.torchtitan_common import cpu_runtime, job_inputs
from titan_upipe.transforms import TRANSFORM_NAMES


@dataclass
class Launch:
    """One launch's job: what it is and where its sequence runs."""

    spec: JobSpec
    compute_dtype: torch.dtype
    """The attention inputs' dtype (FSDP's parameter dtype)."""
    on_nonfinite: str = "stop"
    """``training.on_nonfinite``: what a step with a NaN or infinite loss or gradient norm does."""
    eos_id: int | None = None
    """The token that ends a packed document (the tokenizer's EOS) where the flavor packs documents."""
    cp_mesh: DeviceMesh | None = None
    """The CP attention's mesh (``parallel.layout_mesh`` of TorchTitan's ``cp`` mesh): set once the
    process groups exist; None without CP."""


def check_world_size(parallelism, world_size: int) -> None:
    """ConfigError when the configured degrees do not make the launch's ranks (TorchTitan 0.3 would stop
    inside ``ParallelDims`` after the process group started)."""
    others = parallelism.context_parallel_degree * parallelism.data_parallel_replicate_degree
    shard = parallelism.data_parallel_shard_degree
    if (world_size % others if shard == -1 else shard * others != world_size):
        made = f"{others} x data_parallel_shard_degree" if shard == -1 else str(shard * others)
        raise ConfigError(f"the launch has {world_size} ranks but parallelism's degrees make {made} (context "
                          f"{parallelism.context_parallel_degree} x data-parallel replicate "
                          f"{parallelism.data_parallel_replicate_degree} x shard {shard}): launch a multiple of "
                          f"{others} ranks, or set the degrees to multiply to {world_size}")


def _unhosted(what: str, valid: str) -> ConfigError:
    return ConfigError(f"{what} is not run on TorchTitan 0.3 yet: valid values there are {valid}; drop it or run on "
                       "TorchTitan 0.2.2 (docs/torchtitan_versions.md)")


def check_hosted(recipe: Recipe, spec: JobSpec) -> None:
    """ConfigError naming the first setting of the job that TorchTitan 0.3 does not host yet (or that its
    launch would refuse only after the process groups started)."""
    converters = [m.value for m in CPMode] + list(TRANSFORM_NAMES)
    for name in recipe.converters:
        if name not in converters:
            raise ConfigError(with_suggestion(f"unknown model.converters entry {name!r}: valid converters on TorchTitan "
                                              f"0.3 are {', '.join(converters)}", name, converters))
    if spec.mode is CPMode.TSP:
        check_tsp(recipe, spec)
    if spec.optimizer_state_on_host:
        check_host_state(recipe.trainer.optimizer)
    if spec.fused_rope and spec.layout.mode is None:
        raise ConfigError("fused_rope on TorchTitan 0.3 rotates Q/K in place inside the plugin's context-parallel "
                          "attention: add a CP converter (ulysses, upipe, ring, usp) to model.converters, or drop "
                          "fused_rope")
    if spec.cpu_offload and spec.ac_mode != "full":
        raise ConfigError(f"activation_checkpoint.cpu_offload checkpoints whole blocks: valid modes with it are "
                          f"\"full\", got {spec.ac_mode!r}")
    if spec.documents and spec.layout.mode is None:
        raise ConfigError(f"model.flavor = {recipe.flavor!r} packs documents, which the plugin's context-parallel "
                          "attention applies on TorchTitan 0.3: add a CP converter (ulysses, upipe, ring, usp) to "
                          "model.converters, or use a causal flavor (debug)")
    if spec.keep_attention != "off" and (spec.layout.mode is None or not spec.cpu_offload):
        raise ConfigError("activation_checkpoint.keep_attention keeps the plugin's context-parallel attention inside "
                          "offloaded checkpointing: valid with a CP converter (ulysses, upipe, ring, usp, tsp) and "
                          "activation_checkpoint.cpu_offload = true; else set keep_attention = \"off\"")
    check_validation(recipe.trainer, spec)


def check_tsp(recipe: Recipe, spec: JobSpec) -> None:
    """``model.converters = ["tsp"]``: the rules both versions share (``spec.tsp_shards.tsp_job_problems``),
    then what 0.3's models add: no packed documents, no tied embeddings (every problem in one ConfigError)."""
    model, trainer = spec.model, recipe.trainer
    problems = tsp_job_problems(model.n_heads, model.n_kv_heads, model.ffn_dim, spec.cp_degree,
                                kv_heads_per_bucket=spec.tsp_kv_heads_per_bucket, converters=list(recipe.converters),
                                data_parallel=spec.world_size // spec.cp_degree,
                                param_offload=trainer.training.enable_cpu_offload,
                                state_on_host=spec.optimizer_state_on_host)
    if spec.documents:
        problems.append(f"model.flavor = {recipe.flavor!r} packs documents; TSP attention is causal over the whole "
                        "sequence (no document masks yet): use a causal flavor (e.g. debug)")
    if model.tied:
        problems.append(f"model.flavor = {recipe.flavor!r} ties the embedding and the output weights, which the TSP "
                        "job's FSDP wrapping keeps apart: use a flavor without weight tying")
    if problems:
        raise ConfigError("; ".join(problems))


def check_inputs(recipe: Recipe, spec: JobSpec) -> None:
    """The tokenizer and the data files the job reads, opened as it will open them
    (``torchtitan_common.job_inputs``, the checks 0.2.2's launch runs, the same messages)."""
    trainer, validator = recipe.trainer, recipe.trainer.validator
    paths = validator.dataloader.paths
    job_inputs.check_dataset(trainer.dataloader.dataset, recipe.plugin["local_data"],
                             validator.dataloader.dataset if validator.enable else None, paths[0] if paths else None)
    job_inputs.check_tokenizer(trainer.dataloader.dataset, trainer.hf_assets_path, model_name=recipe.model_name,
                               flavor=recipe.flavor, documents=spec.documents, vocab_size=spec.model.vocab)


def check_torchtitan_settings(config, spec: JobSpec) -> None:
    """What 0.3's own trainer would refuse, or the plugin not run, once its process groups started: tensor
    and pipeline parallelism, compile, its ``seq_len % (2 x cp)`` rule."""
    parallelism = config.parallelism
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "expert_parallel_degree"):
        if getattr(parallelism, key, 1) != 1:
            raise _unhosted(f"parallelism.{key} = {getattr(parallelism, key)}", "1 (context parallelism and FSDP)")
    if config.compile.enable:
        raise _unhosted("compile.enable", "false")
    cp = parallelism.context_parallel_degree
    if cp > 1 and config.training.seq_len % (2 * cp):
        raise ConfigError(f"training.seq_len = {config.training.seq_len} is not divisible by 2 x "
                          f"context_parallel_degree = {2 * cp}, which TorchTitan 0.3 requires of every CP job: use a "
                          f"multiple of {2 * cp}")


def check_validation(trainer, spec: JobSpec) -> None:
    """``[validation]`` as the 0.3 validator runs it: the plugin's datasets, the tokenizer the training uses,
    at most the training's length (the RoPE table's), split as the layout splits."""
    validator = trainer.validator
    if not validator.enable:
        return
    loader = validator.dataloader
    check_dataset(loader.dataset, "validation.dataset")
    if validator.steps < 1:
        raise ConfigError(f"validation.steps = {validator.steps}: valid values are a positive number of steps")
    if (loader.dataset in SYNTHETIC_DATASETS) != (trainer.dataloader.dataset in SYNTHETIC_DATASETS):
        raise ConfigError(f"validation.dataset = {loader.dataset!r} and training.dataset = "
                          f"{trainer.dataloader.dataset!r} use different tokenizers (the synthetic datasets bring "
                          "their own): validate on a dataset of the training's kind")
    if loader.dataset == LOCAL_TEXT_DATASET and not loader.paths:
        raise ConfigError("validation.dataset = 'local_text' reads validation.dataset_path: set it to the held-out "
                          "files' glob (e.g. \"/data/val/*.jsonl\")")
    seq_len = validator.validation_seq_len or spec.seq_len
    if seq_len > spec.seq_len:
        raise ConfigError(f"validation.seq_len = {seq_len} is longer than training.seq_len = {spec.seq_len} (the "
                          f"RoPE table's length): valid values are at most {spec.seq_len}")
    if spec.layout.mode is not None:
        check_sequence_length(seq_len, spec.layout.ring_degree, spec.layout.ulysses_degree, "validation.seq_len")


def apply_plugin_settings(trainer, recipe: Recipe) -> None:
    """What the plugin's jobs need of 0.3 (module table), set on ``trainer`` (a ``Trainer.Config``)."""
    trainer.parallelism.spmd_backend = "partial_dtensor"
    trainer.training.disable_cuda_graphs = True
    dataset = trainer.dataloader.dataset
    local = recipe.plugin["local_data"]
    trainer.dataloader = GlobalBatchDataLoader.Config(dataset=dataset, paths=list(local.paths), text_key=local.text_key,
                                                      skip_bad_records=local.skip_bad_records)
    validation = trainer.validator.dataloader
    validation.text_key, validation.skip_bad_records = local.text_key, local.skip_bad_records
    if dataset in SYNTHETIC_DATASETS:
        trainer.hf_assets_path = embedded_tokenizer_dir()
    if recipe.plugin["optimizer"].state_on_host:
        trainer.optimizer = host_state_optimizers(trainer.optimizer)
    trainer.metrics = long_context_metrics(trainer.metrics)
    if cp_mode(list(recipe.converters)) is not None:
        with_separate_qkv(trainer.model_spec.model)
    else:  # 0.3's flavors attend with flex masks built from per-document positions, which the plugin's loader,
        causal_sdpa(trainer.model_spec.model)  # causal rows as on 0.2, does not give: SDPA, causal


def causal_sdpa(model_config) -> None:
    """Every block's inner attention as 0.3's causal SDPA (the plugin's debug flavors have it already)."""
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def fit_rope(config) -> None:
    """Each attention's RoPE table at least ``training.seq_len`` long: 0.3 refuses a longer sequence than a
    flavor's ``max_seq_len`` (131072 for Llama3) after the process groups started; 0.2 sized its table to
    the sequence."""
    for layer in config.model_spec.model.layers:
        rope = layer.attention.rope
        rope.max_seq_len = max(rope.max_seq_len, config.training.seq_len)


def checked_spec(recipe: Recipe, world_size: int | None, files: bool = True) -> JobSpec:
    """The recipe's ``JobSpec`` on ``world_size`` ranks (None: the configured degrees' product) once every
    pre-launch check passed (ConfigError: the first that fails). The launch and ``validate`` both run these;
    ``files=False`` (``validate --no-assets``, the parity check, which draws its own tokens and loads no
    checkpoint): all but the dataset, the tokenizer and data files and the checkpoint's version."""
    spec = job_spec(recipe, world_size)
    check_world_size(recipe.trainer.parallelism, spec.world_size)
    check_torchtitan_settings(recipe.trainer, spec)
    check_hosted(recipe, spec)
    if files:
        check_dataset(recipe.trainer.dataloader.dataset)
        check_inputs(recipe, spec)
        check_checkpoint_version(recipe.trainer)
    return spec


def launch_of(config) -> Launch:
    """The launch's job of a plugin trainer's ``config`` (its ``recipe`` with the config as it stands now),
    checked for this launch's ranks (``WORLD_SIZE``) before any process group; sets the config's loss."""
    recipe = dataclasses.replace(config.recipe, trainer=config)
    spec = checked_spec(recipe, int(os.environ.get("WORLD_SIZE", "1")))
    fit_rope(config)
    spec = prepare_job(spec)  # kept attention sized for this machine, the memory guard
    cpu_runtime.activate()  # TorchTitan picks CUDA at import; on a machine without one, the CPU and gloo
    torch_compat.activate()  # TorchTitan 0.3.0 calls a torch function 2.11 and 2.13 lack
    register_model_classes()
    config.loss = loss_config(spec, config.validator.validation_seq_len if config.validator.enable else 0)
    return Launch(spec, TORCH_DTYPE_MAP[spec.param_dtype], recipe.plugin["training"].on_nonfinite)



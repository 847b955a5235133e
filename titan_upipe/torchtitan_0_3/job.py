"""The job a 0.3 launch runs: its checks before any process group, and what the plugin's jobs need of 0.3.

``trainer.plugin_config(recipe)`` turns a recipe into the plugin trainer's ``Config`` (``trainer.
ContextParallelTrainer.Config``, which builds that trainer) with the settings below
(:func:`apply_plugin_settings`); the trainer, before
``Trainer.__init__`` starts a process group, builds the job's ``JobSpec`` from that config as it stands
then (a CLI override of ``torchtitan.train`` included) and checks it (:func:`launch_of`):
:func:`check_world_size`, :func:`check_hosted` (what 0.3 does not host yet, by name, and a checkpoint of
0.2.2), ``prepare.prepare_job`` (``keep_attention = "auto"`` sized, the memory guard).

=========================== ===================================================================
setting                     why
=========================== ===================================================================
``spmd_backend``            ``"partial_dtensor"``: plain tensors in the model (the CP attention
                            runs its own collectives) and the ``fsdp`` mesh over ``dp x cp``
``disable_cuda_graphs``     true: the attention's collectives and host checks are not capturable
``dataloader``              the plugin's global-batch loader (``data``), the recipe's dataset
``hf_assets_path``          the embedded tokenizer for the synthetic datasets
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

from titan_upipe.data.synthetic import SYNTHETIC_DATASETS
from titan_upipe.data.tokenizer import embedded_tokenizer_dir
from titan_upipe.errors import ConfigError
from titan_upipe.spec.cp_layout import CPMode
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.torchtitan_0_3 import torch_compat
from titan_upipe.torchtitan_0_3.checkpoints import check_checkpoint_version
from titan_upipe.torchtitan_0_3.data import GlobalBatchDataLoader, check_dataset
from titan_upipe.torchtitan_0_3.flavors import with_separate_qkv
from titan_upipe.torchtitan_0_3.job_spec import job_spec
from titan_upipe.torchtitan_0_3.model_classes import register_model_classes
from titan_upipe.torchtitan_0_3.prepare import prepare_job
from titan_upipe.torchtitan_0_3.recipe import Recipe
from titan_upipe.torchtitan_0_3.transforms import loss_config
from titan_upipe.torchtitan_common import cpu_runtime


@dataclass
class Launch:
    """One launch's job: what it is and where its sequence runs."""

    spec: JobSpec
    compute_dtype: torch.dtype
    """The attention inputs' dtype (FSDP's parameter dtype)."""
    cp_mesh: DeviceMesh | None = None
    """The CP attention's mesh (``parallel.layout_mesh`` of TorchTitan's ``cp`` mesh): set once the
    process groups exist; None without CP."""


NOT_HOSTED_YET = {"tsp": "TSP"}
"""``model.converters`` that run on TorchTitan 0.2.2 only so far (issue 44)."""


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


def check_hosted(recipe: Recipe, spec: JobSpec) -> None:
    """ConfigError naming the first setting of the job that TorchTitan 0.3 does not host yet."""
    for name in recipe.converters:
        if name in NOT_HOSTED_YET:
            raise ConfigError(f"model.converters = [{name!r}] ({NOT_HOSTED_YET[name]}) is not run on TorchTitan 0.3 yet: "
                              f"valid converters on 0.3 are {', '.join(m.value for m in CPMode if m is not CPMode.TSP)}; "
                              "drop it or run on TorchTitan 0.2.2 (docs/torchtitan_versions.md)")
    if spec.optimizer_state_on_host:
        raise ConfigError("optimizer.state_on_host is not run on TorchTitan 0.3 yet: valid values there are false; "
                          "drop it or run on TorchTitan 0.2.2 (docs/torchtitan_versions.md)")
    if spec.keep_attention != "off" and (spec.layout.mode is None or not spec.cpu_offload):
        raise ConfigError("activation_checkpoint.keep_attention keeps the plugin's context-parallel attention inside "
                          "offloaded checkpointing: valid with a CP converter (ulysses, upipe, ring, usp) and "
                          "activation_checkpoint.cpu_offload = true; else set keep_attention = \"off\"")
    check_dataset(recipe.trainer.dataloader.dataset)
    if recipe.trainer.validator.enable:
        check_dataset(recipe.trainer.validator.dataloader.dataset, "validation.dataset")
    check_checkpoint_version(recipe.trainer)


def apply_plugin_settings(trainer, recipe: Recipe) -> None:
    """What the plugin's jobs need of 0.3 (module table), set on ``trainer`` (a ``Trainer.Config``)."""
    trainer.parallelism.spmd_backend = "partial_dtensor"
    trainer.training.disable_cuda_graphs = True
    dataset = trainer.dataloader.dataset
    local = recipe.plugin["local_data"]
    trainer.dataloader = GlobalBatchDataLoader.Config(dataset=dataset, paths=list(local.paths), text_key=local.text_key,
                                                      skip_bad_records=local.skip_bad_records)
    if dataset in SYNTHETIC_DATASETS:
        trainer.hf_assets_path = embedded_tokenizer_dir()
    if any(name in (m.value for m in CPMode) for name in recipe.converters):
        with_separate_qkv(trainer.model_spec.model)


def launch_of(config) -> Launch:
    """The launch's job of a plugin trainer's ``config`` (its ``recipe`` with the config as it stands now),
    checked for this launch's ranks (``WORLD_SIZE``) before any process group; sets the config's loss."""
    recipe = dataclasses.replace(config.recipe, trainer=config)
    spec = job_spec(recipe, int(os.environ.get("WORLD_SIZE", "1")))
    check_world_size(config.parallelism, spec.world_size)
    check_hosted(recipe, spec)
    spec = prepare_job(spec)  # kept attention sized for this machine, the memory guard
    cpu_runtime.activate()  # TorchTitan picks CUDA at import; on a machine without one, the CPU and gloo
    torch_compat.activate()  # TorchTitan 0.3.0 calls a torch function 2.11 and 2.13 lack
    register_model_classes()
    config.loss = loss_config(spec)
    return Launch(spec, TORCH_DTYPE_MAP[spec.param_dtype])



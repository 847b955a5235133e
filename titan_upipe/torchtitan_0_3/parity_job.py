"""The parity check's job on TorchTitan 0.3 (``tools.parity``, through ``adapter.adapter_module``): the names
of the 0.2 adapter's ``parity_job``, built from a recipe.

* :func:`parity_job` reads the recipe (data-parallel degrees 1, ``--seq-len``) into the plugin trainer's
  config (``trainer.plugin_config``: separate Q/K/V under a CP mode, causal SDPA otherwise).
* :class:`ParityJob` checks it before any process group (``job.checked_spec`` without the files: the
  check draws its own tokens; the memory guard, ``prepare.prepare_job``), then builds both models from
  the config's ``model_spec``: the reference as 0.3 builds it, the parallel one converted as
  ``parallelize`` converts (CP attention or TSP blocks, then the memory transforms; no AC, no FSDP),
  on the CP mesh ``layout_mesh`` makes of a 1-D ``cp`` mesh. Weights: 0.3's ``init_weights`` under the
  seed, the reference's copied into the parallel model (TSP's DTensors sliced).
* The loss is the sum of the cross-entropy over the logits (0.3's models return logits; ``fused_ce``
  chunks the loss there, which the e2e tests compare).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.config import TORCH_DTYPE_MAP

from titan_upipe.parallel.mesh import layout_mesh
from titan_upipe.spec.cp_layout import CPMode
from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.torchtitan_0_3.job import Launch, checked_spec, fit_rope
from titan_upipe.torchtitan_0_3.model_classes import register_model_classes
from titan_upipe.torchtitan_0_3.parallelize import convert_cp_attention, convert_tsp_blocks
from titan_upipe.torchtitan_0_3.prepare import prepare_job
from titan_upipe.torchtitan_0_3.recipe import Recipe, load_recipe
from titan_upipe.torchtitan_0_3.trainer import plugin_config
from titan_upipe.torchtitan_0_3.transforms import apply_transforms
from titan_upipe.torchtitan_common import cpu_runtime

__all__ = ["ParityJob", "parity_job", "rank_device"]


def rank_device() -> torch.device:
    """This process's compute device (TorchTitan pointed at the CPU where there is no GPU)."""
    cpu_runtime.activate()
    return cpu_runtime.compute_device()


@dataclass
class ParityJob:
    """A parity run's job (data-parallel degrees 1): parsed, then checked step by step (``tools.parity``
    words the refusals between the steps), then built."""

    recipe: Recipe
    config: Any
    """The plugin trainer's ``Config`` of the recipe."""
    spec: JobSpec | None = None
    """Set by :meth:`check`."""
    ignore_index: int = IGNORE_INDEX
    """The label the loss skips."""
    _titan_cp_mesh: Any = None
    _cp_mesh: Any = None

    @property
    def config_file(self) -> str:
        return self.recipe.path

    @property
    def converters(self) -> tuple[str, ...]:
        return self.recipe.converters

    @property
    def cp_degree(self) -> int:
        return self.config.parallelism.context_parallel_degree

    def check(self, world_size: int) -> JobSpec:
        """The launch's checks for ``world_size`` ranks but the files; the spec. Raises ConfigError."""
        self.spec = checked_spec(dataclasses.replace(self.recipe, trainer=self.config), world_size, files=False)
        fit_rope(self.config)
        return self.spec

    def check_memory(self, world_size: int, device: torch.device, batch: int) -> None:
        """The memory guard for ``batch`` sequences a rank (``keep_attention = "auto"`` sized too). Raises
        ConfigError."""
        self.spec = prepare_job(dataclasses.replace(self.spec, local_batch=batch))

    def build_models(self, device: torch.device, dtype: torch.dtype, seed: int):
        """(reference, parallel, vocab) with the same weights (module docstring). Call once the process group
        exists."""
        register_model_classes()
        spec = self.spec
        if spec.mode is not None:
            self._titan_cp_mesh = init_device_mesh(device.type, (self.cp_degree,), mesh_dim_names=("cp",))
            self._cp_mesh = layout_mesh(self._titan_cp_mesh, spec.layout)
        model_config = self.config.model_spec.model
        reference = _initialized(model_config, device, seed)
        launch = Launch(spec, TORCH_DTYPE_MAP[spec.param_dtype], cp_mesh=self._cp_mesh)
        parallel = _initialized(model_config, device, seed, lambda model: self._convert(model, launch))
        parameters = dict(reference.named_parameters())
        # A full state dict of the parameters (buffers are each model's own RoPE tables): plain ones
        # copied, DTensor ones (tsp's sharded weights) sliced.
        assert set(parameters) == {name for name, _ in parallel.named_parameters()}
        set_model_state_dict(parallel, {name: p.detach() for name, p in parameters.items()},
                             options=StateDictOptions(full_state_dict=True, strict=False))
        return reference, parallel, spec.model.vocab

    @staticmethod
    def _convert(model, launch: Launch) -> None:
        if launch.spec.mode is CPMode.TSP:
            convert_tsp_blocks(model, launch)
        elif launch.cp_mesh is not None:
            convert_cp_attention(model, launch)
        apply_transforms(model, launch.spec)

    def loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The cross-entropy of the logits ``pred`` ``[B, S, V]``, summed over the tokens (fp32)."""
        return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                               ignore_index=self.ignore_index)

    def cp_mesh(self):
        """The mesh the CP attention was converted on."""
        return self._cp_mesh

    def cp_group(self):
        """The group of all CP ranks (the attention's mesh may be 2-D)."""
        return self._titan_cp_mesh.get_group()


def _initialized(model_config, device: torch.device, seed: int, convert=None) -> torch.nn.Module:
    """``model_config`` built on the meta device (``convert(model)`` applied there, as ``parallelize``
    converts), materialised on ``device``, initialised by 0.3's ``init_weights`` under ``seed``."""
    with torch.device("meta"):
        model = model_config.build()
    if convert is not None:
        convert(model)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def parity_job(titan_args: list[str], seq_len: int | None) -> ParityJob:
    """The job of ``titan_args`` as the check runs it: data-parallel degrees 1, ``seq_len`` when given.
    Raises ConfigError (the file, a key, a value)."""
    overrides = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree", "1"]
    if seq_len:
        overrides += ["--training.seq_len", str(seq_len)]
    recipe = load_recipe([*titan_args, *overrides])
    return ParityJob(recipe, plugin_config(recipe))

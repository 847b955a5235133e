"""One rank's model, built from a job config as TorchTitan's trainer builds it.

The one rank builder of the tools, in the adapter (it speaks TorchTitan 0.2.2's train specs,
converters and ``ParallelDims``): the rank emulator (``emulate.measure_step``) and the parity check
(``titan_upipe.check``) both call :func:`build_rank_model`, which follows the trainer's
order: train spec; flavor args (``titan_upipe.torchtitan_0_2.flavors.flavor_args``: the flavor plus
``update_from_config``); the model on the ``meta`` device; ``model.converters``
(CP attention, memory transforms); the spec's ``parallelize_fn`` (activation
checkpointing, then FSDP); ``to_empty`` on the compute device; ``init_weights`` under a
fixed seed. :func:`build_training_rank` adds what a training step needs on top: the spec's
optimizers, its loss and the trainer's autocast context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.protocols.model_converter import build_model_converters
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec

from titan_upipe.optim.host_adamw import AMSGRAD_MOMENTS, HostStateAdamW
from titan_upipe.torchtitan_0_2.checks.parallelism import data_parallel_shard_degree
from titan_upipe.torchtitan_0_2.flavors import flavor_args
from titan_upipe.torchtitan_0_2.registry import register_plugin
from titan_upipe.torchtitan_common import cpu_runtime


def rank_device() -> torch.device:
    """This process's compute device: ``cuda:LOCAL_RANK`` when TorchTitan runs on CUDA, else the CPU."""
    register_plugin()  # it points TorchTitan at the CPU where there is no GPU (idempotent)
    return cpu_runtime.compute_device()


def param_dtype_of(job_config) -> torch.dtype:
    """The compute dtype of the parameters (``training.mixed_precision_param``), as the trainer reads it."""
    return TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]


def build_parallel_dims(job_config, world_size: int) -> ParallelDims:
    """The job's ``ParallelDims`` (FSDP x replicate x CP; no TP, PP or EP) with its device mesh built."""
    register_plugin()  # the mesh is built on TorchTitan's device type: the CPU where there is no GPU
    par = job_config.parallelism
    parallel_dims = ParallelDims(dp_shard=data_parallel_shard_degree(par, world_size),
                                 dp_replicate=par.data_parallel_replicate_degree, cp=par.context_parallel_degree,
                                 tp=1, pp=1, ep=1, etp=1, world_size=world_size)
    parallel_dims.build_mesh()
    return parallel_dims


@dataclass
class RankModel:
    """A model as one rank holds it, with the train spec and model args it was built from."""

    spec: TrainSpec
    args: Any
    """The flavor's model args after ``update_from_config`` (and the ``n_layers`` override)."""
    model: torch.nn.Module
    n_layers_full: int
    """Blocks of the configured flavor (``args.n_layers`` may be fewer)."""


def build_rank_model(job_config, parallel_dims: ParallelDims, device: torch.device, *, seed: int,
                     n_layers: int | None = None, convert: bool = True, parallelize: bool = True,
                     attn_type: str | None = None) -> RankModel:
    """Build the configured model for one rank in the trainer's order (module docstring).

    ``n_layers``: build this many transformer blocks instead of the flavor's.
    ``convert=False``: TorchTitan's model without ``model.converters`` (the parity reference).
    ``parallelize=False``: skip the spec's ``parallelize_fn`` (no AC, no FSDP: every rank holds
    the whole model). ``attn_type``: TorchTitan's attention kernel instead of the flavor's (the
    parity check's per-document reference runs ``sdpa``; the weights do not depend on it).
    Weights come from ``init_weights`` after ``torch.manual_seed(seed)``.
    """
    register_plugin()
    spec = get_train_spec(job_config.model.name)
    args = flavor_args(job_config)
    if attn_type is not None:
        args.attn_type = attn_type
    n_full = args.n_layers
    if n_layers is not None:
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        args.n_layers = n_layers
    with torch.device("meta"):
        model = spec.model_cls(args)
    if convert:
        build_model_converters(job_config, parallel_dims).convert(model)
    if parallelize:
        model = spec.parallelize_fn(model, parallel_dims, job_config)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        # buffer_device None: the RoPE table goes where to_empty put the model, as in the trainer.
        model.init_weights(buffer_device=None)
    model.train()
    return RankModel(spec, args, model, n_full)


def build_loss_fn(spec: TrainSpec, job_config, parallel_dims: ParallelDims) -> Callable:
    """The spec's loss, called as the trainer calls its builder."""
    return spec.build_loss_fn(job_config, parallel_dims=parallel_dims)


def is_layer_parameter(name: str) -> bool:
    """Whether a parameter belongs to a transformer block (``layers.<i>.``), not the embedding/norm/head."""
    return name.startswith("layers.") or ".layers." in name


@dataclass
class TrainingRank:
    """The model, optimizers and loss of one rank, built as TorchTitan's trainer builds them."""

    model: torch.nn.Module
    optimizers: Any
    loss_fn: Callable
    amp: Any
    """The trainer's autocast context (a no-op under FSDP's mixed precision)."""
    parallel_dims: ParallelDims
    n_layers: int
    n_layers_full: int
    vocab_size: int
    names: dict[int, str]
    """Parameter name by ``id(parameter)``."""
    documents: bool = False
    """The flavor's ``attn_mask_type`` is ``block_causal``: steps run packed documents under their mask."""

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def layer_ids(self) -> set[int]:
        """``id`` of every transformer-block parameter."""
        return {id(p) for p in self.params if is_layer_parameter(self.names[id(p)])}

    def optimizer_tensors(self, only: set[int] | None = None) -> list[torch.Tensor]:
        """Tensors of the optimizers' per-parameter state on the device (``only``: of these parameter
        ids). ``HostStateAdamW``'s moments (``[optimizer] state_on_host``) live in host memory by
        design and are left out, on CPU too, where host and device are the same memory."""
        tensors: list[torch.Tensor] = []
        for optimizer in getattr(self.optimizers, "optimizers", [self.optimizers]):
            on_host = AMSGRAD_MOMENTS if isinstance(optimizer, HostStateAdamW) else ()
            for param, state in optimizer.state.items():
                if only is None or id(param) in only:
                    tensors.extend(v for k, v in state.items() if isinstance(v, torch.Tensor) and k not in on_host)
        return tensors

    def materialize_optimizer_state(self) -> None:
        """Adam's moments exist before a steady-state step: one optimizer step on zero gradients."""
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizers.step()
        self.optimizers.zero_grad()


def build_training_rank(job_config, world_size: int, device: torch.device, n_layers: int | None) -> TrainingRank:
    """One rank of a ``world_size``-rank job ready to train: :func:`build_rank_model` (converted,
    parallelized, seeded with ``debug.seed``), the spec's optimizers and loss, the trainer's autocast."""
    parallel_dims = build_parallel_dims(job_config, world_size)
    built = build_rank_model(job_config, parallel_dims, device, seed=job_config.debug.seed, n_layers=n_layers)
    model = built.model
    optimizers = built.spec.build_optimizers_fn([model], job_config.optimizer, parallel_dims)
    loss_fn = build_loss_fn(built.spec, job_config, parallel_dims)
    amp = dist_utils.maybe_enable_amp(parallel_dims, job_config.training.mixed_precision_param, device.type)
    names = {id(p): name for name, p in model.named_parameters()}
    return TrainingRank(model, optimizers, loss_fn, amp, parallel_dims, built.args.n_layers, built.n_layers_full,
                        built.args.vocab_size, names,
                        documents=getattr(built.args, "attn_mask_type", "causal") == "block_causal")

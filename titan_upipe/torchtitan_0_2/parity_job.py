"""The parity check's job on TorchTitan 0.2.2 (``tools.parity``, through ``adapter.adapter_module``).

:func:`parity_job` reads the job; :class:`ParityJob` checks it before any process group (the job checks,
the memory guard, ``keep_attention = "auto"`` sized), then builds the two models from TorchTitan's train
spec (``rank_model.build_rank_model``: the reference unconverted, the parallel one with the config's
converters; neither parallelized) and gives the spec's loss and the CP mesh the converters used. The
0.3 adapter's ``parity_job`` module has the same names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titan_upipe.spec.job_spec import JobSpec
from titan_upipe.torchtitan_0_2.job_plan import size_keep_attention_of_job
from titan_upipe.torchtitan_0_2.launched_job import launched_job
from titan_upipe.torchtitan_0_2.load_job import checked_job_of, parse_job
from titan_upipe.torchtitan_0_2.loss import IGNORE_INDEX
from titan_upipe.torchtitan_0_2.memory_guard import check_memory_fits, free_machine_memory, local_ranks
from titan_upipe.torchtitan_0_2.rank_model import (
    build_loss_fn,
    build_parallel_dims,
    build_rank_model,
    rank_device,
)

__all__ = ["ParityJob", "parity_job", "rank_device"]


@dataclass
class ParityJob:
    """A parity run's job (data-parallel degrees 1): parsed, then checked step by step (``tools.parity``
    words the refusals between the steps), then built."""

    config: Any
    """TorchTitan 0.2's ``JobConfig``."""
    spec: JobSpec | None = None
    """Set by :meth:`check`."""
    ignore_index: int = IGNORE_INDEX
    """The label the loss skips."""
    _parallel_dims: Any = None
    _loss_fn: Any = None

    @property
    def config_file(self) -> str:
        return self.config.job.config_file

    @property
    def converters(self) -> tuple[str, ...]:
        return tuple(self.config.model.converters)

    @property
    def cp_degree(self) -> int:
        """``parallelism.context_parallel_degree`` as configured."""
        return self.config.parallelism.context_parallel_degree

    def check(self, world_size: int) -> JobSpec:
        """Every job check for ``world_size`` ranks; the spec. Raises ConfigError."""
        self.spec = checked_job_of(self.config, world_size).spec
        return self.spec

    def check_memory(self, world_size: int, device: torch.device, batch: int) -> None:
        """The memory guard (the training step's plan: a lower bound of the check's two unsharded models
        without AC), ``keep_attention = "auto"`` sized for this machine. Raises ConfigError."""
        check_memory_fits(self.config, world_size, free_machine_memory(local_ranks(world_size), device.type),
                          batch=batch)
        size_keep_attention_of_job(self.config, world_size)

    def build_models(self, device: torch.device, dtype: torch.dtype, seed: int):
        """(reference, parallel, vocab): the reference without converters (with packed documents,
        TorchTitan's ``sdpa`` kernel, which the check runs per document), the parallel model with the
        config's converters, both with the reference's weights; neither parallelized (no AC, no FSDP).
        Call once the process group exists (the converters build the CP mesh)."""
        self._parallel_dims = build_parallel_dims(self.config, self.spec.world_size)
        reference = build_rank_model(self.config, self._parallel_dims, device, seed=seed, convert=False,
                                     parallelize=False, attn_type="sdpa" if self.spec.documents else None)
        parallel = build_rank_model(self.config, self._parallel_dims, device, seed=seed, parallelize=False)
        # A full state dict: plain parameters copied, DTensor ones (tsp's sharded weights) sliced.
        set_model_state_dict(parallel.model, reference.model.state_dict(),
                             options=StateDictOptions(full_state_dict=True))
        self._loss_fn = build_loss_fn(parallel.spec, self.config, self._parallel_dims)
        return reference.model, parallel.model, parallel.args.vocab_size

    def loss(self, pred, labels: torch.Tensor) -> torch.Tensor:
        """The train spec's loss of ``pred`` (logits, or ``fused_ce``'s hidden states): a sum over the tokens."""
        return self._loss_fn(pred, labels)

    def cp_mesh(self):
        """The mesh the converters built the CP attention on."""
        return launched_job(self.config, self._parallel_dims).required_cp_mesh()

    def cp_group(self):
        """The group of all CP ranks (the attention's mesh may be 2-D)."""
        return self._parallel_dims.get_mesh("cp").get_group()


def parity_job(titan_args: list[str], seq_len: int | None) -> ParityJob:
    """The job of ``titan_args`` as the check runs it: data-parallel degrees 1, ``seq_len`` when given.
    Raises ConfigError (the file, a flag)."""
    overrides = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.data_parallel_replicate_degree", "1"]
    if seq_len:
        overrides += ["--training.seq_len", str(seq_len)]
    return ParityJob(parse_job([*titan_args, *overrides]))

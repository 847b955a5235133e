"""A batch sharded in the converted attention's sequence layout (training and validation alike).

Every CP rank of a data-parallel group reads the same ``[B, S]`` batch. Rank ``c`` keeps the
``S / C`` tokens that ``titan_upipe.parallel``'s layout gives it (contiguous for Ulysses/UPipe
on the 1-D CP mesh; zigzag over ring x contiguous over Ulysses for ring, USP and UPipe inside
USP) and their global positions, which the attention checks on every forward
(``converters._LayoutCheck``) and RoPE reads. TorchTitan shards head-tail for its own ring
attention; our all-to-alls would join those shards in the wrong order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.distributed import utils as dist_utils

from titan_upipe.attention import sequence_mesh
from titan_upipe.errors import ConfigError
from titan_upipe.parallel import shard_sequence
from titan_upipe.parallel.cp_layout import CP_MODES


def model_sequence_mesh(model_parts: list[nn.Module]) -> DeviceMesh:
    """The mesh of the converted attention (validation refused CP > 1 without a converter)."""
    for part in model_parts:
        mesh = sequence_mesh(part)
        if mesh is not None:
            return mesh
    raise ConfigError("parallelism.context_parallel_degree > 1 but no attention was converted: "
                      f"add one of {', '.join(CP_MODES)} to model.converters")


def shard_batch(input_dict: dict[str, torch.Tensor], labels: torch.Tensor, cp_mesh: DeviceMesh
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    """``(tokens [B, S/C], labels [B, S/C], extra inputs, {"positions": [S/C]})`` of this CP rank:
    the trainer's ``post_dataloading_process`` contract."""
    inputs, positions = shard_sequence(input_dict["input"], cp_mesh, seq_dim=1)
    labels, _ = shard_sequence(labels, cp_mesh, seq_dim=1)
    extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
    return inputs, labels, extra_inputs, {"positions": positions}


def global_valid_tokens(batch_valid: torch.Tensor, batch_mesh: DeviceMesh | None):
    """``Σ_d N_d``: the valid tokens of every data-parallel batch, each counted whole (before CP
    sharding; every CP rank of a batch holds the same count) and summed over the batch mesh."""
    return batch_valid.float() if batch_mesh is None else dist_utils.dist_sum(batch_valid, batch_mesh)

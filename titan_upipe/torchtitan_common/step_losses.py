"""The step's two logged losses from each rank's share, the same on TorchTitan 0.2.2 and 0.3 (both
trainers call it): for ``D`` data-parallel batches of ``N_d`` valid tokens, CP rank ``c`` holding
``loss = L_{d,c} / Σ_d N_d`` (its share of batch ``d``'s loss sum over the global count),

* the global mean ``Σ_{d,c} L_{d,c} / Σ_d N_d`` (the single-device mean): the sum over the loss mesh;
* the worst data-parallel batch ``max_d Σ_c L_{d,c} / N_d``: each batch's CP shares summed first, then
  the max over the loss mesh (TorchTitan's own takes the max over the CP shares as well, about the
  mean / C).
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_reduce
from torchtitan.distributed import utils as dist_utils


def reduce_step_losses(parallel_dims, loss: torch.Tensor, global_valid, batch_valid: torch.Tensor
                       ) -> tuple[float, float]:
    """(global mean, max over data-parallel batches of the batch mean) from this rank's ``loss``;
    ``global_valid`` is ``Σ_d N_d``, ``batch_valid`` this rank's ``N_d``."""
    batch_loss = loss
    if parallel_dims.cp_enabled:
        batch_loss = all_reduce(loss, "sum", parallel_dims.get_mesh("cp"))
    batch_mean = batch_loss * global_valid / batch_valid
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    if loss_mesh is None:
        return loss.item(), batch_mean.item()
    # Every CP rank of a batch holds the same batch mean: the max over the loss mesh is over batches.
    return dist_utils.dist_sum(loss, loss_mesh), dist_utils.dist_max(batch_mean, loss_mesh)

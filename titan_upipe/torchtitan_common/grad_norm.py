"""Gradient-norm clipping over parameters that live on different device meshes.

``tsp`` leaves the model with two kinds of DTensor gradients: FSDP's shards on the ``fsdp`` mesh
and the TSP weights' shards on the TSP (``ring``) mesh. ``torch.nn.utils.get_total_norm`` stacks
the per-tensor norms, and DTensor refuses a stack across meshes; TorchTitan's
``clip_grad_norm_`` splits by mesh only for expert parallelism. Here the gradients are grouped
by mesh and

    ||g||_2 = sqrt( sum over meshes m of ||g_m||_2^2 ),   ||g_m|| reduced over mesh m (full_tensor),

in fp32, then every group is scaled by ``min(1, max_norm / (||g|| + 1e-6))`` (torch's
``clip_grads_with_norm_``, group by group). With one mesh (every other layout) TorchTitan's
``clip_grad_norm_`` runs unchanged (0.2.2's and 0.3's take the same arguments).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torchtitan.distributed import utils as dist_utils


def _mesh_groups(parameters: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            key = param.grad.device_mesh if isinstance(param.grad, DTensor) else None
            groups.setdefault(key, []).append(param)
    return groups


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, foreach: bool | None = None,
                    pp_mesh=None, ep_enabled: bool = False) -> torch.Tensor:
    """Clip the 2-norm of all gradients of ``parameters`` to ``max_norm``; returns the norm before
    clipping (a plain tensor, the same on every rank)."""
    parameters = list(parameters)
    groups = _mesh_groups(parameters)
    if len(groups) <= 1 or ep_enabled or pp_mesh is not None:
        return dist_utils.clip_grad_norm_(parameters, max_norm, foreach=foreach, pp_mesh=pp_mesh,
                                          ep_enabled=ep_enabled)
    squares = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, False, foreach)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum().sqrt()
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach)
    return total

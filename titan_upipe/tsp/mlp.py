"""TSP gated ring MLP (Algorithm 2 of ``../shared/papers/001_*``) on rank ``p``.

``Y = sum_t (silu(X W1_t^T) * X W3_t^T) W2_t`` over the ``D`` shards, where ``W_t`` is the packed
``[W1 | W3 | W2^T]`` shard of rank ``p - t`` (mod D): step ``t`` uses the shard received at step
``t - 1`` from rank ``p - 1`` and sends it on to ``p + 1``. The sequence stays local and only
weights move, so no activation all-reduce. Backward (autograd through ``ring_shift``'s adjoint)
sends each step's weight gradient back around the ring, so every gradient ends at its owner.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_upipe.tsp.collectives import CommLog, ring_shift
from titan_upipe.tsp.shards import TSPShards

Tensor = torch.Tensor


def tsp_gated_mlp(x: Tensor, packed: Tensor, shards: TSPShards, group: dist.ProcessGroup | None,
                  log: CommLog | None = None) -> Tensor:
    """``Y [B, S/D, d]`` for this rank's tokens ``x [B, S/D, d]``; ``packed``: its ``[W1 | W3 | W2^T]``
    shard (``TSPShards.pack_mlp``)."""
    y = None
    shard = packed
    for step in range(shards.degree):
        if step:
            shard = ring_shift(shard, group, log)
        w1, w3, w2_t = shards.unpack_mlp(shard)
        contribution = ((F.silu(F.linear(x, w1)) * F.linear(x, w3)) @ w2_t).float()  # summed in fp32
        y = contribution if y is None else y + contribution
    return y.to(x.dtype)

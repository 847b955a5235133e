"""TSP gated ring MLP (Algorithm 2 of ``../shared/papers/001_*``) on rank ``p``.

Forward: ``Y = sum_t (silu(X W1_t^T) * X W3_t^T) W2_t`` over the ``D`` shards, where ``W_t`` is the
packed ``[W1 | W3 | W2^T]`` shard of rank ``p - t`` (mod D): step ``t`` uses the shard received at
step ``t - 1`` from rank ``p - 1``. The sequence stays local and only weights move, so no
activation all-reduce; ``Y`` is summed over the steps in fp32.

Backward walks the steps in reverse with an fp32 gradient accumulator that travels the ring the
other way: at step ``t`` rank ``p`` adds its tokens' gradient of shard ``p - t`` and sends the sum to
``p - 1``, which holds that shard at step ``t - 1``; after step 0 every rank holds the whole
gradient of its own shard (``D - 1`` fp32 sends). ``dX`` sums the steps in fp32. Saved per step:
the shard, and unless ``recompute`` the two ``[B, S/D, F/D]`` projections. With ``overlap``
each send/receive is started before the step's GEMMs that do not need it and waited for after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_upipe.tsp.collectives import CommLog, nbytes, record, shift, start_shift
from titan_upipe.tsp.shards import TSPShards

Tensor = torch.Tensor


class _RingMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, packed: Tensor, shards: TSPShards, group: dist.ProcessGroup | None,
                log: CommLog | None, overlap: bool, recompute: bool) -> Tensor:
        # The shard computes and travels in x's dtype; its gradient comes back in packed's (fp32 master).
        ctx.shards, ctx.group, ctx.log, ctx.dtype, ctx.overlap = shards, group, log, packed.dtype, overlap
        ctx.recompute = recompute
        shard, saved, y = packed.detach().to(x.dtype), [], None
        for step in range(shards.degree):
            last = step == shards.degree - 1
            if not last:
                record(log, "forward", "ring", nbytes(shard))
            # Overlap: the shard leaves for p + 1 (and p - 1's arrives) while this step's GEMMs run.
            incoming = start_shift(shard, group, +1) if overlap and not last else None
            w1, w3, w2_t = shards.unpack_mlp(shard)
            gate, up = F.linear(x, w1), F.linear(x, w3)
            contribution = ((F.silu(gate) * up) @ w2_t).float()
            y = contribution if y is None else y + contribution
            saved += [shard] if recompute else [shard, gate, up]
            del gate, up
            if not last:
                shard = incoming.wait() if incoming is not None else shift(shard, group, +1)
        ctx.save_for_backward(x, *saved)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, *saved = ctx.saved_tensors
        shards, group = ctx.shards, ctx.group
        tokens = x.reshape(-1, x.shape[-1])
        dy_rows = dy.reshape(-1, dy.shape[-1])
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        grad = None  # fp32 gradient of the shard held at this step, summed over the ranks that held it before
        per_step = 1 if ctx.recompute else 3
        for step in reversed(range(shards.degree)):
            shard, *projections = saved[per_step * step:per_step * (step + 1)]
            w1, w3, w2_t = shards.unpack_mlp(shard)
            # recompute: the step's two [B, S/D, F/D] projections again (two GEMMs), never saved
            gate, up = projections or (F.linear(x, w1), F.linear(x, w3))
            activated = F.silu(gate)
            d_hidden = dy @ w2_t.t()
            d_gate = torch.ops.aten.silu_backward(d_hidden * up, gate)
            d_up = d_hidden * activated
            local = torch.cat([d_gate.reshape(-1, d_gate.shape[-1]).t() @ tokens,
                               d_up.reshape(-1, d_up.shape[-1]).t() @ tokens,
                               (activated * up).reshape(-1, up.shape[-1]).t() @ dy_rows]).float()
            grad = local if grad is None else grad + local
            outgoing = None
            if step:
                record(ctx.log, "backward", "ring", nbytes(grad))
                # Overlap: the accumulator travels to p - 1 while this step's dX GEMMs run.
                outgoing = start_shift(grad, group, -1) if ctx.overlap else None
                if outgoing is None:
                    grad = shift(grad, group, -1)
            dx += (d_gate @ w1 + d_up @ w3).float()
            if outgoing is not None:
                grad = outgoing.wait()
        return dx.to(x.dtype), grad.to(ctx.dtype), None, None, None, None, None


def tsp_gated_mlp(x: Tensor, packed: Tensor, shards: TSPShards, group: dist.ProcessGroup | None,
                  log: CommLog | None = None, overlap: bool = True, recompute: bool = True) -> Tensor:
    """``Y [B, S/D, d]`` for this rank's tokens ``x [B, S/D, d]``; ``packed``: its ``[W1 | W3 | W2^T]``
    shard (``TSPShards.pack_mlp``); ``log``: counts the bytes this rank receives; ``overlap``: each
    ring send/receive runs during the step's GEMMs (async; the same numbers either way);
    ``recompute``: save only the shards and recompute each step's ``X W1^T``, ``X W3^T`` in
    backward (two more GEMMs per step; the ``2 x [B, S/D, F]`` projections of all steps otherwise
    stay saved from forward to backward)."""
    if shards.degree > 1 and group is None:
        raise ValueError(f"a TSP degree of {shards.degree} needs its process group")
    return _RingMLP.apply(x, packed, shards, group, log, overlap and shards.degree > 1, recompute)

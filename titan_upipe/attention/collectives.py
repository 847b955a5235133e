"""The one collective Ulysses-style attention needs: an equal-split all-to-all along dim 0,
and the layout conversions around it.

Layouts (``C`` ranks, ``L = S/C`` local tokens, ``h`` heads per destination rank):

* sequence-sharded heads: ``[B, L, C*h, D]`` (model layout, this rank's tokens)
* all-to-all buffer: ``[C, L, B, h, D]``; chunk ``j`` goes to / came from rank ``j``
* head-sharded: the received buffer viewed as ``[C*L, B, h, D] = [S, B, h, D]``; with the
  contiguous sequence layout source rank ``i`` holds tokens ``[i*L, (i+1)*L)``, so this is
  the full sequence in order, and ``.permute(1, 2, 0, 3)`` is the ``[B, h, S, D]`` view the
  attention kernels take, without a copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def all_to_all(send: Tensor, recv: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Chunk ``j`` of ``send`` (dim 0) to rank ``j``; chunk ``i`` of ``recv`` from rank ``i``."""
    if group is None or dist.get_world_size(group) == 1:
        recv.copy_(send)
    else:
        dist.all_to_all_single(recv, send, group=group)
    return recv


def heads_view(buffer: Tensor) -> Tensor:
    """``[C, L, B, h, D]`` received buffer -> ``[B, h, S, D]`` full-sequence view."""
    c, seq, b, h, d = buffer.shape
    return buffer.view(c * seq, b, h, d).permute(1, 2, 0, 3)


def seq_major(t: Tensor) -> Tensor:
    """``[B, h, S, D]`` -> ``[S, B, h, D]`` view, the order the all-to-all buffers use."""
    return t.permute(2, 0, 1, 3)


class AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: its adjoint is the same exchange applied to the gradient."""

    @staticmethod
    def forward(ctx, send: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        return all_to_all(send.contiguous(), torch.empty_like(send, memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        return all_to_all(grad, torch.empty_like(grad), ctx.group), None


def sequence_to_heads(x: Tensor, cp_degree: int, group: dist.ProcessGroup | None) -> Tensor:
    """Differentiable ``[B, L, C*h, D]`` (my tokens, all heads) -> ``[B, h, S, D]`` (my heads, all tokens)."""
    b, seq, heads, d = x.shape
    if cp_degree == 1:  # no Ulysses ranks (pure ring attention): a view, no copy
        return x.permute(0, 2, 1, 3)
    send = x.view(b, seq, cp_degree, heads // cp_degree, d).permute(2, 1, 0, 3, 4)
    return heads_view(AllToAll.apply(send, group))


def heads_to_sequence(out: Tensor, cp_degree: int, group: dist.ProcessGroup | None) -> Tensor:
    """Differentiable inverse of ``sequence_to_heads``: ``[B, h, S, D]`` -> ``[B, L, C*h, D]``."""
    b, h, s, d = out.shape
    if cp_degree == 1:
        return out.permute(0, 2, 1, 3)
    send = seq_major(out).reshape(cp_degree, s // cp_degree, b, h, d)
    recv = AllToAll.apply(send, group)  # chunk i: heads of rank i for my tokens
    return recv.permute(2, 1, 0, 3, 4).reshape(b, s // cp_degree, cp_degree * h, d)

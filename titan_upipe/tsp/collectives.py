"""Differentiable collectives of a TSP group, each with its adjoint as the backward.

==================================  ===========================================  ==================
forward                             backward (the adjoint)                       cross-rank sum
==================================  ===========================================  ==================
``broadcast_from`` owner ``r``      reduce of every rank's gradient to ``r``     fp32
``start_all_gather`` along ``S``    ``reduce_scatter_stacked`` (all-to-all +     fp32
                                    local sum; ``tsp.attention`` pairs them)
==================================  ===========================================  ==================

``shift`` (send to ``p + step``, receive from ``p - step``) is the MLP ring's move; the ring MLP's
own backward (``tsp.mlp``) sends its fp32 gradient accumulator the other way.

Overlap: ``start_broadcast``, ``start_all_gather`` and ``start_shift`` launch a collective with
``async_op=True`` and return a :class:`Pending`; the differentiable forms take it as ``pending``
and only wait, so the caller can start the next transfer before the current compute (gloo runs
it on its worker thread; NCCL on its own stream).

Gradients are summed in fp32 and cast back to the input's dtype once. The reduce-scatter is an
all-to-all of the gradient's ``D`` chunks followed by a local fp32 sum: the same bytes on the wire
as a reduce-scatter, and gloo (the CPU tests' backend) has no reduce-scatter.

A :class:`CommLog` passed in counts the bytes this rank *receives* per collective kind (a
broadcast's source and a reduce's non-roots receive nothing), forward and backward apart.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

Tensor = torch.Tensor


@dataclass
class CommLog:
    """Bytes received by this rank, by ``(phase, kind)``: phase ``forward``/``backward``; kind
    ``broadcast``, ``reduce``, ``all_gather``, ``reduce_scatter``, ``ring``."""

    received: Counter = field(default_factory=Counter)

    def add(self, phase: str, kind: str, nbytes: int) -> None:
        self.received[(phase, kind)] += nbytes


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def record(log: CommLog | None, phase: str, kind: str, count: int) -> None:
    if log is not None:
        log.add(phase, kind, count)


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclass
class Pending:
    """A collective started with ``async_op=True`` (overlap): its output and what to wait on.
    ``keep`` holds the input alive until the transfer is done."""

    output: Tensor
    works: list
    keep: Tensor | None = None

    def wait(self) -> Tensor:
        for work in self.works:
            work.wait()
        self.keep = None
        return self.output


def start_broadcast(local: Tensor, src: int, group: dist.ProcessGroup, dtype: torch.dtype | None = None) -> Pending:
    """Start broadcasting rank ``src``'s ``local`` (in ``dtype``); ``Pending.wait`` returns it."""
    dtype = dtype or local.dtype
    if dist.get_rank(group) == src:
        buffer = local.detach().to(dtype, copy=True)
    else:
        buffer = torch.empty_like(local, dtype=dtype)
    return Pending(buffer, [dist.broadcast(buffer, src=dist.get_global_rank(group, src), group=group, async_op=True)])


def start_all_gather(local: Tensor, group: dist.ProcessGroup) -> Pending:
    """Start gathering every rank's ``local`` into ``[D, *local.shape]``."""
    local = local.detach().contiguous()
    gathered = torch.empty((dist.get_world_size(group), *local.shape), dtype=local.dtype, device=local.device)
    work = dist.all_gather(list(gathered.unbind(0)), local, group=group, async_op=True)
    return Pending(gathered, [work], keep=local)


def start_shift(t: Tensor, group: dist.ProcessGroup, step: int) -> Pending:
    """Start sending ``t`` to rank ``p + step`` and receiving from ``p - step`` (mod D)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    t = t.contiguous()
    out = torch.empty_like(t)
    ops = [dist.P2POp(dist.isend, t, dist.get_global_rank(group, (rank + step) % size), group),
           dist.P2POp(dist.irecv, out, dist.get_global_rank(group, (rank - step) % size), group)]
    return Pending(out, dist.batch_isend_irecv(ops), keep=t)


class _BroadcastFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: Tensor, src: int, group: dist.ProcessGroup, log: CommLog | None,
                dtype: torch.dtype, pending: Pending | None) -> Tensor:
        ctx.src, ctx.group, ctx.dtype, ctx.log = src, group, local.dtype, log
        ctx.is_src = dist.get_rank(group) == src
        buffer = (pending or start_broadcast(local, src, group, dtype)).wait()
        record(log, "forward", "broadcast", 0 if ctx.is_src else nbytes(buffer))
        return buffer

    @staticmethod
    def backward(ctx, grad: Tensor):
        summed = grad.float().contiguous()
        dist.reduce(summed, dst=dist.get_global_rank(ctx.group, ctx.src), op=dist.ReduceOp.SUM, group=ctx.group)
        others = dist.get_world_size(ctx.group) - 1
        record(ctx.log, "backward", "reduce", others * nbytes(summed) if ctx.is_src else 0)
        return (summed.to(ctx.dtype) if ctx.is_src else None), None, None, None, None, None


def broadcast_from(local: Tensor, src: int, group: dist.ProcessGroup | None, log: CommLog | None = None,
                   dtype: torch.dtype | None = None, pending: Pending | None = None) -> Tensor:
    """Rank ``src``'s ``local`` on every rank (same shape on all), sent and returned in ``dtype``
    (default ``local``'s); its gradient is summed at ``src`` in fp32 and returned in ``local``'s
    dtype: an fp32 master weight cast to bf16 for the wire gets an fp32 gradient, never a bf16
    rounding of the sum (a cast outside this function would round it). ``pending``: this very
    broadcast, already started (``start_broadcast``) to overlap earlier compute."""
    dtype = dtype or local.dtype
    if _size(group) == 1:
        return local.to(dtype)
    return _BroadcastFrom.apply(local, src, group, log, dtype, pending)


def reduce_scatter_stacked(grad: Tensor, group: dist.ProcessGroup, log: CommLog | None = None) -> Tensor:
    """``sum_r grad_r[p]`` in fp32 on rank ``p``, from every rank's ``grad [D, ...]`` (the adjoint of
    ``start_all_gather``): an all-to-all of the fp32 chunks and a local sum."""
    send = grad.float().contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # chunk j to rank j: every rank's grad of my shard
    record(log, "backward", "reduce_scatter", nbytes(send) - nbytes(send[0]))
    return recv.sum(dim=0)


def shift(t: Tensor, group: dist.ProcessGroup, step: int) -> Tensor:
    """Send ``t`` to rank ``p + step`` and receive from ``p - step`` (mod D)."""
    return start_shift(t, group, step).wait()

"""A tensor used ``n`` times whose gradient is summed over the uses in fp32.

TSP's attention uses its input ``X`` and the qk-norm weights once per owner (``D`` times per
block). Autograd sums the gradients of a tensor's uses in that tensor's dtype, so in bf16
training ``dX = sum_r dX_r`` and ``dw_norm = sum_r dw_r`` would round after every owner.
:func:`fp32_summed_uses` returns ``n`` aliases of ``t`` chained so that

    grad t = round_dtype( sum_{i<n} grad alias_i )     (the sum in fp32, one rounding)

Chain (forward left to right, gradients right to left)::

    t --_Source--> c_0 --_Use--> c_1 --_Use--> ... --_Use--> c_n   (c_i: fp32 carriers, shape of t)
                         |             |                   |
                      alias_0       alias_1   ...      alias_{n-1}

``_Use`` ``i`` hands the carrier's gradient (the fp32 sum of uses ``i+1 .. n-1``) on with its own
alias's gradient added; ``_Source`` rounds the total to ``t``'s dtype. The carriers are zero-stride
views of one fp32 zero in forward (no memory); in backward one fp32 buffer the size of ``t`` travels
the chain (the gradient of the last use in backward order starts it). The aliases are views of
``t``: forward values are ``t``'s, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

Tensor = torch.Tensor


class _Source(torch.autograd.Function):
    """``t`` -> the first carrier; backward: the carrier's fp32 gradient in ``t``'s dtype."""

    @staticmethod
    def forward(ctx, t: Tensor) -> Tensor:
        ctx.dtype = t.dtype
        ctx.set_materialize_grads(False)
        return torch.zeros((), dtype=torch.float32, device=t.device).expand(t.shape)

    @staticmethod
    def backward(ctx, total: Tensor | None):
        return None if total is None else total.to(ctx.dtype)


class _Use(torch.autograd.Function):
    """``(carrier, t)`` -> (next carrier, an alias of ``t``); backward adds the alias's gradient
    to the carrier's in fp32."""

    @staticmethod
    def forward(ctx, carrier: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        return carrier.view_as(carrier), t.view_as(t)

    @staticmethod
    def backward(ctx, later: Tensor | None, grad: Tensor | None):
        if grad is None:
            return later, None
        if later is None:  # the last use in backward order starts the fp32 sum (a copy of its own)
            return grad.to(torch.float32, copy=True), None
        # In place: ``later`` is the buffer the next use's backward allocated for this chain, no
        # one else holds it; one fp32 buffer travels the chain instead of one per use.
        return later.add_(grad), None


def iter_fp32_summed_uses(t: Tensor, n: int) -> Iterator[Tensor]:
    """The aliases of :func:`fp32_summed_uses`, each made when it is asked for. Made inside the loop
    over the uses, each ``_Use`` is newer than the uses before it and older than its own: autograd
    (newest node first) then adds every use's gradient into the fp32 sum as soon as that use's
    backward is done, instead of after all of them (``n - 1`` gradients of ``t``'s size waiting in
    the engine's buffers). The same sums in the same order: bitwise the same gradient."""
    if n == 1 or torch.finfo(t.dtype).bits >= 32 or not (torch.is_grad_enabled() and t.requires_grad):
        yield from [t] * n
        return
    carrier = _Source.apply(t)
    for _ in range(n):
        carrier, alias = _Use.apply(carrier, t.detach())
        yield alias


def fp32_summed_uses(t: Tensor, n: int) -> list[Tensor]:
    """``n`` aliases of ``t`` whose gradients reach ``t`` summed in fp32 and rounded once (module
    docstring); ``[t] * n`` where no gradient is recorded or ``t``'s dtype is fp32 or wider (autograd's
    own sum is that precise)."""
    return list(iter_fp32_summed_uses(t, n))

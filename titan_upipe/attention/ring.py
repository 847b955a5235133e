"""Zigzag ring attention over a ring process group, as a local-attention backend.

``RingAttentionBackend`` wraps a local backend (sdpa, math, flash-attn) and has the same
interface: ``forward(q, k, v, scale) -> (out, lse)`` and an explicit
``backward(dout, q, k, v, out, lse, scale)``. Its "sequence" is this rank's ring-local
sequence (its two zigzag chunks, ``titan_upipe.parallel.ZigzagLayout``), and the result is
attention over the whole causal sequence. Ulysses (``LocalAttention``) and UPipe call it
exactly where they call a local kernel, which is how USP and UPipe-inside-USP are built.

Forward: the packed K/V block ``[2, B, h_kv, S_r, D]`` moves one rank along the ring per step
(``batch_isend_irecv`` to ``r+1``, from ``r-1``, started before the step's local attention
and waited after it, so the transfer overlaps the compute). Each step's block calls come
from ``ring_plan.step_calls``; their (out, lse) are merged into fp32 accumulators:
``lse = logaddexp(lse_a, lse_b)``, ``out = e^(lse_a-lse) out_a + e^(lse_b-lse) out_b``.

Backward (flash-attention style, from the merged ``out`` and ``lse``): K/V circulate again;
every block's dQ goes into an fp32 accumulator, and its dK/dV into an fp32 buffer that
travels with the block: after each step it is sent to the next rank, which adds its own
contributions for that block, so after ``R`` sends every block's dK/dV is back at its owner.
The dK/dV buffers travel in fp32 so bf16 rounding does not grow with ``R``.
GQA: only the ``h_kv`` K/V heads travel; the local kernels expand them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_upipe.attention.backends import LocalAttentionBackend
from titan_upipe.attention.ring_plan import BlockCall, BlockRule, causal_block_kind, step_calls

Tensor = torch.Tensor


class RingExchange:
    """Send a tensor to the next ring rank and receive the previous rank's into ``recv``."""

    def __init__(self, send: Tensor, recv: Tensor, group: dist.ProcessGroup, ring_rank: int, ring_size: int) -> None:
        ops = [
            dist.P2POp(dist.isend, send, group=group, group_peer=(ring_rank + 1) % ring_size),
            dist.P2POp(dist.irecv, recv, group=group, group_peer=(ring_rank - 1) % ring_size),
        ]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _rows(t: Tensor, start: int, stop: int, slot_len: int) -> Tensor:
    """Slots ``[start, stop)`` of the sequence dim (dim 2) of a ``[B, h, S_r, ...]`` tensor."""
    return t.narrow(2, start * slot_len, (stop - start) * slot_len)


def merge_partial(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """Fold one block's normalized ``out``/``lse`` into the fp32 accumulators, in place."""
    new_lse = torch.logaddexp(lse_acc, lse)
    out_acc.mul_(torch.exp(lse_acc - new_lse).unsqueeze(-1))
    out_acc.add_(out.float() * torch.exp(lse - new_lse).unsqueeze(-1))
    lse_acc.copy_(new_lse)


class RingAttentionBackend(LocalAttentionBackend):
    name = "ring"

    def __init__(self, local: LocalAttentionBackend, group: dist.ProcessGroup | None, ring_rank: int,
                 ring_size: int, rule: BlockRule = causal_block_kind) -> None:
        self.local, self.group, self.ring_rank, self.ring_size = local, group, ring_rank, ring_size
        self.rule = rule
        """The block rule (the causal one); replaceable only to show the tests catch a wrong rule."""

    def _calls(self, step: int) -> tuple[BlockCall, ...]:
        return step_calls(self.ring_rank, self.ring_size, step, self.rule)

    def _exchange(self, send: Tensor, recv: Tensor) -> RingExchange:
        return RingExchange(send, recv, self.group, self.ring_rank, self.ring_size)

    @staticmethod
    def _slot_len(q: Tensor) -> int:
        if q.shape[2] % 2:
            raise ValueError(f"the ring-local sequence holds two zigzag chunks; got {q.shape[2]} tokens")
        return q.shape[2] // 2

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> tuple[Tensor, Tensor]:
        if not causal:
            raise ValueError("ring attention is causal over the whole sequence")
        slot = self._slot_len(q)
        b, h, s, d = q.shape
        out_acc = torch.zeros(b, h, s, d, dtype=torch.float32, device=q.device)
        lse_acc = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
        kv, kv_next = torch.stack((k, v)), None
        for step in range(self.ring_size):
            exchange = None
            if step < self.ring_size - 1:
                kv_next = torch.empty_like(kv) if kv_next is None else kv_next
                exchange = self._exchange(kv, kv_next)
            for call in self._calls(step):
                out, lse = self.local.forward(
                    _rows(q, call.q_start, call.q_stop, slot), _rows(kv[0], call.kv_start, call.kv_stop, slot),
                    _rows(kv[1], call.kv_start, call.kv_stop, slot), scale, causal=call.causal)
                merge_partial(_rows(out_acc, call.q_start, call.q_stop, slot),
                              _rows(lse_acc, call.q_start, call.q_stop, slot), out, lse)
                del out, lse
            if exchange is not None:
                exchange.wait()
                kv, kv_next = kv_next, kv  # the block just sent is the next receive buffer
        return out_acc.to(q.dtype), lse_acc

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                 causal: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        if not causal:
            raise ValueError("ring attention is causal over the whole sequence")
        slot = self._slot_len(q)
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, kv_next = torch.stack((k, v)), None
        # dK/dV of the block held at a step, fp32 [2, B, h_kv, S_r, D]; two send buffers
        # alternate so the one in flight is never written.
        dkv_send = [torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device) for _ in range(2)]
        dkv_recv = torch.empty_like(dkv_send[0]) if self.ring_size > 1 else None
        pending: RingExchange | None = None
        for step in range(self.ring_size):
            exchange = None
            if step < self.ring_size - 1:
                kv_next = torch.empty_like(kv) if kv_next is None else kv_next
                exchange = self._exchange(kv, kv_next)
            dkv = dkv_send[step % 2]
            dkv.zero_()
            for call in self._calls(step):
                q_rows = (call.q_start, call.q_stop, slot)
                kv_rows = (call.kv_start, call.kv_stop, slot)
                dq, dk, dv = self.local.backward(
                    _rows(dout, *q_rows), _rows(q, *q_rows), _rows(kv[0], *kv_rows), _rows(kv[1], *kv_rows),
                    _rows(out, *q_rows), _rows(lse, *q_rows).contiguous(), scale, causal=call.causal)
                _rows(dq_acc, *q_rows).add_(dq)
                _rows(dkv[0], *kv_rows).add_(dk)
                _rows(dkv[1], *kv_rows).add_(dv)
                del dq, dk, dv
            if pending is not None:
                pending.wait()  # the previous rank's dK/dV of the block this rank holds now
                dkv.add_(dkv_recv)
            if self.ring_size > 1:
                pending = self._exchange(dkv, dkv_recv)
            if exchange is not None:
                exchange.wait()
                kv, kv_next = kv_next, kv
        if pending is not None:
            pending.wait()  # after R sends each block's dK/dV is back at its owner
            own = dkv_recv
        else:
            own = dkv_send[0]
        return dq_acc.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)

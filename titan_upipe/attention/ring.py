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

Packed documents (``documents``, a ``DocumentMask``): the step's calls come from
``ring_plan.document_step_calls`` over the mask's ring runs (the fixed zigzag's chunks, or the
batch's ``DocumentZigzagLayout`` when the mask carries one), planned once per batch and step for
every layer: step 0 through ``documents.segmented_causal_forward/backward`` (causal per
document), later steps as one unmasked rectangle per (row, shared document), blocks with no
shared document not at all; the merge tolerates rows that see nothing in a block
(``merge_partial``).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from titan_upipe.attention.backends import LocalAttentionBackend
from titan_upipe.attention.documents import segmented_causal_backward, segmented_causal_forward
from titan_upipe.attention.ring_plan import (
    BlockCall,
    BlockRule,
    DiagonalCall,
    DocumentCall,
    DocumentPlan,
    causal_block_kind,
    document_step_calls,
    step_calls,
)
from titan_upipe.parallel.document_mask import DocumentMask, SegmentTable

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


Index = tuple[slice, slice, slice]
"""``(rows, heads, tokens)`` of a ``[B, h, S_r, ...]`` ring-local tensor (basic slicing: views)."""
Segments = SegmentTable


def _block_index(call: BlockCall, slot_len: int) -> tuple[Index, Index]:
    """(query, key) indices of one causal-plan call: slots ``[start, stop)`` of every row."""
    return ((slice(None), slice(None), slice(call.q_start * slot_len, call.q_stop * slot_len)),
            (slice(None), slice(None), slice(call.kv_start * slot_len, call.kv_stop * slot_len)))


def _document_index(call: DocumentCall) -> tuple[Index, Index]:
    """(query, key) indices of one document call into ``[B, h, S_r, ...]`` ring-local tensors."""
    if isinstance(call, DiagonalCall):
        every = (slice(None), slice(None), slice(None))
        return every, every
    row = slice(call.row, call.row + 1)
    return (row, slice(None), slice(*call.q)), (row, slice(None), slice(*call.kv))


def merge_partial(out_acc: Tensor, lse_acc: Tensor, out: Tensor, lse: Tensor) -> None:
    """Fold one block's normalized ``out``/``lse`` into the fp32 accumulators, in place::

        lse' = logaddexp(lse_acc, lse),  out' = e^(lse_acc - lse') out_acc + e^(lse - lse') out

    with ``lse'`` taken as 0 inside the exponentials where both sides are ``-inf`` (a row of packed
    documents that sees no key of either block), so such a row stays ``out = 0``, ``lse = -inf``
    instead of NaN; wherever ``lse'`` is finite (every causal row) that is the same arithmetic,
    bit for bit."""
    new_lse = torch.logaddexp(lse_acc, lse)
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    out_acc.mul_(torch.exp(lse_acc - ref).unsqueeze(-1))
    out_acc.add_(out.float() * torch.exp(lse - ref).unsqueeze(-1))
    lse_acc.copy_(new_lse)


class RingAttentionBackend(LocalAttentionBackend):
    name = "ring"

    def __init__(self, local: LocalAttentionBackend, group: dist.ProcessGroup | None, ring_rank: int,
                 ring_size: int, rule: BlockRule = causal_block_kind,
                 documents: DocumentMask | None = None, document_plan: DocumentPlan = document_step_calls) -> None:
        self.local, self.group, self.ring_rank, self.ring_size = local, group, ring_rank, ring_size
        self.rule = rule
        """The block rule (the causal one); replaceable only to show the tests catch a wrong rule."""
        self.documents, self.document_plan = documents, document_plan
        """The batch's documents (None: one causal sequence) and the plan that reads their runs
        (replaceable only to show the tests catch a wrong plan)."""

    def with_documents(self, documents: DocumentMask) -> RingAttentionBackend:
        """This ring for one batch of packed documents (a copy: a call's backward reads the mask
        of its own forward, whatever batch comes next)."""
        ring = copy.copy(self)
        ring.documents = documents
        return ring

    def _calls(self, step: int) -> tuple[BlockCall, ...]:
        return step_calls(self.ring_rank, self.ring_size, step, self.rule)

    def _blocks(self, step: int, slot_len: int) -> list[tuple[Index, Index, bool | Segments]]:
        """``(query index, key index, how)`` of every kernel call of ``step``: ``how`` is ``causal``
        for one plain kernel call, or each row's segments for a causal call per document."""
        if self.documents is None:
            return [(*_block_index(call, slot_len), call.causal) for call in self._calls(step)]
        calls = self.documents.ring_calls(self.document_plan, self.ring_rank, self.ring_size, step)
        # A diagonal's segments as the mask's table: built (and sent to the device) once per step.
        return [(*_document_index(call),
                 self.documents.table(call.segments) if isinstance(call, DiagonalCall) else False)
                for call in calls]

    def _kernel_forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float, how: bool | Segments):
        if isinstance(how, bool):
            return self.local.forward(q, k, v, scale, causal=how)
        return segmented_causal_forward(q, k, v, scale, how, self.local)

    def _kernel_backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         scale: float, how: bool | Segments):
        if isinstance(how, bool):
            return self.local.backward(dout, q, k, v, out, lse, scale, causal=how)
        return segmented_causal_backward(dout, q, k, v, out, lse, scale, how, self.local)

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
            for qi, ki, how in self._blocks(step, slot):
                out, lse = self._kernel_forward(q[qi], kv[0][ki], kv[1][ki], scale, how)
                merge_partial(out_acc[qi], lse_acc[qi], out, lse)
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
            for qi, ki, how in self._blocks(step, slot):
                dq, dk, dv = self._kernel_backward(dout[qi], q[qi], kv[0][ki], kv[1][ki], out[qi],
                                                   lse[qi].contiguous(), scale, how)
                dq_acc[qi].add_(dq)
                dkv[0][ki].add_(dk)
                dkv[1][ki].add_(dv)
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

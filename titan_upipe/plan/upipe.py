"""UPipe's attention terms: ``titan_upipe.costs.attention_memory`` (validated per stage against
measurement in ``tests/test_attention_memory.py``: a stage's backward kernel and the final dX
GEMM) plus what the code adds around it: the weight-gradient fp32 accumulators
``(H D + 2 KV D) d 4``, the stage buffers widened to the K/V heads per rank, the dQ projection
backprop (recomputed projection, RoPE under autograd), the K/V group flush, the ring's terms
for UPipe inside USP and, on GPU, the flash kernel's fp32 accumulators.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.costs.attention_memory import (
    LayerShape,
    upipe_backward_terms,
    upipe_forward_terms,
    upipe_input_grad_terms,
    upipe_kv_projection_columns,
)
from titan_upipe.plan.attention import AttentionTerms, kernel_backward_terms, kernel_forward_terms, ring_terms
from titan_upipe.plan.sizes import StepSizes
from titan_upipe.plan.terms import Term, Terms, from_memory_model
from titan_upipe.spec.head_schedule import HeadSchedule, build_schedule

KERNEL_OUTPUTS = (Term.UPIPE_BWD_KERNEL_DQ, Term.UPIPE_BWD_KERNEL_DKV)
"""A stage's kernel outputs: gone once they are sent back (and, with a ring, not yet there at
the ring's largest moment)."""


@dataclass(frozen=True)
class UPipeLayer:
    """One UPipe attention layer on one rank: its memory_model shape and head schedule."""

    sizes: StepSizes
    shape: LayerShape
    u: int
    """Query heads per stage (U)."""
    schedule: HeadSchedule

    @classmethod
    def of(cls, s: StepSizes) -> UPipeLayer:
        job, m = s.job, s.model
        cu = job.ulysses_degree
        shape = LayerShape(m.n_heads, m.n_kv_heads, m.head_dim, cp_degree=cu, seq_len=job.local_len * cu,
                           batch=job.batch, dim=m.dim, elem_bytes=s.act_bytes)
        return cls(sizes=s, shape=shape, u=job.u, schedule=build_schedule(m.n_heads, m.n_kv_heads, cu, job.u))

    @property
    def resident_kv(self) -> int:
        """K/V heads each rank keeps per stage, in heads over its tokens."""
        return self.schedule.max_kv_heads_per_rank * self.sizes.job.ulysses_degree

    def widened(self, n_buffers: int) -> Terms:
        """memory_model sizes the stage buffers for U query heads; the code sizes them for
        max(U/C, KV heads per rank) x C heads (``StageBuffers.allocate``)."""
        sched, cu = self.schedule, self.sizes.job.ulysses_degree
        extra = max(sched.max_kv_heads_per_rank - sched.query_heads_per_rank, 0) * cu
        if not extra:
            return {}
        return {Term.UPIPE_WIDENED: n_buffers * extra * self.sizes.head}

    def accumulators(self) -> Terms:
        m = self.sizes.model
        return {Term.UPIPE_BWD_ACCUMULATORS: (m.q_width + 2 * m.kv_width) * m.dim * 4}

    def rope_backprop(self, n_heads: int) -> int:
        """RoPE of n_heads recomputed and differentiated: per element a + 12 bytes, plus the rows."""
        s, m = self.sizes, self.sizes.model
        rope_rows = 4 * s.job.local_len * m.head_dim if m.rope == "llama3" else 8 * s.job.local_len * m.head_dim
        return n_heads * s.tokens * m.head_dim * (s.act_bytes + 12) + rope_rows


def upipe_attention(s: StepSizes) -> AttentionTerms:
    """UPipe (and UPipe inside USP): the same terms at every stage, so one stage stands for all."""
    layer = UPipeLayer.of(s)
    shape = layer.shape
    saved = {Term.UPIPE_OUT: s.model.n_heads * shape.head_unit, Term.UPIPE_LSE: shape.lse_bytes}
    forward = _forward(layer)
    return AttentionTerms(saved=saved, forward=forward, forward_nograd=forward, backward=_backward(layer))


def _forward(layer: UPipeLayer) -> Terms:
    s = layer.sizes
    fwd = from_memory_model("UPipe fwd", upipe_forward_terms(layer.shape, layer.u))
    fwd[Term.UPIPE_FWD_OUT] = fwd.pop(Term.UPIPE_FWD_OUT)  # listed last, as the code allocates it
    fwd.update(layer.widened(2))
    if s.job.ring > 1:  # the ring returns the stage's output only after its largest moment
        fwd.pop(Term.UPIPE_FWD_STAGE_OUT)
        fwd.update(ring_terms(s, layer.u, layer.resident_kv, backward=False))
    fwd.update(kernel_forward_terms(s, layer.u, layer.resident_kv))
    return fwd


def _backward(layer: UPipeLayer) -> list[tuple[str, Terms]]:
    """A stage's kernel, then what follows it: the dQ projection backprop, the K/V flush of a
    group, and the final dX GEMM. The layer's output is the caller's term, not UPipe's."""
    s, shape, u, kv = layer.sizes, layer.shape, layer.u, layer.resident_kv
    bwd = from_memory_model("UPipe bwd", upipe_backward_terms(shape, u), drop=(Term.UPIPE_BWD_LAYER_OUT,))
    bwd.update(layer.accumulators())
    bwd.update(layer.widened(4))
    if s.job.ring > 1:
        kernel = {k: v for k, v in bwd.items() if k not in KERNEL_OUTPUTS}
        kernel.update(ring_terms(s, u, kv, backward=True))
    else:
        kernel = dict(bwd)
    kernel.update(kernel_backward_terms(s, u, kv))
    # After a stage's kernel: dQ is sent back and backpropagated through the projection of each
    # destination's heads (recomputed, with RoPE under autograd), its gradient written into the
    # output buffer's slots and the wq rows' gradient accumulated in fp32.
    after = {k: v for k, v in bwd.items() if k not in KERNEL_OUTPUTS}
    hq = layer.schedule.query_heads_per_rank
    dq = {**after, Term.UPIPE_BWD_PROJECTION: 2 * hq * s.head}
    rope = {**after, Term.UPIPE_BWD_ROPE: layer.rope_backprop(hq)}
    # A KV group's flush (after its last stage): dK/dV sent back, K backpropagated through RoPE
    # (and k-norm) one destination run at a time into the group's new projection-gradient buffer.
    group_cols = upipe_kv_projection_columns(shape, u, groups=slice(-1, None))
    flush = {**after, Term.UPIPE_BWD_FLUSH_GRADS: s.tokens * group_cols * s.act_bytes,
             Term.UPIPE_BWD_FLUSH_ROPE: layer.rope_backprop(layer.schedule.max_kv_heads_per_rank)}
    # After the stages: dX as one GEMM over every head's projection gradient (ProjectionGrads).
    dx = from_memory_model("UPipe bwd", upipe_input_grad_terms(shape, u, weight_bytes=s.weight_bytes),
                           drop=(Term.UPIPE_BWD_LAYER_OUT,))
    dx.update(layer.accumulators())
    dx.update(layer.widened(4))
    return [("kernel", kernel), ("dQ projection backprop", dq), ("projection RoPE backprop", rope),
            ("K/V flush", flush), ("dX GEMM", dx)]

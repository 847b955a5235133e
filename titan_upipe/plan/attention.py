"""Attention terms of one block on one rank: the local kernels, the zigzag ring, and Ulysses
(``ulysses_attention``, plain autograd) of which ring (Ulysses degree 1) and USP (Ulysses with
the ring kernel) are cases. UPipe's are ``titan_upipe.plan.upipe``.

Sizes are in heads over this rank's tokens: ``u_h = T D a`` bytes per head. After the
all-to-all a rank holds ``H/C_u`` query heads of the ring-local sequence (``H u_h``) and
``max(KV, C_u)`` K or V heads (``kv`` u_h: replicated when ``C_u > KV``).
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_upipe.plan.sizes import StepSizes
from titan_upipe.plan.terms import Term, Terms


@dataclass(frozen=True)
class AttentionTerms:
    """Attention terms of one block, excluding its input (the norm output)."""

    saved: Terms
    """Kept from a forward with autograd to the backward."""
    forward: Terms
    """Its forward peak with autograd."""
    forward_nograd: Terms
    """Its forward peak without autograd (the first pass under activation checkpointing)."""
    backward: list[tuple[str, Terms]]
    """Its backward moments ``(where, terms)``, dO and weight-gradient accumulators included."""


def kv_units(s: StepSizes) -> int:
    """K (or V) per rank after the all-to-all, in heads over this rank's tokens: each rank
    holds max(1, KV/C) heads of the ring-local sequence (replicated when C > KV)."""
    cu = s.job.ulysses_degree
    return max(s.model.n_kv_heads, cu) if cu > 1 else s.model.n_kv_heads


def ring_terms(s: StepSizes, q_heads: int, kv_heads: int, backward: bool) -> Terms:
    """Zigzag ring attention (``ring.py``) inside one kernel call of q_heads query heads and
    kv_heads K/V heads (in heads over this rank's tokens), at its largest moment: step 0,
    whose local call covers the whole ring-local sequence. The caller's kernel outputs
    (out, or dQ/dK/dV) do not exist yet then: the ring returns them at the end."""
    if s.job.ring == 1:
        return {}
    uh, a, q_lse = s.head, s.act_bytes, q_heads * s.tokens * 4
    q32 = q_heads * uh * 4 // a
    if not backward:
        return {
            Term.RING_OUT_FP32: q32 + q_lse,
            Term.RING_KV: 4 * kv_heads * uh,
            Term.RING_LOCAL_OUT: q_heads * uh + q_lse,
            Term.RING_MERGE: q32 * (2 if a != 4 else 1) + 2 * q_lse,
        }
    return {
        Term.RING_DQ_FP32: q32,
        Term.RING_KV: 4 * kv_heads * uh,
        Term.RING_DKV_FP32: 3 * 2 * kv_heads * uh * 4 // a,
        Term.RING_LOCAL_GRADS: (q_heads + 2 * kv_heads) * uh,
    }


def _sdpa_expands_kv(s: StepSizes, q_heads: int, kv_heads: int) -> bool:
    # The sdpa backend's fp32 path runs the memory-efficient kernel, which has no GQA;
    # its fp16/bf16 path runs aten's flash kernel with native GQA.
    return s.job.attention_backend == "sdpa" and s.act_bytes == 4 and q_heads > kv_heads


def kernel_forward_terms(s: StepSizes, q_heads: int, kv_heads: int) -> Terms:
    """Extra bytes inside the local attention kernel's forward (CUDA; ``backends.py``)."""
    if not s.cuda or not _sdpa_expands_kv(s, q_heads, kv_heads):
        return {}
    return {Term.KERNEL_KV_EXPANDED: 2 * q_heads * s.head}


def kernel_backward_terms(s: StepSizes, q_heads: int, kv_heads: int) -> Terms:
    """Extra bytes inside the local attention kernel's backward (CUDA; invisible on CPU),
    for q_heads query and kv_heads K/V heads over this rank's tokens. No backend recomputes
    a forward: each runs its fused backward from the saved out/lse."""
    if not s.cuda or s.job.attention_backend == "math":
        return {}
    backend, uh, a = s.job.attention_backend, s.head, s.act_bytes
    gqa = q_heads > kv_heads
    terms: Terms = {Term.KERNEL_DQ_FP32: q_heads * uh * 4 // a}
    if backend in ("flash_attn3", "flash_attn4") and gqa:
        terms[Term.KERNEL_DKV_FP32] = 2 * kv_heads * uh * 4 // a
    if backend in ("flash_attn", "sdpa") and gqa:
        terms[Term.KERNEL_DKV_EXPANDED] = 2 * q_heads * uh
    if _sdpa_expands_kv(s, q_heads, kv_heads):
        terms[Term.KERNEL_KV_EXPANDED] = 2 * q_heads * uh
    return terms


def ulysses_attention(s: StepSizes) -> AttentionTerms:
    """Ulysses (``ulysses_attention``, plain autograd); ring = Ulysses of degree 1 with the
    ring kernel; USP = Ulysses with the ring kernel."""
    job, m, uh, a = s.job, s.model, s.head, s.act_bytes
    h, kv = m.n_heads, kv_units(s)
    cu = job.ulysses_degree
    rope_rows = 2 * job.local_len * m.head_dim * (4 if m.rope == "llama3" else 8)
    saved: Terms = {
        Term.ATT_ROPE_ROWS: rope_rows,
        Term.ATT_Q: h * uh,
        Term.ATT_KV: 2 * kv * uh,
        Term.ATT_KERNEL_OUT: h * uh,
        Term.ATT_LSE: h * s.tokens * 4,
        Term.ATT_WO_INPUT: h * uh,
    }
    ring = job.ring > 1
    pre_kv = kv if cu > m.n_kv_heads else m.n_kv_heads
    # forward with autograd, at the output all-to-all: Q (rotated, still referenced),
    # the K/V copies sent, the output's receive buffer; with a ring, at its step-0 merge
    if ring:
        fwd = {k: v for k, v in saved.items() if k not in (Term.ATT_KERNEL_OUT, Term.ATT_WO_INPUT)}
        if cu > 1:
            fwd[Term.ATT_PRE_A2A] = (h + 2 * pre_kv) * uh
        fwd.update(ring_terms(s, h, kv, backward=False))
    else:
        fwd = dict(saved)
        fwd[Term.ATT_PRE_A2A_COPIES] = (h + 2 * pre_kv) * uh
        fwd[Term.ATT_OUT_RECV] = h * uh
    # RoPE of Q with autograd (fp32 copy and complex product) is an earlier, separate moment
    rope_fp32 = h * s.tokens * m.head_dim * (4 if a != 4 else 0) + h * s.tokens * m.head_dim * 4
    fwd_rope = {Term.ATT_Q_PROJ: h * uh, Term.ATT_ROPE_FP32: rope_fp32,
                Term.ATT_Q_ROTATED: h * uh if a != 4 else 0}
    rope_is_peak = sum(fwd_rope.values()) > sum(fwd.values())
    if rope_is_peak:
        fwd = fwd_rope
    else:  # the kernel's forward workspace is part of the all-to-all moment, not RoPE's
        fwd.update(kernel_forward_terms(s, h, kv))
    nograd = _ulysses_nograd(s, kv, pre_kv, rope_fp32)
    nograd.update(kernel_forward_terms(s, h, kv))
    bwd = {k: v for k, v in saved.items() if k is not Term.ATT_WO_INPUT}
    bwd[Term.ATT_DO] = h * uh
    if ring:
        bwd.update(ring_terms(s, h, kv, backward=True))
    else:
        bwd[Term.ATT_DQKV] = (h + 2 * kv) * uh
    bwd.update(kernel_backward_terms(s, h, kv))
    return AttentionTerms(saved=saved, forward=fwd, forward_nograd=nograd, backward=[("kernel", bwd)])


def _ulysses_nograd(s: StepSizes, kv: int, pre_kv: int, rope_fp32: int) -> Terms:
    """Ulysses' forward without autograd (first pass under AC): nothing saved, in-place RoPE
    with fused_rope."""
    job, h, uh = s.job, s.model.n_heads, s.head
    nograd: Terms = {Term.ATT_NOGRAD_QKV: (h + 2 * kv) * uh}
    if job.ring > 1:
        if job.ulysses_degree > 1:
            nograd[Term.ATT_NOGRAD_PRE_A2A] = (h + 2 * pre_kv) * uh
        nograd.update(ring_terms(s, h, kv, backward=False))
    else:
        nograd[Term.ATT_NOGRAD_OUT] = 3 * h * uh
        nograd[Term.ATT_NOGRAD_LSE] = h * s.tokens * 4
    if not job.fused_rope:
        nograd[Term.ATT_NOGRAD_ROPE_FP32] = rope_fp32
    return nograd

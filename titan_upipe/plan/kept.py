"""Kept attention in the plan: what one block keeps (``attention.keep``), tensor by tensor.

Per block and rank ``T H (D a + 4)`` bytes (``spec.keep_attention.kept_attention_bytes``), recorded as
the mode's tensors (their count matters in host memory, where PyTorch's pinned allocator rounds
each one up to a power of two):

==================================  ===================================================================
mode                                tensors of one block
==================================  ===================================================================
UPipe (and UPipe in USP)            the output buffer ``[B, L, H D]``; one LSE ``[B, U/C_u, S/R]`` per stage
Ulysses, ring, USP                  the kernel output ``[B, H/C_u, S/R, D]`` and its LSE ``[B, H/C_u, S/R]``
TSP                                 per owner and KV bucket, each zigzag chunk's output and LSE
==================================  ===================================================================
"""

from __future__ import annotations

from titan_upipe.plan.job import UPIPE_MODES
from titan_upipe.plan.sizes import StepSizes
from titan_upipe.spec.keep_attention import kept_attention_bytes


def kept_bytes(s: StepSizes) -> int:
    """Bytes one block keeps (0 when the job keeps nothing)."""
    if not s.job.keep.blocks:
        return 0
    m = s.model
    return kept_attention_bytes(s.tokens, m.n_heads, m.head_dim, s.act_bytes)


def kept_tensor_bytes(s: StepSizes) -> list[int]:
    """The bytes of each tensor one block keeps (the module table); they sum to ``kept_bytes``."""
    job, m, t, a = s.job, s.model, s.tokens, s.act_bytes
    if job.resolved_mode in UPIPE_MODES:
        return [t * m.n_heads * m.head_dim * a] + [t * job.u * 4] * (m.n_heads // job.u)
    if job.tsp:
        degree = job.cp
        kv_per_rank = m.n_kv_heads // degree
        bucket = job.tsp_kv_heads_per_bucket or kv_per_rank
        heads = bucket * (m.n_heads // m.n_kv_heads)  # query heads of one bucket
        chunk = t // 2  # this rank's two zigzag chunks
        per_call = [chunk * heads * m.head_dim * a] * 2 + [chunk * heads * 4] * 2
        return per_call * (degree * (kv_per_rank // bucket))
    return [t * m.n_heads * m.head_dim * a, t * m.n_heads * 4]

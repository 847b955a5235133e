"""DeepSpeed-Ulysses attention (paper section 3.1) with plain autograd.

All heads are projected from this rank's tokens, one all-to-all per tensor reshards
Q/K/V from sequence-sharded to head-sharded, each rank runs causal attention over the
full sequence for its ``H/C`` heads, and one all-to-all brings the output back. Autograd
saves what each op needs, as the unconverted module does; this is the baseline UPipe is
compared with (UPipe with ``U = H`` computes the same thing with recompute instead).
"""

from __future__ import annotations

import torch

from titan_upipe.attention.backends import LocalAttentionBackend
from titan_upipe.attention.collectives import heads_to_sequence, sequence_to_heads
from titan_upipe.attention.keep import KeptAttention, recording, replaying
from titan_upipe.attention.run import AttentionRun

Tensor = torch.Tensor


class LocalAttention(torch.autograd.Function):
    """A backend's (out, lse) forward and explicit backward as one autograd node. With ``kept``
    (``keep.py``) a block's forward records ``(out, lse)`` and its recomputation takes them back
    instead of running the kernel (for a ring kernel: instead of the ring's passes too)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, backend: LocalAttentionBackend, scale: float,
                kept: KeptAttention | None = None) -> Tensor:
        if replaying(kept):
            out, lse = kept.replay()
        else:
            out, lse = backend.forward(q, k, v, scale)
            if recording(kept):
                kept.record(out, lse)
        ctx.backend, ctx.scale = backend, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(dout, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None, None, None


def ulysses_attention(
    x: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, q_norm_weight: Tensor | None, k_norm_weight: Tensor | None,
    run: AttentionRun,
) -> Tensor:
    """``x`` ``[B, L, dim]`` (this rank's tokens) -> attention output before ``wo``, ``[B, L, H*D]``."""
    schedule, proj, c = run.schedule, run.projection, run.cp_degree
    b, seq, _ = x.shape
    all_q = tuple(range(schedule.n_heads))
    all_kv = tuple(range(schedule.n_kv_heads))
    q = proj.project(x, wq, all_q, q_norm_weight, use_norm=run.qk_norm)
    k = proj.project(x, wk, all_kv, k_norm_weight, use_norm=run.qk_norm)
    v = proj.project(x, wv, all_kv, use_rope=False)
    # Destination rank j receives the KV heads its query heads use; when C > KV several
    # ranks need the same head, so its activations (not weights) are replicated here.
    (stage,) = schedule.stages
    kv_index = [h for heads in stage.kv_heads_per_rank for h in heads]
    if kv_index != list(all_kv):
        index = torch.tensor(kv_index, device=x.device)
        k, v = k.index_select(2, index), v.index_select(2, index)
    out = LocalAttention.apply(
        sequence_to_heads(q, c, run.group),
        sequence_to_heads(k, c, run.group),
        sequence_to_heads(v, c, run.group),
        run.backend,
        run.scale,
        run.kept,
    )
    return heads_to_sequence(out, c, run.group).reshape(b, seq, -1)

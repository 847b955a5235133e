"""TSP attention (Algorithm 1 of ``../shared/papers/001_*``), forward and backward on rank ``p``.

For ``r = 0 .. D-1``: broadcast rank ``r``'s packed ``[Wq | Wk | Wv | Wo^T]`` shard; project the
local tokens ``X [B, S/D, d]`` with it (``Q = X Wq^T``, ``K``, ``V``; Qwen3's qk-norm, then RoPE at
the tokens' global positions); for each bucket of KV heads, all-gather ``K, V`` along the sequence
and reorder the zigzag shards to natural order; causal attention of the local queries over them;
``Y += A Wo^(r)T``. After ``D`` owners every rank holds ``Y`` for its tokens, all heads applied.

Causal attention of a zigzag shard (:class:`GatheredCausalAttention`, one KV-head bucket at a
time): rank ``p`` holds chunks ``p`` and ``2D-1-p`` (``S_c = S/(2D)`` tokens each); chunk ``c``'s
queries see keys ``[0, (c+1) S_c)``: a full block over ``[0, c S_c)`` and a causal diagonal block,
LSE-merged in fp32, each run by the job's local attention kernel under its merged-backward
contract (``attention.backends``). The bucket's whole-sequence K/V is not saved: backward
gathers it again, so one bucket's is alive at a time.

Backward: the broadcast's gradient is reduced to the owner in fp32 (each weight gradient ends at
its owning rank, ``tsp.collectives``); dK/dV over the sequence are summed in fp32 and
reduce-scattered to the tokens' ranks. ``X`` and the qk-norm weights are used once per owner:
their gradients are summed over the ``D`` owners in fp32 and rounded once (``tsp.grad_sum``).
Parameters outside the shards (qk-norm weights) are replicated: each rank returns its tokens'
share, and the caller sums them over the group like any replicated parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_upipe.attention.backend_base import LocalAttentionBackend
from titan_upipe.attention.keep import KeptAttention, recording, replaying
from titan_upipe.attention.projection import RotaryKind, rotate
from titan_upipe.attention.ring import merge_partial
from titan_upipe.parallel.layout import ZigzagLayout
from titan_upipe.tsp.collectives import (
    CommLog,
    Pending,
    broadcast_from,
    nbytes,
    record,
    reduce_scatter_stacked,
    start_all_gather,
    start_broadcast,
)
from titan_upipe.tsp.grad_sum import iter_fp32_summed_uses
from titan_upipe.tsp.shards import TSPShards

Tensor = torch.Tensor


def prefix_causal_forward(q: Tensor, k: Tensor, v: Tensor, kernel: LocalAttentionBackend,
                          scale: float) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of queries of chunk ``c`` (``[B, h, S_c, hd]``) over keys ``[0, (c+1) S_c)`` in
    natural order (``[B, k, (c+1) S_c, hd]``): full attention over the first ``c S_c`` keys, causal
    over the last ``S_c``, LSE-merged in fp32."""
    prefix = k.shape[2] - q.shape[2]
    out, lse = kernel.forward(q, k[:, :, prefix:], v[:, :, prefix:], scale, causal=True)
    if prefix:
        out_acc, lse_acc = out.float(), lse.clone()
        early_out, early_lse = kernel.forward(q, k[:, :, :prefix], v[:, :, :prefix], scale, causal=False)
        merge_partial(out_acc, lse_acc, early_out, early_lse)
        out, lse = out_acc.to(q.dtype), lse_acc
    return out, lse


def prefix_causal_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           kernel: LocalAttentionBackend, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`prefix_causal_forward`; each block's kernel backward gets the
    merged ``out``/``lse`` (the backend contract), ``dq`` summed over the two in fp32."""
    prefix = k.shape[2] - q.shape[2]
    dq, dk_diag, dv_diag = kernel.backward(dout, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, scale, causal=True)
    if not prefix:
        return dq, dk_diag, dv_diag
    dq_early, dk_early, dv_early = kernel.backward(dout, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, scale,
                                                   causal=False)
    dq = (dq.float() + dq_early.float()).to(q.dtype)
    return dq, torch.cat([dk_early, dk_diag], dim=2), torch.cat([dv_early, dv_diag], dim=2)


def _gather(kv_local: Tensor, group: dist.ProcessGroup | None, log: CommLog | None, phase: str,
            pending: Pending | None) -> Tensor:
    """``[D, *kv_local.shape]``: every rank's K/V bucket (this rank's at its index), counted in ``log``."""
    if group is None:
        return kv_local.unsqueeze(0)
    gathered = (pending or start_all_gather(kv_local, group)).wait()
    record(log, phase, "all_gather", (gathered.shape[0] - 1) * nbytes(gathered[0]))
    return gathered


def _natural_kv(gathered: Tensor, layout: ZigzagLayout) -> tuple[Tensor, Tensor]:
    """``[D, 2, B, S/D, bk, hd]`` (rank ``r``'s zigzag shard at ``r``) -> K, V ``[B, bk, S, hd]`` in
    sequence order."""
    natural = layout.unshard(gathered.unbind(0), seq_dim=2)  # [2, B, S, bk, hd]
    return natural[0].transpose(1, 2), natural[1].transpose(1, 2)


class GatheredCausalAttention(torch.autograd.Function):
    """One KV bucket's attention on rank ``p``: all-gather the bucket's K/V ``[2, B, S/D, bk, hd]``
    along the sequence, reorder zigzag -> natural, and attend the rank's two zigzag query chunks
    ``q [B, h, S/D, hd]`` (the bucket's query heads) causally over their key prefixes;
    ``[B, h, S/D, hd]``.

    Saved for backward: the local K/V, the queries, outputs and LSEs, never the whole-sequence K/V;
    backward gathers it again (the forward's bytes once more), so one bucket's whole-sequence K/V
    is alive at a time in forward and backward alike (what ``kv_heads_per_bucket`` bounds). dK/dV
    over the sequence are summed in fp32 and reduce-scattered to the tokens' ranks in fp32."""

    @staticmethod
    def forward(ctx, q: Tensor, kv_local: Tensor, layout: ZigzagLayout, rank: int, group: dist.ProcessGroup | None,
                kernel: LocalAttentionBackend, scale: float, log: CommLog | None, pending: Pending | None,
                kept: KeptAttention | None = None) -> Tensor:
        if replaying(kept):  # the recomputation of a block that kept them: no all-gather, no kernel
            out0, out1, lse0, lse1 = kept.replay()
            outs, lses = [out0, out1], [lse0, lse1]
        else:
            outs, lses = _gathered_forward(q, kv_local, layout, rank, group, kernel, scale, log, pending)
            if recording(kept):
                kept.record(*outs, *lses)
        ctx.save_for_backward(q, kv_local, *outs, *lses)
        ctx.layout, ctx.rank, ctx.group, ctx.kernel, ctx.scale, ctx.log = layout, rank, group, kernel, scale, log
        return torch.cat(outs, dim=2)

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, kv_local, out0, out1, lse0, lse1 = ctx.saved_tensors
        layout, chunk = ctx.layout, ctx.layout.chunk_len
        k_all, v_all = _natural_kv(_gather(kv_local, ctx.group, ctx.log, "backward", None), layout)
        dk_all = torch.zeros(k_all.shape, dtype=torch.float32, device=k_all.device)
        dv_all = torch.zeros_like(dk_all)
        dqs = []
        halves = zip(q.split(chunk, dim=2), dout.split(chunk, dim=2), (out0, out1), (lse0, lse1),
                     layout.ring_chunks(ctx.rank), strict=True)
        for half, d_half, out, lse, c in halves:
            keys = (c + 1) * chunk
            dq, dk, dv = prefix_causal_backward(d_half.contiguous(), half, k_all[:, :, :keys], v_all[:, :, :keys], out,
                                                lse, ctx.kernel, ctx.scale)
            dqs.append(dq)
            dk_all[:, :, :keys] += dk.float()
            dv_all[:, :, :keys] += dv.float()
        del k_all, v_all
        # every rank's zigzag tokens of dK/dV, [D, 2, B, S/D, bk, hd], summed at the tokens' rank
        dkv = torch.stack([dk_all.transpose(1, 2), dv_all.transpose(1, 2)])  # [2, B, S, bk, hd]
        per_rank = torch.stack([layout.shard(dkv, r, seq_dim=2) for r in range(layout.ring_size)])
        del dkv, dk_all, dv_all
        dkv_local = per_rank[0] if ctx.group is None else reduce_scatter_stacked(per_rank, ctx.group, ctx.log)
        return torch.cat(dqs, dim=2), dkv_local.to(kv_local.dtype), None, None, None, None, None, None, None, None


def _gathered_forward(q: Tensor, kv_local: Tensor, layout: ZigzagLayout, rank: int, group: dist.ProcessGroup | None,
                      kernel: LocalAttentionBackend, scale: float, log: CommLog | None,
                      pending: Pending | None) -> tuple[list[Tensor], list[Tensor]]:
    """``GatheredCausalAttention``'s forward: the bucket's whole-sequence K/V, then each zigzag
    query chunk over its key prefix; ``([out0, out1], [lse0, lse1])``."""
    k_all, v_all = _natural_kv(_gather(kv_local, group, log, "forward", pending), layout)
    chunk, outs, lses = layout.chunk_len, [], []
    for half, c in zip(q.split(chunk, dim=2), layout.ring_chunks(rank), strict=True):
        keys = (c + 1) * chunk
        out, lse = prefix_causal_forward(half, k_all[:, :, :keys], v_all[:, :, :keys], kernel, scale)
        outs.append(out)
        lses.append(lse)
    return outs, lses


def tsp_attention(x: Tensor, packed: Tensor, shards: TSPShards, layout: ZigzagLayout, group: dist.ProcessGroup | None,
                  kernel: LocalAttentionBackend, scale: float, rope_table: Tensor, positions: Tensor,
                  rotary: RotaryKind, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                  norm_eps: float | None = None, bucket_kv_heads: int | None = None,
                  log: CommLog | None = None, overlap: bool = True, kept: KeptAttention | None = None) -> Tensor:
    """``Y [B, S/D, d]`` of TSP attention on this rank (module docstring).

    ``x``: this rank's zigzag tokens ``[B, S/D, d]``; ``packed``: its ``[Wq | Wk | Wv | Wo^T]``
    shard (``TSPShards.pack_attention``); ``positions`` ``[1 or B, S/D]``: the tokens' global
    positions (``layout.positions(rank)``); ``bucket_kv_heads``: KV heads per all-gather (default:
    all of a shard's, one all-gather per owner); ``log``: counts the bytes this rank receives;
    ``overlap``: start owner ``r + 1``'s broadcast before owner ``r``'s compute and bucket ``b + 1``'s
    all-gather before bucket ``b``'s attention (async collectives; the same numbers either way);
    ``kept``: the block's kept kernel results (``attention.keep``), recorded per owner and bucket in
    forward; its recomputation replays them and gathers no K/V (the weights still travel: the
    projections are recomputed for the backward)."""
    rank = 0 if group is None else dist.get_rank(group)
    b, local_len, _ = x.shape
    hd, kv_per_rank, group_size = shards.head_dim, shards.kv_heads, shards.n_heads // shards.n_kv_heads
    bucket = bucket_kv_heads or kv_per_rank
    if kv_per_rank % bucket:
        raise ValueError(f"bucket of {bucket} KV heads does not divide the {kv_per_rank} KV heads per rank")
    overlap = overlap and group is not None and shards.degree > 1

    def start_weights(owner: int) -> Pending | None:
        return start_broadcast(packed, owner, group, x.dtype) if overlap and owner < shards.degree else None

    # x and the qk-norm weights are used once per owner: their gradients sum over the owners in fp32
    # (made lazily, one per owner: each owner's gradient joins the fp32 sum as soon as its backward is done)
    xs = iter_fp32_summed_uses(x, shards.degree)
    q_norms, k_norms = ((iter_fp32_summed_uses(q_norm, shards.degree), iter_fp32_summed_uses(k_norm, shards.degree))
                        if q_norm is not None else ([None] * shards.degree,) * 2)
    y, next_weights = None, start_weights(0)
    for owner, (x_use, q_norm_use, k_norm_use) in enumerate(zip(xs, q_norms, k_norms, strict=True)):
        # The next owner's shard travels while this one's projections and attention run.
        weights, next_weights = next_weights, start_weights(owner + 1)
        wq, wk, wv, wo_t = shards.unpack_attention(broadcast_from(packed, owner, group, log, dtype=x.dtype,
                                                                  pending=weights))
        q = F.linear(x_use, wq).view(b, local_len, shards.heads, hd)
        k = F.linear(x_use, wk).view(b, local_len, kv_per_rank, hd)
        v = F.linear(x_use, wv).view(b, local_len, kv_per_rank, hd)
        if q_norm is not None:
            q = F.rms_norm(q, (hd,), q_norm_use, norm_eps)
            k = F.rms_norm(k, (hd,), k_norm_use, norm_eps)
        q, k = rotate(q, rope_table, positions, rotary), rotate(k, rope_table, positions, rotary)
        starts = range(0, kv_per_rank, bucket)
        stacks = [torch.stack([k[:, :, i:i + bucket], v[:, :, i:i + bucket]]) for i in starts]  # [2, B, L, bk, hd]
        gathers = overlap and not replaying(kept)  # a replay attends nothing: no K/V travel
        outs, next_kv = [], start_all_gather(stacks[0], group) if gathers else None
        for index, start in enumerate(starts):
            kv, next_kv = next_kv, None
            if gathers and index + 1 < len(stacks):  # the next bucket's K/V travel during this attention
                next_kv = start_all_gather(stacks[index + 1], group)
            heads = slice(start * group_size, (start + bucket) * group_size)
            outs.append(GatheredCausalAttention.apply(q[:, :, heads].transpose(1, 2), stacks[index], layout, rank,
                                                      group, kernel, scale, log, kv, kept))
        attended = torch.cat(outs, dim=1).transpose(1, 2).reshape(b, local_len, shards.heads * hd)
        contribution = (attended @ wo_t).float()  # summed over the D owners in fp32
        y = contribution if y is None else y + contribution
    return y.to(x.dtype)

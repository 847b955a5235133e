"""TSP attention (Algorithm 1 of ``../shared/papers/001_*``), forward and backward on rank ``p``.

For ``r = 0 .. D-1``: broadcast rank ``r``'s packed ``[Wq | Wk | Wv | Wo^T]`` shard; project the
local tokens ``X [B, S/D, d]`` with it (``Q = X Wq^T``, ``K``, ``V``; Qwen3's qk-norm, then RoPE at
the tokens' global positions); for each bucket of KV heads, all-gather ``K, V`` along the sequence
and reorder the zigzag shards to natural order; causal attention of the local queries over them;
``Y += A Wo^(r)T``. After ``D`` owners every rank holds ``Y`` for its tokens, all heads applied.

Causal attention of a zigzag shard: rank ``p`` holds chunks ``p`` and ``2D-1-p`` (``S_c = S/(2D)``
tokens each); chunk ``c``'s queries see keys ``[0, (c+1) S_c)``: a full block over ``[0, c S_c)``
and a causal diagonal block, LSE-merged in fp32 (:class:`PrefixCausalAttention`), each run by the
job's local attention kernel under its merged-backward contract (``attention.backends``).

Backward is autograd through the adjoints of ``tsp.collectives``: the broadcast's gradient is
reduced to the owner in fp32 (each weight gradient ends at its owning rank), the K/V all-gather's
is reduce-scattered in fp32. Parameters outside the shards (qk-norm weights) are replicated: each
rank returns its tokens' share, and the caller sums them over the group like any replicated
parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_upipe.attention.backend_base import LocalAttentionBackend
from titan_upipe.attention.projection import RotaryKind, rotate
from titan_upipe.attention.ring import merge_partial
from titan_upipe.parallel.layout import ZigzagLayout
from titan_upipe.tsp.collectives import (
    CommLog,
    Pending,
    all_gather_stacked,
    broadcast_from,
    start_all_gather,
    start_broadcast,
)
from titan_upipe.tsp.shards import TSPShards

Tensor = torch.Tensor


class PrefixCausalAttention(torch.autograd.Function):
    """Queries of chunk ``c`` (``[B, h, S_c, hd]``) over keys ``[0, (c+1) S_c)`` in natural order
    (``[B, k, (c+1) S_c, hd]``): full attention over the first ``c S_c`` keys, causal over the
    last ``S_c``, merged in fp32. Backward hands each block the merged ``out``/``lse``."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, kernel: LocalAttentionBackend, scale: float) -> Tensor:
        chunk = q.shape[2]
        prefix = k.shape[2] - chunk
        out, lse = kernel.forward(q, k[:, :, prefix:], v[:, :, prefix:], scale, causal=True)
        if prefix:
            out_acc, lse_acc = out.float(), lse.clone()
            early_out, early_lse = kernel.forward(q, k[:, :, :prefix], v[:, :, :prefix], scale, causal=False)
            merge_partial(out_acc, lse_acc, early_out, early_lse)
            out, lse = out_acc.to(q.dtype), lse_acc
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernel, ctx.scale, ctx.prefix = kernel, scale, prefix
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, scale, prefix = ctx.kernel, ctx.scale, ctx.prefix
        dout = dout.contiguous()
        dq, dk_diag, dv_diag = kernel.backward(dout, q, k[:, :, prefix:], v[:, :, prefix:], out, lse, scale,
                                               causal=True)
        if not prefix:
            return dq, dk_diag, dv_diag, None, None
        dq_early, dk_early, dv_early = kernel.backward(dout, q, k[:, :, :prefix], v[:, :, :prefix], out, lse, scale,
                                                       causal=False)
        dq = (dq.float() + dq_early.float()).to(q.dtype)
        return dq, torch.cat([dk_early, dk_diag], dim=2), torch.cat([dv_early, dv_diag], dim=2), None, None


def zigzag_causal_attention(q: Tensor, k: Tensor, v: Tensor, layout: ZigzagLayout, rank: int,
                            kernel: LocalAttentionBackend, scale: float) -> Tensor:
    """Causal attention of rank ``rank``'s zigzag queries ``[B, h, S/D, hd]`` over the whole
    sequence's keys/values in natural order ``[B, k, S, hd]``; ``[B, h, S/D, hd]``."""
    first, second = layout.ring_chunks(rank)
    chunk = layout.chunk_len
    halves = q.split(chunk, dim=2)
    outs = [PrefixCausalAttention.apply(half, k[:, :, :(c + 1) * chunk], v[:, :, :(c + 1) * chunk], kernel, scale)
            for half, c in zip(halves, (first, second), strict=True)]
    return torch.cat(outs, dim=2)


def tsp_attention(x: Tensor, packed: Tensor, shards: TSPShards, layout: ZigzagLayout, group: dist.ProcessGroup | None,
                  kernel: LocalAttentionBackend, scale: float, rope_table: Tensor, positions: Tensor,
                  rotary: RotaryKind, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                  norm_eps: float | None = None, bucket_kv_heads: int | None = None,
                  log: CommLog | None = None, overlap: bool = True) -> Tensor:
    """``Y [B, S/D, d]`` of TSP attention on this rank (module docstring).

    ``x``: this rank's zigzag tokens ``[B, S/D, d]``; ``packed``: its ``[Wq | Wk | Wv | Wo^T]``
    shard (``TSPShards.pack_attention``); ``positions`` ``[1 or B, S/D]``: the tokens' global
    positions (``layout.positions(rank)``); ``bucket_kv_heads``: KV heads per all-gather (default:
    all of a shard's, one all-gather per owner); ``log``: counts the bytes this rank receives;
    ``overlap``: start owner ``r + 1``'s broadcast before owner ``r``'s compute and bucket ``b + 1``'s
    all-gather before bucket ``b``'s attention (async collectives; the same numbers either way)."""
    rank = 0 if group is None else dist.get_rank(group)
    b, local_len, _ = x.shape
    hd, kv_per_rank, group_size = shards.head_dim, shards.kv_heads, shards.n_heads // shards.n_kv_heads
    bucket = bucket_kv_heads or kv_per_rank
    if kv_per_rank % bucket:
        raise ValueError(f"bucket of {bucket} KV heads does not divide the {kv_per_rank} KV heads per rank")
    overlap = overlap and group is not None and shards.degree > 1

    def start_weights(owner: int) -> Pending | None:
        return start_broadcast(packed, owner, group, x.dtype) if overlap and owner < shards.degree else None

    y, next_weights = None, start_weights(0)
    for owner in range(shards.degree):
        # The next owner's shard travels while this one's projections and attention run.
        weights, next_weights = next_weights, start_weights(owner + 1)
        wq, wk, wv, wo_t = shards.unpack_attention(broadcast_from(packed, owner, group, log, dtype=x.dtype,
                                                                  pending=weights))
        q = F.linear(x, wq).view(b, local_len, shards.heads, hd)
        k = F.linear(x, wk).view(b, local_len, kv_per_rank, hd)
        v = F.linear(x, wv).view(b, local_len, kv_per_rank, hd)
        if q_norm is not None:
            q = F.rms_norm(q, (hd,), q_norm, norm_eps)
            k = F.rms_norm(k, (hd,), k_norm, norm_eps)
        q, k = rotate(q, rope_table, positions, rotary), rotate(k, rope_table, positions, rotary)
        starts = range(0, kv_per_rank, bucket)
        stacks = [torch.stack([k[:, :, i:i + bucket], v[:, :, i:i + bucket]]) for i in starts]  # [2, B, L, bk, hd]
        outs, next_kv = [], start_all_gather(stacks[0], group) if overlap else None
        for index, start in enumerate(starts):
            kv, next_kv = next_kv, None
            if overlap and index + 1 < len(stacks):  # the next bucket's K/V travel during this attention
                next_kv = start_all_gather(stacks[index + 1], group)
            gathered = all_gather_stacked(stacks[index], group, log, pending=kv)  # [D, 2, B, L, bk, hd]: rank r's at r
            natural = layout.unshard(gathered.unbind(0), seq_dim=2)  # [2, B, S, bk, hd] in sequence order
            k_all, v_all = (t.transpose(1, 2) for t in natural.unbind(0))  # [B, bk, S, hd]
            heads = slice(start * group_size, (start + bucket) * group_size)
            outs.append(zigzag_causal_attention(q[:, :, heads].transpose(1, 2), k_all, v_all, layout, rank,
                                                kernel, scale))
        attended = torch.cat(outs, dim=1).transpose(1, 2).reshape(b, local_len, shards.heads * hd)
        contribution = (attended @ wo_t).float()  # summed over the D owners in fp32
        y = contribution if y is None else y + contribution
    return y.to(x.dtype)

"""TSP's weight shards as tensors: rank ``p``'s packed ``[wq | wk | wv | wo^T]`` and ``[w1 | w3 | w2^T]``
(the sizes and degree rules are ``titan_upipe.spec.tsp_shards``; its module docstring has the table)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_upipe.spec.tsp_shards import TSPShardSizes

Tensor = torch.Tensor


@dataclass(frozen=True)
class TSPShards(TSPShardSizes):
    """``TSPShardSizes`` that also cut, pack and unpack one rank's shard of the full weights."""

    def pack_attention(self, wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, rank: int) -> Tensor:
        """Rank ``rank``'s packed ``[wq | wk | wv | wo^T]`` shard from the full TorchTitan weights."""
        q, kv, _, _ = self.attention_rows
        return pack_attention_shard(wq[rank * q:(rank + 1) * q], wk[rank * kv:(rank + 1) * kv],
                                    wv[rank * kv:(rank + 1) * kv], wo[:, rank * q:(rank + 1) * q])

    def pack_mlp(self, w1: Tensor, w2: Tensor, w3: Tensor, rank: int) -> Tensor:
        """Rank ``rank``'s packed ``[w1 | w3 | w2^T]`` shard from the full TorchTitan weights."""
        f = self.hidden
        return pack_mlp_shard(w1[rank * f:(rank + 1) * f], w2[:, rank * f:(rank + 1) * f], w3[rank * f:(rank + 1) * f])

    def unpack_attention(self, packed: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(wq, wk, wv, wo^T)`` row blocks of a packed attention shard (views)."""
        return tuple(packed.split(self.attention_rows))  # type: ignore[return-value]

    def unpack_mlp(self, packed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(w1, w3, w2^T)`` row blocks of a packed MLP shard (views)."""
        return tuple(packed.split(self.mlp_rows))  # type: ignore[return-value]


class _PackRows(torch.autograd.Function):
    """``cat`` of row blocks, some transposed first; backward gives every block a gradient of its
    own, contiguous like the block. (Autograd's cat/transpose backward returns views of the packed
    gradient, so the parameters' gradients would keep all of it alive and add a contiguous copy of
    every transposed block: ``wo``'s and ``w2``'s gradients held twice.)"""

    @staticmethod
    def forward(ctx, transposed: tuple[bool, ...], *blocks: Tensor) -> Tensor:
        ctx.transposed = transposed
        ctx.rows = [b.shape[1] if t else b.shape[0] for b, t in zip(blocks, transposed, strict=True)]
        return torch.cat([b.t() if t else b for b, t in zip(blocks, transposed, strict=True)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        parts = grad.split(ctx.rows)
        return None, *(p.t().contiguous() if t else p.clone() for p, t in zip(parts, ctx.transposed, strict=True))


def pack_attention_shard(wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor) -> Tensor:
    """``[wq | wk | wv | wo^T]`` from one rank's shards (rows of ``wq/wk/wv``, columns of ``wo``)."""
    return _PackRows.apply((False, False, False, True), wq, wk, wv, wo)


def pack_mlp_shard(w1: Tensor, w2: Tensor, w3: Tensor) -> Tensor:
    """``[w1 | w3 | w2^T]`` from one rank's shards (rows of ``w1/w3``, columns of ``w2``)."""
    return _PackRows.apply((False, False, True), w1, w3, w2)

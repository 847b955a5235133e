"""``tiled_mlp``: the SwiGLU FeedForward over sequence tiles (paper sections 2.3 and 4).

The plain module keeps ``w1 x``, ``w3 x``, ``silu(w1 x)`` and their product alive from forward
to backward: ``4 · d_ff`` values per token (d_ff ≈ 3.5 d). Here the forward runs tile by tile
without recording anything and saves only the input; the backward recomputes each tile's
intermediates, backpropagates that tile and adds its weight gradients into fp32 accumulators.
Peak intermediates: one tile's instead of the whole sequence's.

The per-element math is the module's own (``F.linear``, ``F.silu``, aten's ``silu_backward``),
so fp32 outputs and input gradients match it to rounding of the GEMM blocking, and weight
gradients differ only in the order tiles are summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from titan_upipe.attention.model_protocol import MODEL_CLASSES
from titan_upipe.transforms.tiling import accumulate_matmul, tile_bounds

Tensor = torch.Tensor


class TiledSwiGLUFunction(torch.autograd.Function):
    """``w2(silu(w1 x) * w3 x)`` over tiles of ``tile_tokens`` tokens; saves only x and the weights."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, w3: Tensor, tile_tokens: int) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = flat.new_empty(flat.shape[0], w2.shape[0])
        for start, end in tile_bounds(flat.shape[0], tile_tokens):
            tile = flat[start:end]
            out[start:end] = F.linear(F.silu(F.linear(tile, w1)) * F.linear(tile, w3), w2)
        ctx.tile_tokens = tile_tokens
        ctx.save_for_backward(x, w1, w2, w3)
        return out.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, w1, w2, w3 = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        grad_flat = grad_out.reshape(-1, grad_out.shape[-1])
        need_x, need_w1, need_w2, need_w3 = ctx.needs_input_grad[:4]
        grad_x = torch.empty_like(flat) if need_x else None
        grad_w = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need else None
                  for w, need in ((w1, need_w1), (w2, need_w2), (w3, need_w3))]
        for start, end in tile_bounds(flat.shape[0], ctx.tile_tokens):
            tile, grad_tile = flat[start:end], grad_flat[start:end]
            gate_pre, up = F.linear(tile, w1), F.linear(tile, w3)
            gate = F.silu(gate_pre)
            if need_w2:
                accumulate_matmul(grad_w[1], grad_tile.t(), gate * up)
            grad_hidden = torch.mm(grad_tile, w2)
            grad_gate_pre = torch.ops.aten.silu_backward(grad_hidden * up, gate_pre)
            grad_up = grad_hidden * gate
            del gate_pre, gate, up, grad_hidden
            if need_x:
                tile_grad = torch.mm(grad_gate_pre, w1)
                tile_grad += torch.mm(grad_up, w3)
                grad_x[start:end] = tile_grad
                del tile_grad
            if need_w1:
                accumulate_matmul(grad_w[0], grad_gate_pre.t(), tile)
            if need_w3:
                accumulate_matmul(grad_w[2], grad_up.t(), tile)
        grads = [None if g is None else g.to(w.dtype) for g, w in zip(grad_w, (w1, w2, w3), strict=True)]
        return (None if grad_x is None else grad_x.view(x.shape)), *grads, None


class TiledFeedForward(nn.Module):
    """A Llama3/Qwen3 ``FeedForward`` with the same ``w1``/``w2``/``w3`` (names, parameters,
    state dict, FSDP grouping and ``init_weights`` unchanged), computed over sequence tiles."""

    def __init__(self, source: nn.Module, tile_tokens: int) -> None:
        super().__init__()
        for name, child in source.named_children():
            setattr(self, name, child)
        self._source_class = type(source)
        self.tile_tokens = tile_tokens
        """0: d_model tokens, resolved at each call from the input width."""

    def init_weights(self, init_std: float) -> None:
        self._source_class.init_weights(self, init_std)

    def extra_repr(self) -> str:
        return f"tile_tokens={self.tile_tokens or 'd_model'}"

    def forward(self, x: Tensor) -> Tensor:
        tile = self.tile_tokens or x.shape[-1]
        return TiledSwiGLUFunction.apply(x, self.w1.weight, self.w2.weight, self.w3.weight, tile)


def is_swiglu_feed_forward(module: nn.Module | None, what: str = "tiled_mlp") -> bool:
    """A registered family's dense feed-forward (``model_protocol.FeedForwardModule``: TorchTitan's
    Llama3/Qwen3 ``FeedForward``), whose forward is ``w2(silu(w1 x) * w3 x)``."""
    return MODEL_CLASSES.require(what).feed_forward_family(module) is not None

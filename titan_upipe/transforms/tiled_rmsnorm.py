"""``tiled_rmsnorm``: RMSNorm over sequence tiles (paper section 2.3).

``nn.RMSNorm`` upcasts its whole input to fp32 for the statistics (a full-size fp32
temporary, twice the activation in bf16) and autograd keeps what its backward needs. Here
each tile is normalised by ``F.rms_norm`` itself (so every output row is the module's own
result), nothing is recorded, and the backward recomputes tile by tile with autograd on that
tile alone, summing the weight gradient in fp32. Saved: the input and the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from titan_upipe.transforms.tiling import tile_bounds

Tensor = torch.Tensor


class TiledRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float | None, tile_tokens: int) -> Tensor:
        width = x.shape[-1]
        flat = x.reshape(-1, width)
        out = None
        for start, end in tile_bounds(flat.shape[0], tile_tokens):
            y = F.rms_norm(flat[start:end], (width,), weight, eps)
            if out is None:
                out = flat.new_empty(flat.shape, dtype=y.dtype)
            out[start:end] = y
            del y
        ctx.eps, ctx.tile_tokens = eps, tile_tokens
        ctx.save_for_backward(x, weight)
        return out.view(x.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        width = x.shape[-1]
        flat, grad_flat = x.reshape(-1, width), grad_out.reshape(-1, width)
        need_x = ctx.needs_input_grad[0]
        need_w = weight is not None and ctx.needs_input_grad[1]
        grad_x = torch.empty_like(flat) if need_x else None
        grad_w = torch.zeros(width, dtype=torch.float32, device=x.device) if need_w else None
        for start, end in tile_bounds(flat.shape[0], ctx.tile_tokens):
            with torch.enable_grad():
                tile = flat[start:end].detach().requires_grad_(need_x)
                w = None if weight is None else weight.detach().requires_grad_(need_w)
                y = F.rms_norm(tile, (width,), w, ctx.eps)
                leaves = [t for t, need in ((tile, need_x), (w, need_w)) if need]
                grads = list(torch.autograd.grad(y, leaves, grad_flat[start:end]))
            if need_x:
                grad_x[start:end] = grads.pop(0)
            if need_w:
                grad_w += grads.pop(0)
            del y, grads, tile
        return (None if grad_x is None else grad_x.view(x.shape),
                None if grad_w is None else grad_w.to(weight.dtype), None, None)


class TiledRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same weight, eps, state dict, ``reset_parameters``) computed over tiles."""

    def __init__(self, source: nn.RMSNorm, tile_tokens: int) -> None:
        if len(source.normalized_shape) != 1:
            raise ValueError(f"tiled RMSNorm normalises the last dimension only, got {source.normalized_shape}")
        super().__init__(source.normalized_shape, eps=source.eps, elementwise_affine=False,
                         device="meta")
        self.elementwise_affine = source.elementwise_affine
        self.weight = source.weight  # the very same Parameter (or None)
        self.tile_tokens = tile_tokens
        """0: d_model tokens, resolved at each call from the input width."""

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tile_tokens={self.tile_tokens or 'd_model'}"

    def forward(self, x: Tensor) -> Tensor:
        return TiledRMSNormFunction.apply(x, self.weight, self.eps, self.tile_tokens or x.shape[-1])

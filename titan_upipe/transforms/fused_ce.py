"""``fused_ce``: output projection and cross-entropy in one step, never materialising ``[S, V]``.

The stock path computes ``logits = h Wᵀ`` in the model dtype, an fp32 copy, log-softmax and
the loss: ≈ 6–12 bytes × vocab per token (paper Table 1, "240 · S · d"). Here:

* ``torch`` (any device): :class:`ChunkedLinearCrossEntropy`. Forward walks chunks of tokens:
  logits of the chunk (``F.linear`` in the model dtype, then fp32, as the stock loss does),
  fp32 log-sum-exp and the summed loss of the non-ignored tokens; it keeps only the per-token
  fp32 LSE. Backward recomputes each chunk's logits, forms ``softmax - onehot`` in fp32, casts
  it to the model dtype (as autograd does through the stock ``.float()``), and accumulates
  ``dh`` per chunk and ``dW`` in fp32.
* ``liger`` (CUDA, ``liger-kernel`` installed): Liger's fused linear cross-entropy with
  ``reduction="sum"`` (its chunked Triton kernels, fp32 accumulation).

Both return the *sum* over non-ignored tokens, exactly what TorchTitan's ``cross_entropy_loss``
returns; the trainer divides by the global count of non-ignored tokens (over data-parallel and
CP ranks and gradient-accumulation steps), so the loss and gradients are the single-device mean.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from titan_upipe.errors import ConfigError
from titan_upipe.spec.settings import CE_BACKEND_NAMES
from titan_upipe.transforms.tiling import accumulate_matmul, tile_bounds

Tensor = torch.Tensor

IGNORE_INDEX = -100  # TorchTitan's (and torch's) default


def default_chunk_tokens(n_tokens: int, dim: int, vocab: int) -> int:
    """Chunk whose logits hold about as many values as the hidden states (Liger's rule)."""
    return max(1, min(n_tokens, math.ceil(n_tokens * dim / vocab)))


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` against ``labels``, chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int) -> Tensor:
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=hidden.device)
        for start, end in tile_bounds(flat.shape[0], chunk_tokens):
            logits = F.linear(flat[start:end], weight).float()
            chunk_lse = torch.logsumexp(logits, dim=-1)
            target = targets[start:end]
            valid = target != IGNORE_INDEX
            picked = logits.gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1)
            loss += torch.where(valid, chunk_lse - picked, 0.0).sum()
            lse[start:end] = chunk_lse
            del logits, chunk_lse, picked
        ctx.chunk_tokens = chunk_tokens
        ctx.save_for_backward(hidden, weight, labels, lse)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: Tensor):
        hidden, weight, labels, lse = ctx.saved_tensors
        flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(flat) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start, end in tile_bounds(flat.shape[0], ctx.chunk_tokens):
            chunk = flat[start:end]
            target = targets[start:end]
            valid = target != IGNORE_INDEX
            grad_logits = F.linear(chunk, weight).float().sub_(lse[start:end, None]).exp_()
            rows = torch.arange(end - start, device=chunk.device)
            grad_logits[rows, target.clamp_min(0)] -= 1.0
            grad_logits.mul_((valid.to(grad_logits.dtype) * grad_loss).unsqueeze(1))
            grad_logits = grad_logits.to(chunk.dtype)  # the stock loss's .float() backward
            if need_h:
                grad_h[start:end] = torch.mm(grad_logits, weight)
            if need_w:
                accumulate_matmul(grad_w, grad_logits.t(), chunk)
            del grad_logits
        return (None if grad_h is None else grad_h.view(hidden.shape),
                None if grad_w is None else grad_w.to(weight.dtype), None, None)


CE_BACKENDS = CE_BACKEND_NAMES
"""Values of ``[transforms] ce_backend``."""


def liger_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(name: str) -> str:
    """``auto`` -> ``liger`` when usable here, else ``torch``; ``liger`` must be usable."""
    if name == "auto":
        return "liger" if liger_available() else "torch"
    if name == "liger" and not liger_available():
        raise ConfigError("transforms.ce_backend = 'liger' needs CUDA and liger-kernel (pip install liger-kernel): "
                          "valid values here are auto, torch")
    return name


def _liger_sum(hidden: Tensor, weight: Tensor, labels: Tensor) -> Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    out = liger_fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
        ignore_index=IGNORE_INDEX, reduction="sum",
    )
    return (out[0] if isinstance(out, tuple) else out).float()


class FusedCrossEntropyHead(nn.Linear):
    """The model's output ``nn.Linear`` (same weight Parameter and FQN ``output.weight``) whose
    call with labels returns the summed cross-entropy instead of logits.

    Called by the loss function (not by the model's forward), which FSDP2 supports as a
    standalone call of a module of the ``[norm, output]`` group: its pre-forward hook
    unshards the weight first, so a sharded output weight works unchanged.
    """

    def __init__(self, source: nn.Linear, chunk_tokens: int, backend: str) -> None:
        if source.bias is not None:
            raise ConfigError("fused_ce supports output projections without bias (Llama3, Qwen3)")
        super().__init__(source.in_features, source.out_features, bias=False, device="meta")
        self.weight = source.weight
        self.chunk_tokens = chunk_tokens
        """0: :func:`default_chunk_tokens`."""
        self.backend = backend

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend}, chunk_tokens={self.chunk_tokens or 'auto'}"

    def forward(self, hidden: Tensor, labels: Tensor | None = None) -> Tensor:
        if labels is None:  # plain logits, e.g. for generation
            return F.linear(hidden, self.weight)
        if self.backend == "liger":
            return _liger_sum(hidden, self.weight, labels)
        n_tokens = labels.numel()
        chunk = self.chunk_tokens or default_chunk_tokens(n_tokens, self.in_features, self.out_features)
        return ChunkedLinearCrossEntropy.apply(hidden, self.weight, labels, chunk)
